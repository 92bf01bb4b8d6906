"""Offline throughput: minillm against Hugging Face ``generate()`` (chapter 调度).

Both engines get the same model weights and, in one run, the same two workloads: one request alone
(B=1, the two engines in turns, the median of a few runs), then a mixed batch (random prompts,
lengths uniform in a range, ``ignore_eos``, all requests at once). minillm runs the batch with
continuous batching over its paged cache; transformers runs it the way it is usually served:
static batches, left-padded to the longest prompt, each batch decoding until its longest answer
is done. Both count only the tokens each request asked for, so the ratio is of useful work per
second; the cost per computed token sets the engines' arithmetic side by side.

A model that ships weights (``smollm2-135m``, a GGUF file, a folder with safetensors) runs with
them, and transformers gets the same ones; a preset runs with random weights at its shape
(throughput does not depend on their values).
"""
from __future__ import annotations

import statistics
import time

import torch

from minillm.engine.config import load_config, resolve_checkpoint
from minillm.engine.device import resolve_device, synchronize
from minillm.engine.llm import LLM
from minillm.engine.loader import TORCH_DTYPES, checkpoint_weights, load_model
from minillm.engine.sampling import SamplingParams
from minillm.engine.units import ceil_div
from minillm.lab.bench_cli import add_options, report
from minillm.lab.hardware import describe_device, time_once
from minillm.lab.workload import Workload, make_workload, random_prompts, throughput_workload

WARMUP_PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
CPU_SCALE = 0.25  # the CPU runs a quarter of the workload: 64 requests, lengths 25-256
SINGLE_LENGTH = 256  # the B=1 request: this many prompt and output tokens, times the scale
SINGLE_REPEATS = 3  # B=1 runs per engine, in turns; the median counts


