"""Speculative decoding by prompt lookup, on and off (chapter 投机解码): tokens per step, acceptance
and wall time.

The prompts are input-grounded: the real model is asked to repeat a paragraph of real English (the
Python Language Reference's help topics, as in ``bench quality``), so its answer quotes its
prompt and n-gram proposals can hit. The same greedy requests run through two engines over one
loaded model, speculation off and on, in turns (off, on, off, on, ...), each timed from the first
request in to the last token out; a first untimed run of each warms it up. The outputs must be
token for token the same, and are checked. On the CPU torch gets ``threads`` threads (default 1,
the labs' policy): on a small, shared CPU more threads make the few-row matmuls of a verify step
wait on each other, and the ratio would measure that instead.
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from minillm.engine.llm import LLM
from minillm.engine.loader import load_model
from minillm.engine.sampling import SamplingParams
from minillm.lab.bench_cli import add_options, report
from minillm.lab.bench_serve import torch_threads
from minillm.lab.machine_profile import CPU_THREADS
from minillm.lab.bench_quality import quality_text

PARAGRAPH_WORDS = 60
NUM_KV_BLOCKS = 512  # of 16 tokens: room for the batches this bench runs


OPEN_QUESTIONS = ("Why is the sky blue?", "Write a short poem about autumn.",
                  "What should I pack for a weekend of hiking?", "Explain what a compiler does.",
                  "Give me three ideas for a birthday party.", "How do bees make honey?",
                  "What makes a good teacher?", "Describe a busy train station.")
TASKS = ("grounded", "open")


def open_prompts(count: int) -> list[str]:
    """``count`` open-ended questions (cycled): the answer has no text to quote."""
    return [OPEN_QUESTIONS[i % len(OPEN_QUESTIONS)] for i in range(count)]


def grounded_prompts(count: int) -> list[str]:
    """``count`` requests to repeat a different paragraph of the quality text word for word."""
    words = quality_text().split()
    return ["Repeat the following text word for word:\n\n"
            + " ".join(words[i * PARAGRAPH_WORDS:(i + 1) * PARAGRAPH_WORDS]) for i in range(count)]


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list, dict]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.token_ids for o in outputs], llm.stats()


def bench_speculative(model_name: str = "smollm2-135m", device=None, dtype=None, batch: int = 1,
                      max_tokens: int = 64, repeats: int = 3, num_speculative_tokens: int = 4,
                      prompt_lookup_max: int = 4, prompt_lookup_min: int = 2,
                      threads: int | None = CPU_THREADS, task: str = "grounded") -> dict:
    """Median wall time off and on over ``repeats`` turns, their ratio, tokens per decode step,
    the acceptance rate (accepted / proposed) and the mean tokens per verified request-step.
    ``threads``: torch's CPU threads meanwhile (None: as they are); ``task``: "grounded" (repeat a
    given paragraph) or "open" (open-ended questions)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    with torch_threads(threads):
        return _bench(model_name, device, dtype, batch, max_tokens, repeats, task, {
            "method": "ngram", "num_speculative_tokens": num_speculative_tokens,
            "prompt_lookup_max": prompt_lookup_max, "prompt_lookup_min": prompt_lookup_min})


