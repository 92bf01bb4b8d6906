"""Where one request's decode step goes (chapter 解码: a small model on a laptop).

``python -m minillm bench step-breakdown``: one request of a real model (default the SmolLM2-135M
GGUF) decodes at batch 1 through the whole engine, eager. Its steps are first timed by the wall
clock alone, then run again under torch's profiler with every op labelled by the part of the step it
belongs to: the layers' matmuls, the output layer, attention (storing K/V and attending), the
norms, RoPE, sampling; ops outside these (embedding lookup, residual adds, SwiGLU's product, the
step's input tensors) are "other ops", and what the profiled step took beyond all ops is Python
(modules, the scheduler, the runner) and the profiler's own cost. Beside it, the step's floor
``max(F/P, M/W)`` from the ledger (the bytes a step really reads, ``estimate.decode_read_bytes``,
plus its KV) at this machine's probed ceilings, measured under the same threads. The chapter's lab
uses the same pieces: ``decoding_request``, ``profiled_parts`` and ``step_floor``, and times the
step's fixed cost on a copy of the model shrunk to ``SAME_OPS_WIDTHS``.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch
from torch import nn

from minillm.engine import model as model_module
from minillm.engine import model_runner
from minillm.engine.device import synchronize
from minillm.engine.engine_config import add_quantization_options
from minillm.engine.llm import LLM
from minillm.engine.loader import checkpoint_weights, torch_dtype
from minillm.engine.model import RMSNorm
from minillm.engine.quantization import Int4Linear, Int8Linear
from minillm.engine.sampling import SamplingParams
from minillm.engine.units import ceil_div
from minillm.lab import estimate as ledger
from minillm.lab.bench_cli import add_options, report
from minillm.lab.hardware import describe_device, measure_seconds, probe_device

PARTS = ("matmuls", "output layer", "attention", "norms", "rope", "sampling")
OTHER, PYTHON = "other ops", "Python and the rest"
LINEARS = (nn.Linear, Int8Linear, Int4Linear)
FUNCTIONS = {model_module: {"apply_rope": "rope", "store_kv": "attention",
                            "paged_decode_attention": "attention"},
             model_runner: {"sample": "sampling"}}  # module-level functions the step calls, by part
LABEL = "minillm/"  # the profiler ranges' prefix
WARMUP = 3  # untimed decode steps before the caller's
# Every width cut to tens: a copy of a model with these keeps its layers, heads and ops per layer,
# while its weights and KV hardly take a byte (the step's fixed cost, issuing the ops).
SAME_OPS_WIDTHS = dict(hidden_size=64, intermediate_size=128, head_dim=16, vocab_size=512)


def _part(name: str, module: nn.Module) -> str | None:
    if isinstance(module, RMSNorm):
        return "norms"
    if isinstance(module, LINEARS):
        return "output layer" if name == "lm_head" else "matmuls"
    return None


@contextlib.contextmanager
def labelled(model: nn.Module):
    """Inside the block every norm, linear and the step's attention, RoPE and sampling functions
    run inside a profiler range named ``minillm/<part>``; outside it the engine is as it was."""
    handles, saved, open_ranges = [], [], []

    def enter(label):
        def hook(*_):
            open_ranges.append(torch.profiler.record_function(LABEL + label).__enter__())
        return hook

    def leave(*_):
        open_ranges.pop().__exit__(None, None, None)

    def wrapped(fn, label):
        def call(*args, **kwargs):
            with torch.profiler.record_function(LABEL + label):
                return fn(*args, **kwargs)
        return call

    for name, module in model.named_modules():
        part = _part(name, module)
        if part is not None:
            handles += [module.register_forward_pre_hook(enter(part)), module.register_forward_hook(leave)]
    for owner, functions in FUNCTIONS.items():
        for name, part in functions.items():
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, wrapped(getattr(owner, name), part))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def breakdown(events, wall_seconds: float, steps: int) -> dict[str, float]:
    """Seconds per step of each part, of the other ops and of the rest, from the profiler's events
    of ``steps`` steps that took ``wall_seconds`` under it: top-level events only (a labelled
    range holds its ops)."""
    parts = dict.fromkeys(PARTS + (OTHER,), 0.0)
    for event in events:
        if event.cpu_parent is None:
            part = event.name.removeprefix(LABEL) if event.name.startswith(LABEL) else OTHER
            parts[part] += event.cpu_time_total * 1e-6 / steps
    parts[PYTHON] = wall_seconds / steps - sum(parts.values())
    return parts


def step_floor(model, kv_dtype: torch.dtype, ctx: int, peak_flops: float, bandwidth: float) -> ledger.Floor:
    """``max(F/P, M/W)`` of one decode step of ``model`` at context ``ctx``: the weights it reads
    (its quantization's bytes) and its KV (``kv_dtype``), its matmul and attention FLOPs."""
    cfg, dtype = model.config, str(model.dtype).removeprefix("torch.")
    quantization, group_size = model.quantization or (None, 32)
    nbytes = (ledger.decode_read_bytes(cfg, dtype, quantization, group_size)
              + ledger.kv_bytes(cfg, ctx, kv_dtype))
    flops = ledger.matmul_flops_per_token(cfg) + ledger.attention_flops_per_token(cfg, ctx)
    return ledger.roofline_floor(flops, nbytes, peak_flops, bandwidth)


def decoding_request(model, ctx: int, steps: int, seed: int = 0, **engine_args) -> LLM:
    """An engine over ``model`` (a loaded ``Transformer``, or what ``LLM`` loads with
    ``engine_args``) holding one request of ``ctx`` random prompt tokens, prefilled and past a few
    untimed decode steps, with KV room and tokens left for ``steps`` more. Its steps are eager
    (every op issued from Python, no CUDA graph), so that each op can be labelled."""
    for name, value in (("ctx", ctx), ("steps", steps)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    new_tokens = 1 + WARMUP + steps  # the prefill's, the warm-up's and the caller's
    llm = LLM(model, num_kv_blocks=ceil_div(ctx + new_tokens, 16), max_model_len=ctx + new_tokens,
              enforce_eager=True, **engine_args)
    prompt = torch.randint(llm.model.config.vocab_size, (ctx,), generator=torch.Generator().manual_seed(seed))
    llm.add_request("decode", prompt.tolist(), SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    for _ in range(1 + WARMUP):  # the prefill, then untimed decode steps
        llm.step()
    return llm


def profiled_parts(llm: LLM, steps: int) -> dict[str, float]:
    """Run ``steps`` decode steps of ``llm`` under torch's profiler, every op labelled by the part
    of the step it belongs to: seconds per step of each part (:func:`breakdown`); they add up to
    the profiled step."""
    device = llm.model.device
    with labelled(llm.model), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            llm.step()
        synchronize(device)
        wall = time.perf_counter() - start
    return breakdown(prof.events(), wall, steps)


def bench_step_breakdown(model_name: str = "smollm2-135m", device=None, dtype=None, quantization=None,
                         group_size: int = 32, kv_cache_dtype: str = "auto", ctx: int = 128, steps: int = 32,
                         seed: int = 0) -> dict:
    """Time ``steps`` decode steps of one request at a context of about ``ctx`` tokens (wall
    clock, then under the profiler) and split the profiled step into its parts. A preset without
    weights runs with random ones at its shape."""
    llm = decoding_request(model_name, ctx, 2 * steps, seed, device=device, dtype=torch_dtype(dtype),
                           weights=checkpoint_weights(model_name), quantization=quantization,
                           group_size=group_size, kv_cache_dtype=kv_cache_dtype)
    model = llm.model
    step = statistics.median(measure_seconds(llm.step, model.device, steps, warmup=0))
    parts = profiled_parts(llm, steps)
    probe = probe_device(model.device)
    floor = step_floor(model, llm.kv_cache.kv.dtype, ctx + steps, probe.matmul_flops, probe.copy_bandwidth)
    method, group_size = model.quantization or ("none", None)
    quant = f"{method}-g{group_size}" if method == "int4" else method
    return {"model": model.config.name, "dtype": str(model.dtype).removeprefix("torch."), "quantization": quant,
            "device": describe_device(model.device).name, "cpu_threads": torch.get_num_threads(),
            "ctx": ctx, "steps": steps, "step_s": step, "tokens_per_s": 1 / step,
            "profiled_step_s": sum(parts.values()), "parts_s": parts,
            "floor": {"seconds": floor.seconds, "bound": floor.bound, "flops": floor.flops, "bytes": floor.bytes,
                      "peak_flops": floor.peak_flops, "bandwidth": floor.bandwidth},
            "floor_share": floor.seconds / step}


def format_step_breakdown(r: dict) -> str:
    side = "F/P" if r["floor"]["bound"] == "compute" else "M/W"
    lines = [f"{r['model']} ({r['dtype']}, quantization {r['quantization']}) on {r['device']}, "
             f"{r['cpu_threads']} CPU threads; one request, context {r['ctx']}, {r['steps']} steps",
             f"decode step {r['step_s'] * 1e3:.2f} ms ({r['tokens_per_s']:.1f} tok/s); floor "
             f"{r['floor']['seconds'] * 1e3:.2f} ms ({r['floor']['bound']}: {side}) = "
             f"{r['floor_share']:.0%} of the step",
             f"under the profiler {r['profiled_step_s'] * 1e3:.2f} ms per step:"]
    width = max(map(len, r["parts_s"]))
    lines += [f"  {part:<{width}} {s * 1e3:>8.2f} ms {s / r['profiled_step_s']:>5.0%}"
              for part, s in r["parts_s"].items()]
    return "\n".join(lines)


def add_cli(bench_commands) -> None:
    cmd = bench_commands.add_parser("step-breakdown", help="where a batch-1 decode step goes (profiler), "
                                                           "beside its floor")
    add_options(cmd, model="smollm2-135m", out=None)
    add_quantization_options(cmd)
    cmd.add_argument("--ctx", type=int, default=128, help="prompt tokens before the timed steps")
    cmd.add_argument("--steps", type=int, default=32, help="decode steps timed, and as many profiled")
    cmd.add_argument("--json", action="store_true", help="print one JSON object")
    cmd.set_defaults(func=run_cli)


def run_cli(args) -> int:
    import json

    return report(args, "step-breakdown", {}, lambda device: bench_step_breakdown(
        args.model, device, args.dtype, args.quantization, args.group_size, args.kv_cache_dtype, args.ctx, args.steps),
        json.dumps if args.json else format_step_breakdown)
