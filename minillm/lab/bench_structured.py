"""What structured output costs a decode step (chapter: serving over HTTP): the grammar's mask
against the step it is part of.

Two engines share one loaded model. One decodes ``batch`` plain greedy requests; the other the same
prompts with a JSON schema (a list of at least ``steps // 8 + 1`` people, so no answer can end
before the run does). They step in turns, one decode step each; before each structured step the
mask it is about to compute is timed on its own, at the grammar states the run has reached: the
bitmask filled on the CPU by each request's matcher, then applied to a ``[batch, vocab]`` logits
tensor on the device. Printed: the medians of the plain step, the structured step (its mask
inside), the mask and its two parts, and the mask over the plain step.
"""
from __future__ import annotations

import json
import statistics

import torch

from minillm.engine.llm import LLM
from minillm.engine.loader import load_model
from minillm.engine.sampling import SamplingParams
from minillm.engine.structured import StructuredOutputsParams
from minillm.lab.bench_cli import add_options, report
from minillm.lab.bench_serve import torch_threads
from minillm.lab.hardware import time_once
from minillm.lab.machine_profile import CPU_THREADS

NUM_KV_BLOCKS = 256  # of 16 tokens: room for the default batch's prompts and answers


def people_schema(min_items: int) -> dict:
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "city": {"type": "string"}},
              "required": ["name", "age", "city"]}
    return {"type": "object", "properties": {"people": {"type": "array", "items": person, "minItems": min_items}},
            "required": ["people"]}


def bench_structured(model_name: str = "smollm2-135m", device=None, dtype=None, batch: int = 8,
                     steps: int = 32, threads: int | None = CPU_THREADS) -> dict:
    """Median seconds per decode step without and with a grammar, of the mask (``fill_s`` +
    ``apply_s``) and ``mask_share``, the mask over the plain step, over ``steps`` decode steps of
    ``batch`` requests. ``threads``: torch's CPU threads meanwhile (None: as they are)."""
    for name, value in (("batch", batch), ("steps", steps)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    with torch_threads(threads):
        return _bench(model_name, device, dtype, batch, steps)


def _bench(model_name, device, dtype, batch: int, steps: int) -> dict:
    model = load_model(model_name, device=device, dtype=dtype)
    plain, structured = LLM(model, num_kv_blocks=NUM_KV_BLOCKS), LLM(model, num_kv_blocks=NUM_KV_BLOCKS)
    prompts = [plain.chat_prompt_ids([{"role": "user", "content": f"List {i + 3} fictional people as JSON: "
                                                                  f"name, age and city."}]) for i in range(batch)]
    schema = StructuredOutputsParams(json=people_schema(steps // 8 + 1))
    for i, prompt in enumerate(prompts):
        plain.add_request(i, prompt, SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True))
        structured.add_request(i, prompt, SamplingParams(temperature=0.0, max_tokens=steps + 2,
                                                         structured_outputs=schema))
    plain.step(), structured.step()  # the prompts
    grammar, ids = structured.runner.structured, [str(i) for i in range(batch)]
    logits = torch.zeros(batch, model.config.vocab_size, device=model.device)
    grammar.apply(logits, *grammar.fill(ids))  # warm-up (on a GPU, the first apply compiles its kernel)
    times = {"plain": [], "structured": [], "fill": [], "apply": []}
    for _ in range(steps):
        times["plain"].append(time_once(plain.step, model.device))
        filled = {}
        times["fill"].append(time_once(lambda: filled.update(mask=grammar.fill(ids)), model.device))
        times["apply"].append(time_once(lambda: grammar.apply(logits, *filled["mask"]), model.device))
        times["structured"].append(time_once(structured.step, model.device))
    for llm in (plain, structured):
        for request_id in list(llm.scheduler.requests):
            llm.abort(request_id)
        llm.step()
    median = {name: statistics.median(values) for name, values in times.items()}
    mask = median["fill"] + median["apply"]
    return {"model": model.config.name, "device": str(model.device), "cpu_threads": torch.get_num_threads(),
            "dtype": str(model.dtype).removeprefix("torch."), "batch": batch, "steps": steps,
            "decode_step_s": median["plain"], "structured_step_s": median["structured"],
            "fill_s": median["fill"], "apply_s": median["apply"], "mask_s": mask,
            "mask_share": mask / median["plain"]}


def format_structured(r: dict) -> str:
    return "\n".join([
        f"model {r['model']} ({r['dtype']}) on {r['device']} ({r['cpu_threads']} CPU threads), batch {r['batch']}, "
        f"median of {r['steps']} decode steps, plain and structured in turns",
        f"decode step (plain): {r['decode_step_s'] * 1e3:.3f} ms",
        f"decode step (structured, mask inside): {r['structured_step_s'] * 1e3:.3f} ms",
        f"mask (fill + apply): {r['mask_s'] * 1e3:.3f} ms = fill {r['fill_s'] * 1e3:.3f} ms (CPU, "
        f"{r['batch']} matchers) + apply {r['apply_s'] * 1e3:.3f} ms",
        f"mask / decode step: {r['mask_share']:.2%}"])


# --- python -m minillm bench structured ---------------------------------------------------------------

def add_cli(bench_commands) -> None:
    cmd = bench_commands.add_parser("structured", help="the grammar mask's cost per decode step (fill + "
                                                       "apply) beside the decode step")
    add_options(cmd, model="smollm2-135m", out=None, threads=False)  # its own --threads: the labs' policy
    cmd.add_argument("--batch", type=int, default=8, help="requests decoding together (default 8)")
    cmd.add_argument("--steps", type=int, default=32, help="decode steps timed (default 32)")
    cmd.add_argument("--threads", type=int, default=CPU_THREADS,
                     help=f"torch's CPU threads during the runs (default {CPU_THREADS})")
    cmd.add_argument("--json", action="store_true", help="print one JSON object")
    cmd.set_defaults(func=run_cli)


def run_cli(args) -> int:
    return report(args, "structured", {}, lambda device: bench_structured(
        args.model, device, args.dtype, args.batch, args.steps, args.threads),
        json.dumps if args.json else format_structured)
