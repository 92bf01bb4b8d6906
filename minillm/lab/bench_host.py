"""Where a decode step's time goes on the host (chapter 解码).

``python -m minillm bench host``: ``batch`` requests decode at a context of about ``ctx`` tokens.
The requests are set up by a real (small) model; then the model's forward is swapped for a stand-in
that returns its output at once, as a GPU does when the host only enqueues work, so each step's
wall time is the engine's own Python time (scheduling, building the step's inputs, moving requests
along, recording) plus the logits and the sampler, which are timed and taken off: no attention,
no matmul, no tensor work of the model is in it. It also counts what one eager decode forward of a
real model's layers launches, which a CUDA graph replaces by a single replay: the aten ops it
dispatches (on CUDA each launches at most one kernel; views launch none) and, on CUDA, the Triton
kernels it launches (the attention; on the CPU the torch reference runs instead).
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minillm.engine import model_runner
from minillm.engine.config import load_config
from minillm.engine.device import resolve_device, synchronize
from minillm.engine.llm import LLM
from minillm.engine.loader import load_model
from minillm.engine.sampling import SamplingParams
from minillm.engine.units import ceil_div
from minillm.lab.bench_cli import add_options, report
from minillm.lab.bench_step import SAME_OPS_WIDTHS

MEASURES = {  # what the record's numbers are
    "engine_seconds": "wall time of a decode step whose model forward is a no-op of the same interface "
                      "(no attention, no matmul), less its logits and sampling: the engine's own Python",
    "model_seconds": "the logits and the sampler of that step, timed (device waits included)",
    "launches": "per_layer, outside_layers, per_step: aten ops dispatched by one eager decode forward "
                "(on CUDA each launches at most one kernel, views none); triton_*: the Triton kernels "
                "it launches (none on the CPU, where the torch reference attention runs)",
}
HOST_MODEL = dict(num_layers=1, hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1,
                  head_dim=32, vocab_size=512)  # tiny: the engine, not the model, is measured


class LaunchCounter(TorchDispatchMode):
    """Inside the ``with`` block: the aten ops dispatched, and the compiled Triton kernels launched
    (Triton's ``launch_enter_hook``; its interpreter and the CPU's torch reference launch none)."""

    def __init__(self):
        super().__init__()
        self.aten_ops = 0
        self.triton_launches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.aten_ops += 1
        return func(*args, **(kwargs or {}))

    def _launched(self, *args, **kwargs) -> None:
        self.triton_launches += 1

    def __enter__(self):
        from triton import knobs

        knobs.runtime.launch_enter_hook.add(self._launched)
        return super().__enter__()

    def __exit__(self, *exc):
        from triton import knobs

        knobs.runtime.launch_enter_hook.remove(self._launched)
        return super().__exit__(*exc)


@contextlib.contextmanager
def stand_in_model(llm, device):
    """The model's forward answers at once (zeros); its logits and the sampler are timed, waiting
    for the device included, into the yielded list. The engine's code is left as it is."""
    seconds: list[float] = []
    model, sample = llm.runner.model, model_runner.sample

    def no_forward(input_ids, positions, attn, kv_caches):
        return torch.zeros(len(input_ids), model.config.hidden_size, dtype=model.dtype, device=device)

    def timed(fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            synchronize(device)
            seconds.append(time.perf_counter() - start)
            return out
        return call

    logits = model.compute_logits
    model.forward, model.compute_logits, model_runner.sample = no_forward, timed(logits), timed(sample)
    try:
        yield seconds
    finally:
        del model.forward  # the class's forward again
        model.compute_logits, model_runner.sample = logits, sample


def decode_launches(model_name: str, device, dtype) -> dict:
    """Aten ops and Triton launches of one eager decode forward of ``model_name``'s layer code,
    per layer, outside the layers and per step (``triton_*``)."""
    config = load_config(model_name)
    counts = []
    for layers in (1, 2):
        model = load_model(config.replace(num_layers=layers, **SAME_OPS_WIDTHS), device=device,
                           dtype=dtype, weights="random")
        llm = LLM(model, num_kv_blocks=8, block_size=16, enforce_eager=True)
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        cache = llm.kv_cache
        cache.allocate("x", 4)
        input_ids, positions, attn = cache.prepare_inputs([("x", 3, 1)], [5])
        with LaunchCounter() as counter, torch.inference_mode():
            model(input_ids, positions, attn, cache.layer_caches)
        counts.append(counter)
    result = {"model": config.name}
    for prefix, attribute in (("", "aten_ops"), ("triton_", "triton_launches")):
        one, two = (getattr(counter, attribute) for counter in counts)
        result |= {f"{prefix}per_layer": two - one, f"{prefix}outside_layers": 2 * one - two,
                   f"{prefix}per_step": 2 * one - two + (two - one) * config.num_layers}
    return result


def decode_step_seconds(model, batch: int, ctx: int, steps: int, enforce_eager: bool) -> list[float]:
    """Wall seconds of ``steps`` engine decode steps of ``batch`` requests near ``ctx`` tokens."""
    llm = LLM(model, block_size=16, num_kv_blocks=batch * ceil_div(ctx + steps + 16, 16) + 16,
              max_num_seqs=max(batch, 8), max_num_batched_tokens=max(2048, ctx), enforce_eager=enforce_eager,
              enable_prefix_caching=False)
    generator = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(model.config.vocab_size, (ctx,), generator=generator).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
        llm.add_request(str(i), prompt, params)
    while not llm.recorder.steps or llm.recorder.steps[-1]["num_prefill_tokens"]:
        llm.step()
    seconds = []
    for _ in range(steps):
        synchronize(model.device)
        start = time.perf_counter()
        llm.step()
        seconds.append(time.perf_counter() - start)
    return seconds


def eager_vs_graphs(model_name: str, device, batches=(1, 8, 32), ctx: int = 1024,
                    steps: int = 20) -> list[dict]:
    """Decode step time of ``model_name`` (random weights), eager and replayed from CUDA graphs."""
    model = load_model(model_name, device=device, weights="random")
    points = []
    for batch in batches:
        eager = decode_step_seconds(model, batch, ctx, steps, enforce_eager=True)
        graphs = decode_step_seconds(model, batch, ctx, steps, enforce_eager=False)
        points.append({"batch": batch, "ctx": ctx, "eager_seconds": eager, "graph_seconds": graphs,
                       "eager_median_s": statistics.median(eager),
                       "graph_median_s": statistics.median(graphs)})
    return points


def bench_host(device=None, batch: int = 256, ctx: int = 1000, steps: int = 40,
               model_name: str = "llama-3.1-8b") -> dict:
    """The engine's own time per decode step at ``batch`` running requests of about ``ctx`` tokens,
    the launches of one eager decode step of ``model_name``, and on CUDA its decode steps eager and
    with CUDA graphs."""
    device = resolve_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(load_config("tiny").replace(name="host-bench", **HOST_MODEL), device=device,
                       dtype=dtype, weights="random")
    prompt_len = ctx - steps
    llm = LLM(model, block_size=16, num_kv_blocks=batch * ceil_div(ctx + 16, 16) + 16, max_num_seqs=batch,
              max_num_batched_tokens=max(2048, prompt_len + batch), enforce_eager=True)
    vocab = HOST_MODEL["vocab_size"]
    prefix = [t % (vocab - 1) + 1 for t in range(prompt_len - 1)]
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 4, ignore_eos=True)
    llm.add_request("0", prefix + [1], params)
    llm.step()  # the first request prefills the shared prefix, the others find it cached
    for i in range(1, batch):
        llm.add_request(str(i), prefix + [i % (vocab - 1) + 1], params)
    while llm.recorder.steps[-1]["num_prefill_tokens"]:
        llm.step()
    walls, per_step = [], []
    with stand_in_model(llm, device) as model_seconds:
        for _ in range(steps):
            model_seconds.clear()
            synchronize(device)
            start = time.perf_counter()
            llm.step()
            synchronize(device)
            walls.append(time.perf_counter() - start)
            per_step.append(sum(model_seconds))
    engine = [wall - inside for wall, inside in zip(walls, per_step)]
    del llm, model
    result = {"batch": batch, "ctx": ctx, "device": str(device),
              "step_seconds": walls, "model_seconds": per_step, "engine_seconds": engine,
              "engine_median_s": statistics.median(engine), "step_median_s": statistics.median(walls),
              "launches": decode_launches(model_name, device, dtype), "measures": MEASURES}
    if device.type == "cuda":
        result["graphs"] = eager_vs_graphs(model_name, device)
    return result