def bench_throughput(model: str = "small", device=None, dtype: torch.dtype | None = None,
                     scale: float | None = None, num_requests: int = 256, seed: int = 0,
                     hf_batch_size: int = 16, max_num_seqs: int = 256,
                     max_num_batched_tokens: int = 2048, num_kv_blocks: int | None = None,
                     memory_limit=None, block_size: int = 16, run_transformers: bool = True) -> dict:
    """Run the B=1 request and the offline throughput workload on minillm and (unless
    ``run_transformers=False``) on transformers; return the measurements and the ratios of output
    tokens per second.

    ``model``: a preset, a folder with ``config.json`` or a ``.gguf`` file (a GGUF's real weights;
    random ones otherwise). ``scale``: of the standard workload (default 1 on CUDA, ``CPU_SCALE``
    on the CPU). ``num_kv_blocks=None``: the planner decides on a GPU (or with ``memory_limit``);
    on the CPU, which has no card to plan, the pool holds every request at once.
    """
    if hf_batch_size < 1:
        raise ValueError(f"hf_batch_size must be >= 1, got {hf_batch_size}")
    source = resolve_checkpoint(model)
    if source is None:
        raise ValueError(f"model must be a preset, a folder with config.json or a .gguf file, "
                         f"got {model!r}")
    device = resolve_device(device)
    if scale is None:
        scale = 1.0 if device.type == "cuda" else CPU_SCALE
    vocab_size = load_config(model).vocab_size
    workload = throughput_workload(vocab_size, num_requests, scale=scale, seed=seed)
    single_length = max(8, round(SINGLE_LENGTH * scale))
    single = make_workload("single", [single_length], [single_length], vocab_size, seed=seed)
    weights = checkpoint_weights(model)
    net = load_model(model, device=device, dtype=dtype, weights=weights)
    if num_kv_blocks is None and net.device.type == "cpu" and memory_limit is None:
        num_kv_blocks = sum(ceil_div(len(p) + sp.max_tokens, block_size)
                            for p, sp in zip(workload.prompts, workload.params))
    engine_args = dict(block_size=block_size, num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, memory_limit=memory_limit)
    result = {
        "model": net.config.name,
        "weights": weights,
        "device": describe_device(net.device).name,
        "dtype": str(net.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads() if net.device.type == "cpu" else None,
        "single": {"input_tokens": single_length, "output_tokens": single_length},
        "workload": {"num_requests": len(workload), "scale": scale, "seed": seed,
                     "input_tokens": sum(workload.input_lens),
                     "output_tokens": sum(workload.output_lens),
                     "length_range": [min(workload.input_lens + workload.output_lens),
                                      max(workload.input_lens + workload.output_lens)]},
    }
    llm = LLM(net, **engine_args)
    hf = _transformers_model(source, net) if run_transformers else None
    result["single"] |= _run_single(llm, hf, single)
    result["minillm"] = _run_minillm(llm, workload)
    del llm
    if net.device.type == "cuda":  # the KV pool is gone: give its memory to transformers
        torch.cuda.empty_cache()
    if run_transformers:
        result["transformers"] = _run_transformers(hf, workload, hf_batch_size)
        result["ratio"] = (result["minillm"]["output_throughput"]
                           / result["transformers"]["output_throughput"])
        # With the same cost per computed token, the tok/s ratio would equal the ratio of tokens
        # each side computes (transformers pads prompts and runs each batch to its longest output).
        result["work_ratio"] = (result["transformers"]["computed_tokens"]
                                / result["minillm"]["computed_tokens"])
        result["efficiency"] = result["ratio"] / result["work_ratio"]
    return result


def _run_single(llm: LLM, hf, single: Workload) -> dict:
    """One request alone, on minillm and on transformers (``hf``, or None) in turns, after a
    warm-up each: the median seconds of ``SINGLE_REPEATS`` runs, output tokens per second and the
    ratio (the same tokens are computed on both sides, so it is also the cost per token's)."""
    llm.generate(_warmup_prompts(llm.model.config.vocab_size), WARMUP_PARAMS, use_tqdm=False)
    runs = {"minillm": [], "transformers": []}
    for _ in range(SINGLE_REPEATS):
        runs["minillm"].append(time_once(lambda: llm.generate(single.prompts, single.params, use_tqdm=False),
                                      llm.model.device))
        if hf is not None:
            runs["transformers"].append(time_once(lambda: _hf_batch(hf, single.prompts, single.output_lens[0]),
                                               hf.device))
    result = {}
    for name, seconds in runs.items():
        if seconds:
            median = statistics.median(seconds)
            result[name] = {"seconds": median, "runs": seconds,
                            "output_throughput": single.output_lens[0] / median}
    if hf is not None:
        result["ratio"] = result["minillm"]["output_throughput"] / result["transformers"]["output_throughput"]
    return result


def _run_minillm(llm: LLM, workload: Workload) -> dict:
    """minillm on the workload, after a warm-up."""
    device = llm.model.device
    llm.generate(_warmup_prompts(llm.model.config.vocab_size), WARMUP_PARAMS, use_tqdm=False)
    synchronize(device)
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, workload.params, use_tqdm=False)
    synchronize(device)
    seconds = time.perf_counter() - start
    stats = llm.stats()
    output_tokens = sum(len(o.token_ids) for o in outputs)
    return {"seconds": seconds, "output_tokens": output_tokens,
            "output_throughput": output_tokens / seconds,
            "total_throughput": (output_tokens + sum(workload.input_lens)) / seconds,
            "computed_tokens": sum(s["num_prefill_tokens"] + s["num_decode_tokens"] for s in stats["steps"]),
            "num_steps": len(stats["steps"]), "num_preemptions": stats["num_preemptions"],
            "num_kv_blocks": stats["num_kv_blocks"], **{
                k: getattr(llm.config, k) for k in ("max_num_seqs", "max_num_batched_tokens")}}


def _warmup_prompts(vocab_size: int) -> list[list[int]]:
    """Two short prompts unlike the workload's (no prefix-cache hits carried into the timed run)."""
    return random_prompts([32, 24], vocab_size, seed=-1)


def _transformers_model(source, net):
    """The transformers model of the same config (a folder's, or a GGUF file's as transformers
    reads it), holding minillm's weights (for a GGUF: transformers' own dequantization of the file,
    bit for bit, as tests/test_gguf.py checks)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if source.suffix == ".gguf":
        config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    else:
        config = AutoConfig.from_pretrained(source)
    with torch.device(net.device):
        hf = AutoModelForCausalLM.from_config(config, dtype=net.dtype)
    hf.load_state_dict(net.state_dict())
    return hf.eval()


def _run_transformers(hf, workload: Workload, batch_size: int) -> dict:
    """Static batches in arrival order, left-padded; every row decodes the batch's longest answer."""
    device = hf.device
    _hf_batch(hf, _warmup_prompts(hf.config.vocab_size), WARMUP_PARAMS.max_tokens)
    synchronize(device)
    start = time.perf_counter()
    computed_tokens = 0
    for first in range(0, len(workload), batch_size):
        rows = range(first, min(first + batch_size, len(workload)))
        prompts = [workload.prompts[i] for i in rows]
        new_tokens = max(workload.output_lens[i] for i in rows)
        _hf_batch(hf, prompts, new_tokens)
        computed_tokens += len(prompts) * (max(map(len, prompts)) + new_tokens - 1)  # the last token is not fed back
    synchronize(device)
    seconds = time.perf_counter() - start
    output_tokens = sum(workload.output_lens)
    return {"seconds": seconds, "output_tokens": output_tokens,
            "output_throughput": output_tokens / seconds,
            "total_throughput": (output_tokens + sum(workload.input_lens)) / seconds,
            "batch_size": batch_size,
            "computed_tokens": computed_tokens}  # padding and overshoot included


