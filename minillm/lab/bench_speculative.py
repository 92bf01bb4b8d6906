"""Speculative decoding on and off (chapter 投机解码): tokens per step, acceptance and wall time;
by prompt lookup (``method="ngram"``) or by a draft of the model's own first layers
(``method="draft_layers"``), whose measured price is printed too: the time of one draft pass over
the time of a plain decode step (c), the verify step's time over a plain step's (v), and the
speedup they predict with the measured accepted length τ and proposals per verify γ:
τ / (γ·c + v).

The prompts are input-grounded: the real model is asked to repeat a paragraph of real English (the
Python Language Reference's help topics, as in ``bench quality``), so its answer quotes its
prompt and n-gram proposals can hit. The same greedy requests run through two engines over one
loaded model, speculation off and on, in turns (off, on, off, on, ...), each timed from the first
request in to the last token out; a first short untimed run of each warms it up. The outputs must be
token for token the same, and are checked. On the CPU torch gets ``threads`` threads (default 1,
the labs' policy): on a small, shared CPU more threads make the few-row matmuls of a verify step
wait on each other, and the ratio would measure that instead.
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from minillm.engine.engine_config import SPECULATIVE_METHODS, SpeculativeConfig
from minillm.engine.llm import LLM
from minillm.engine.loader import load_model
from minillm.engine.sampling import SamplingParams
from minillm.lab.bench_cli import add_options, report
from minillm.lab.bench_serve import torch_threads
from minillm.lab.machine_profile import CPU_THREADS
from minillm.lab.bench_quality import quality_text

PARAGRAPH_WORDS = 60
NUM_KV_BLOCKS = 512  # of 16 tokens: room for the batches this bench runs
WARMUP_TOKENS = 8  # each request's tokens in the untimed first run


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
                      threads: int | None = CPU_THREADS, task: str = "grounded", method: str = "ngram",
                      num_draft_layers: int | None = None) -> dict:
    """Median wall time off and on over ``repeats`` turns, their ratio, tokens per decode step,
    the acceptance rate (accepted / proposed, vLLM's), the mean tokens per verified request-step
    and ``alpha``, the share of the proposals the target compared that it accepted: it compares
    them in order and stops at the first miss, so the compared ones are the accepted ones and one
    per verify that missed. That is the per-position α of τ = (1 − α^(γ+1)) / (1 − α); the
    acceptance rate counts the proposals after a miss too, which were never compared.
    ``threads``: torch's CPU threads meanwhile (None: as they are); ``task``: "grounded" (repeat a
    given paragraph) or "open" (open-ended questions); ``method`` "draft_layers" drafts with the
    first ``num_draft_layers`` layers (and adds the draft's measured price)."""
    if method == "draft_layers":
        spec = {"method": method, "num_speculative_tokens": num_speculative_tokens, "num_draft_layers": num_draft_layers}
    else:
        spec = {"method": method, "num_speculative_tokens": num_speculative_tokens,
                "prompt_lookup_max": prompt_lookup_max, "prompt_lookup_min": prompt_lookup_min}
    SpeculativeConfig.from_dict(spec)  # refused before the model is loaded
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    with torch_threads(threads):
        return _bench(model_name, device, dtype, batch, max_tokens, repeats, task, spec)


def _bench(model_name, device, dtype, batch: int, max_tokens: int, repeats: int, task: str, spec: dict) -> dict:
    model = load_model(model_name, device=device, dtype=dtype)
    engines = {"off": LLM(model, num_kv_blocks=NUM_KV_BLOCKS),
               "on": LLM(model, num_kv_blocks=NUM_KV_BLOCKS, speculative_config=spec)}
    prompts = [engines["off"].chat_prompt_ids([{"role": "user", "content": p}])
               for p in (grounded_prompts if task == "grounded" else open_prompts)(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for llm in engines.values():
        _run(llm, prompts, SamplingParams(temperature=0.0, max_tokens=min(max_tokens, WARMUP_TOKENS)))
    seconds, answers, stats = {"off": [], "on": []}, {}, {}
    draft = engines["on"].runner.draft
    for _ in range(repeats):
        for name, llm in engines.items():
            passes, draft_s = (draft.num_passes, draft.seconds) if draft else (0, 0.0)
            elapsed, answers[name], stats[name] = _run(llm, prompts, params)
            seconds[name].append(elapsed)
            if draft and name == "on":  # the last turn's draft passes
                passes, draft_s = draft.num_passes - passes, draft.seconds - draft_s
    off_s, on_s = statistics.median(seconds["off"]), statistics.median(seconds["on"])
    on = stats["on"]
    missed = sum(n > 0 for step in on["steps"] for n in step["num_rejected"].values())  # verifies that missed

    def tokens_per_step(s: dict) -> float:  # generated tokens over the steps that generated any
        steps = [step for step in s["steps"] if step["num_generated"]]
        return s["generation_tokens"] / len(steps)

    return {"model": model.config.name, "device": str(model.device), "cpu_threads": torch.get_num_threads(),
            "dtype": str(model.dtype).removeprefix("torch."), "batch": batch, "task": task, "max_tokens": max_tokens,
            "repeats": repeats, "speculative_config": spec, "off_s": off_s, "on_s": on_s,
            "speedup": off_s / on_s, "identical": answers["on"] == answers["off"],
            "generation_tokens": on["generation_tokens"],
            "tokens_per_step_off": tokens_per_step(stats["off"]), "tokens_per_step_on": tokens_per_step(on),
            "num_drafts": on["num_drafts"], "num_draft_tokens": on["num_draft_tokens"],
            "num_accepted_tokens": on["num_accepted_tokens"],
            "acceptance_rate": on["num_accepted_tokens"] / on["num_draft_tokens"] if on["num_draft_tokens"] else 0.0,
            "mean_accepted_length": 1 + on["num_accepted_tokens"] / on["num_drafts"] if on["num_drafts"] else 1.0,
            "num_missed_drafts": missed,
            "alpha": on["num_accepted_tokens"] / (on["num_accepted_tokens"] + missed) if on["num_drafts"] else 0.0,
            **(draft_price(stats["off"], on, passes, draft_s) if draft else {})}


def draft_price(off: dict, on: dict, passes: int, draft_s: float) -> dict:
    """The draft's measured price in one run: ``target_step_s``, the mean plain decode step (no
    prompt tokens) with speculation off; ``draft_pass_s``, the mean draft pass; ``verify_step_s``,
    the mean step that verified proposals, less its draft passes; ``draft_cost`` c and
    ``verify_cost`` v, those two over a plain step; ``proposals_per_verify`` γ (proposed tokens
    per verified request-step) and ``predicted_speedup`` τ / (γ·c + v)."""
    def mean_s(steps):
        return statistics.fmean(s["end"] - s["start"] for s in steps)

    target = mean_s([s for s in off["steps"] if s["num_decode_tokens"] and not s["num_prefill_tokens"]])
    verify_steps = [s for s in on["steps"] if s["num_draft_tokens"]]
    verify = (sum(s["end"] - s["start"] for s in verify_steps) - draft_s) / len(verify_steps)
    c, v = draft_s / passes / target, verify / target
    gamma = on["num_draft_tokens"] / on["num_drafts"]
    tau = 1 + on["num_accepted_tokens"] / on["num_drafts"]
    return {"target_step_s": target, "draft_pass_s": draft_s / passes, "verify_step_s": verify,
            "draft_cost": c, "verify_cost": v, "proposals_per_verify": gamma,
            "predicted_speedup": tau / (gamma * c + v)}


def format_speculative(r: dict) -> str:
    spec = r["speculative_config"]
    how = (f"a draft of the first {spec['num_draft_layers']} layers" if spec["method"] == "draft_layers"
           else f"n-gram speculation, n in [{spec['prompt_lookup_min']}, {spec['prompt_lookup_max']}]")
    lines = [
        f"model {r['model']} ({r['dtype']}) on {r['device']} ({r['cpu_threads']} CPU threads), {r['task']} prompts, "
        f"batch {r['batch']}, {r['max_tokens']} tokens "
        f"each, {how}, k={spec['num_speculative_tokens']}, median of {r['repeats']} turns",
        f"wall time: off {r['off_s']:.3f} s, on {r['on_s']:.3f} s, speedup {r['speedup']:.2f}x; "
        f"outputs {'identical' if r['identical'] else 'DIFFERENT'}",
        f"tokens per step: off {r['tokens_per_step_off']:.2f}, on {r['tokens_per_step_on']:.2f} "
        f"({r['tokens_per_step_on'] / r['tokens_per_step_off']:.2f}x)",
        f"proposed {r['num_draft_tokens']}, accepted {r['num_accepted_tokens']}: acceptance rate "
        f"{r['acceptance_rate']:.2%}, mean accepted length {r['mean_accepted_length']:.2f} tokens per verify",
        f"{r['num_missed_drafts']} verifies stopped at a miss: per-position acceptance alpha {r['alpha']:.2%}"]
    if "draft_cost" in r:
        lines.append(f"draft pass {r['draft_pass_s'] * 1e3:.2f} ms = {r['draft_cost']:.2f} x a target step "
                     f"({r['target_step_s'] * 1e3:.2f} ms); verify step {r['verify_cost']:.2f} x; "
                     f"predicted speedup tau / (gamma c + v) = {r['mean_accepted_length']:.2f} / "
                     f"({r['proposals_per_verify']:.2f} x {r['draft_cost']:.2f} + {r['verify_cost']:.2f}) "
                     f"= {r['predicted_speedup']:.2f}x")
    return "\n".join(lines)


# --- python -m minillm bench speculative ------------------------------------------------------------

def add_cli(bench_commands) -> None:
    cmd = bench_commands.add_parser("speculative", help="speculative decoding on and off: tokens per "
                                                        "step, acceptance, wall time (and the draft's price)")
    add_options(cmd, model="smollm2-135m", out=None, threads=False)  # its own --threads: the labs' policy by default
    cmd.add_argument("--batch", type=int, default=1)
    cmd.add_argument("--max-tokens", type=int, default=64)
    cmd.add_argument("--repeats", type=int, default=3)
    cmd.add_argument("--num-speculative-tokens", type=int, default=4)
    cmd.add_argument("--prompt-lookup-max", type=int, default=4)
    cmd.add_argument("--prompt-lookup-min", type=int, default=2)
    cmd.add_argument("--method", choices=SPECULATIVE_METHODS, default="ngram",
                     help="ngram: prompt lookup; draft_layers: the model's first --draft-layers layers draft")
    cmd.add_argument("--draft-layers", type=int, help="layers of the draft (with --method draft_layers)")
    cmd.add_argument("--threads", type=int, default=CPU_THREADS,
                     help=f"torch's CPU threads during the runs (default {CPU_THREADS})")
    cmd.add_argument("--task", choices=TASKS, default="grounded",
                     help="grounded: repeat a given paragraph; open: open-ended questions")
    cmd.add_argument("--json", action="store_true", help="print one JSON object")
    cmd.set_defaults(func=run_cli)


def run_cli(args) -> int:
    return report(args, "speculative", {}, lambda device: bench_speculative(
        args.model, device, args.dtype, args.batch, args.max_tokens, args.repeats,
        args.num_speculative_tokens, args.prompt_lookup_max, args.prompt_lookup_min, args.threads, args.task,
        args.method, args.draft_layers),
        json.dumps if args.json else format_speculative)