def format_host(result: dict) -> str:
    launches = result["launches"]
    lines = [
        f"decode steps at batch {result['batch']}, context ~{result['ctx']:,} on {result['device']}",
        f"  the engine's own Python per step: {result['engine_median_s'] * 1e3:,.2f} ms "
        f"(median of {len(result['step_seconds'])} steps, the model's forward a no-op: no attention "
        f"or matmul; its logits and sampling, {statistics.median(result['model_seconds']) * 1e3:,.2f} ms, "
        f"taken off)",
        f"  one eager decode forward of {launches['model']}: {launches['per_layer']} aten ops per layer, "
        f"{launches['per_step']:,} per step; {launches['triton_per_layer']} Triton launches per layer, "
        f"{launches['triton_per_step']:,} per step (a CUDA graph replays them all in one call)"]
    for point in result.get("graphs", []):
        lines.append(f"  {launches['model']} decode step at batch {point['batch']}: eager "
                     f"{point['eager_median_s'] * 1e3:,.2f} ms, CUDA graph "
                     f"{point['graph_median_s'] * 1e3:,.2f} ms")
    return "\n".join(lines)


def add_cli(bench_commands) -> None:
    """Register ``host`` on the ``bench`` subcommands."""
    cmd = bench_commands.add_parser("host", help="the engine's own Python time per decode step")
    add_options(cmd, model="llama-3.1-8b", dtype=None)  # whose launches are counted (and timed on CUDA)
    cmd.add_argument("--batch", type=int, default=256)
    cmd.add_argument("--ctx", type=int, default=1000)
    cmd.add_argument("--steps", type=int, default=40)
    cmd.set_defaults(func=run_cli)


def run_cli(args) -> int:
    """Print the split of a decode step's time; write the record if ``--out``."""
    params = {"batch": args.batch, "ctx": args.ctx, "steps": args.steps, "model": args.model}
    return report(args, "host", params, lambda device: bench_host(device, args.batch, args.ctx, args.steps,
                                                                  args.model), format_host)