def _bench(model_name, device, dtype, batch: int, max_tokens: int, repeats: int, task: str, spec: dict) -> dict:
    model = load_model(model_name, device=device, dtype=dtype)
    engines = {"off": LLM(model, num_kv_blocks=NUM_KV_BLOCKS),
               "on": LLM(model, num_kv_blocks=NUM_KV_BLOCKS, speculative_config=spec)}
    prompts = [engines["off"].chat_prompt_ids([{"role": "user", "content": p}])
               for p in (grounded_prompts if task == "grounded" else open_prompts)(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for llm in engines.values():
        _run(llm, prompts, params)  # warm-up
    seconds, answers, stats = {"off": [], "on": []}, {}, {}
    for _ in range(repeats):
        for name, llm in engines.items():
            elapsed, answers[name], stats[name] = _run(llm, prompts, params)
            seconds[name].append(elapsed)
    off_s, on_s = statistics.median(seconds["off"]), statistics.median(seconds["on"])
    on = stats["on"]

    def tokens_per_step(s: dict) -> float:  # generated tokens over the steps that generated any
        steps = [step for step in s["steps"] if step["num_generated"]]
        return s["generation_tokens"] / len(steps)

    return {"model": model.config.name, "device": str(model.device), "cpu_threads": torch.get_num_threads(),
            "dtype": str(model.dtype).removeprefix("torch."), "batch": batch, "task": task, "max_tokens": max_tokens,
            "repeats": repeats, "speculative_config": spec, "off_s": off_s, "on_s": on_s,
            "speedup": off_s / on_s, "identical": answers["on"] == answers["off"],
            "generation_tokens": on["generation_tokens"],
            "tokens_per_step_off": tokens_per_step(stats["off"]), "tokens_per_step_on": tokens_per_step(on),
            "num_draft_tokens": on["num_draft_tokens"], "num_accepted_tokens": on["num_accepted_tokens"],
            "acceptance_rate": on["num_accepted_tokens"] / on["num_draft_tokens"] if on["num_draft_tokens"] else 0.0,
            "mean_accepted_length": 1 + on["num_accepted_tokens"] / on["num_drafts"] if on["num_drafts"] else 1.0}


def format_speculative(r: dict) -> str:
    spec = r["speculative_config"]
    return "\n".join([
        f"model {r['model']} ({r['dtype']}) on {r['device']} ({r['cpu_threads']} CPU threads), {r['task']} prompts, "
        f"batch {r['batch']}, {r['max_tokens']} tokens "
        f"each, n-gram speculation k={spec['num_speculative_tokens']}, n in "
        f"[{spec['prompt_lookup_min']}, {spec['prompt_lookup_max']}], median of {r['repeats']} turns",
        f"wall time: off {r['off_s']:.3f} s, on {r['on_s']:.3f} s, speedup {r['speedup']:.2f}x; "
        f"outputs {'identical' if r['identical'] else 'DIFFERENT'}",
        f"tokens per step: off {r['tokens_per_step_off']:.2f}, on {r['tokens_per_step_on']:.2f} "
        f"({r['tokens_per_step_on'] / r['tokens_per_step_off']:.2f}x)",
        f"proposed {r['num_draft_tokens']}, accepted {r['num_accepted_tokens']}: acceptance rate "
        f"{r['acceptance_rate']:.2%}, mean accepted length {r['mean_accepted_length']:.2f} tokens per verify"])


# --- python -m minillm bench speculative ------------------------------------------------------------

def add_cli(bench_commands) -> None:
    cmd = bench_commands.add_parser("speculative", help="n-gram speculative decoding on and off: tokens "
                                                        "per step, acceptance and wall time")
    add_options(cmd, model="smollm2-135m", out=None)
    cmd.add_argument("--batch", type=int, default=1)
    cmd.add_argument("--max-tokens", type=int, default=64)
    cmd.add_argument("--repeats", type=int, default=3)
    cmd.add_argument("--num-speculative-tokens", type=int, default=4)
    cmd.add_argument("--prompt-lookup-max", type=int, default=4)
    cmd.add_argument("--prompt-lookup-min", type=int, default=2)
    cmd.add_argument("--threads", type=int, default=CPU_THREADS,
                     help=f"torch's CPU threads during the runs (default {CPU_THREADS})")
    cmd.add_argument("--task", choices=TASKS, default="grounded",
                     help="grounded: repeat a given paragraph; open: open-ended questions")
    cmd.add_argument("--json", action="store_true", help="print one JSON object")
    cmd.set_defaults(func=run_cli)


def run_cli(args) -> int:
    return report(args, "speculative", {}, lambda device: bench_speculative(
        args.model, device, args.dtype, args.batch, args.max_tokens, args.repeats,
        args.num_speculative_tokens, args.prompt_lookup_max, args.prompt_lookup_min, args.threads, args.task),
        json.dumps if args.json else format_speculative)