@torch.inference_mode()
def _hf_batch(hf, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
    """One ``generate()`` call: left padding, greedy, exactly ``new_tokens`` tokens per row."""
    width = max(map(len, prompts))
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return hf.generate(input_ids=input_ids.to(hf.device), attention_mask=mask.to(hf.device),
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=0)


def format_throughput(result: dict) -> str:
    """The result as a few readable lines (what the CLI prints)."""
    w = result["workload"]
    threads = f", {result['threads']} CPU threads" if result.get("threads") else ""
    single = result["single"]
    weights = "real" if result["weights"] == "auto" else "random"
    lines = [f"model {result['model']} ({result['dtype']}, {weights} weights) on "
             f"{result['device']}{threads}",
             f"B=1: one request of {single['input_tokens']:,} prompt + {single['output_tokens']:,} "
             f"output tokens, median of {SINGLE_REPEATS} runs each"]
    for name in ("minillm", "transformers"):
        if name in single:
            lines.append(f"{name:>12}: {single[name]['output_throughput']:,.1f} output tok/s "
                         f"({single[name]['seconds']:,.2f} s)")
    if "ratio" in single:
        lines.append(f"minillm / transformers at B=1 (output tok/s, = cost per token): {single['ratio']:.2f}x")
    lines.append(f"batch: {w['num_requests']:,} requests, lengths {w['length_range'][0]:,}-"
                 f"{w['length_range'][1]:,}, {w['input_tokens']:,} input + {w['output_tokens']:,} "
                 f"output tokens")
    for name in ("minillm", "transformers"):
        if name in result:
            r = result[name]
            lines.append(f"{name:>12}: {r['output_throughput']:,.1f} output tok/s, "
                         f"{r['total_throughput']:,.1f} total tok/s ({r['seconds']:,.2f} s)")
    if "ratio" in result:
        lines.append(f"minillm / transformers (output tok/s): {result['ratio']:.2f}x; tokens computed, "
                     f"transformers / minillm: {result['work_ratio']:.2f}x; cost per computed token, "
                     f"transformers / minillm: {result['efficiency']:.2f}")
    return "\n".join(lines)


# --- python -m minillm bench throughput ------------------------------------------------------------

def add_cli(bench_commands) -> None:
    """Register ``throughput`` on the ``bench`` subcommands (``minillm.lab.bench.add_cli`` returns them)."""
    cmd = bench_commands.add_parser("throughput", help="offline throughput: minillm vs transformers, "
                                                       "B=1 and a mixed batch")
    add_options(cmd, model="small", out="data/measurements/h200-throughput.json")  # smollm2-135m: real weights
    cmd.add_argument("--num-requests", type=int, default=256)
    cmd.add_argument("--scale", type=float, help=f"shrink request count and lengths (default 1 on "
                                                 f"CUDA, {CPU_SCALE} on the CPU)")
    cmd.add_argument("--hf-batch-size", type=int, default=16, help="transformers' static batch size")
    cmd.add_argument("--max-num-seqs", type=int, default=256)
    cmd.add_argument("--max-num-batched-tokens", type=int, default=2048)
    cmd.add_argument("--num-kv-blocks", type=int, help="default: the planner (CPU: every request fits)")
    cmd.add_argument("--seed", type=int, default=0)
    cmd.add_argument("--minillm-only", action="store_true", help="skip transformers")
    cmd.set_defaults(func=run_cli)


def run_cli(args) -> int:
    """Run the benchmark, print both throughputs and the ratio, write the record if ``--out``."""
    params = {k: getattr(args, k) for k in ("model", "dtype", "num_requests", "scale", "hf_batch_size",
                                            "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "seed")}
    return report(args, "throughput", params, lambda device: bench_throughput(
        args.model, device, TORCH_DTYPES.get(args.dtype), args.scale, args.num_requests, args.seed,
        args.hf_batch_size, args.max_num_seqs, args.max_num_batched_tokens, args.num_kv_blocks,
        run_transformers=not args.minillm_only), format_throughput)
