"""Recorded benchmarks: prefill and decode sweeps that write JSON records (chapters 预填充, 解码).

A record holds the raw timings, the environment they were measured in (device, library versions,
git commit, date; no host name), the probed ceilings of that device, and for every point the
ledger's estimate (``minillm.lab.estimate``) beside the measurement. The book's "recorded on GPU"
columns read these files from ``data/measurements/``; a record is only ever written by running a
sweep, never by hand. Weights are random at the real shape: timing does not depend on their values.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from minillm.engine.config import load_config
from minillm.engine.contiguous_cache import ContiguousKVCache
from minillm.engine.device import resolve_device
from minillm.engine.engine_config import add_quantization_options
from minillm.engine.kernels import default_backend, paged_decode_attention, store_kv
from minillm.engine.kv_cache import kv_storage_dtype
from minillm.engine.loader import load_model, torch_dtype
from minillm.engine.model import Transformer
from minillm.engine.paged_cache import PagedKVCache
from minillm.engine.quantization import check_quantization, check_shapes
from minillm.engine.units import ceil_div
from minillm.lab import estimate as ledger
from minillm.lab.bench_cli import add_options, report
from minillm.lab.hardware import describe_device, measure_seconds, probe_device

WARMUP = 2  # untimed calls first: allocator, Triton compilation, caches


# --- Sweeps -------------------------------------------------------------------------------------

def _check_count(name: str, value) -> int:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _check_sizes(name: str, values, limit: int | None = None) -> list[int]:
    values = list(values)
    if not values:
        raise ValueError(f"{name} must not be empty")
    for value in values:
        _check_count(name, value)
    if limit is not None and max(values) > limit:
        raise ValueError(f"{name}: {max(values):,} exceeds the model's {limit:,} positions")
    return values


def _setup(model_name: str, device, dtype) -> tuple[Transformer, dict]:
    """The model with random weights, and the shared part of the results: model, spec, probes."""
    dtype = torch_dtype(dtype)
    model = load_model(model_name, device=resolve_device(device), dtype=dtype, weights="random")
    cfg, dtype_name = model.config, str(model.dtype).removeprefix("torch.")
    spec = describe_device(model.device).spec
    shared = {
        "model": {"name": cfg.name, "params": ledger.param_count(cfg), "dtype": dtype_name,
                  "weight_bytes": ledger.weight_bytes(cfg, dtype_name)},
        "spec": None if spec is None else {"name": spec.name, "bandwidth": spec.bandwidth,
                                           "bf16_flops": spec.bf16_flops, "source": spec.source},
        "probe": probe_device(model.device, model.dtype).as_dict(),
    }
    return model, shared


def _measure(point: dict, time_it, device: torch.device) -> list[float] | None:
    """``time_it()``'s samples; None, with the point marked, when CUDA runs out of memory."""
    try:
        return time_it()
    except torch.cuda.OutOfMemoryError:
        point["error"] = "out of memory"
        return None
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next point starts from the same free memory


def time_prefill(model: Transformer, n: int, repeats: int, every_row_logits: bool = False) -> list[float]:
    """Seconds of one prefill of an ``n``-token prompt: the forward and the last token's logits, as
    the engine runs it, or (``every_row_logits``) the logits of every position."""
    cache = ContiguousKVCache(model.config, 1, n, model.dtype, model.device)
    positions, attn = cache.append([0], [n])
    generator = torch.Generator(device=model.device).manual_seed(n)
    input_ids = torch.randint(model.config.vocab_size, (n,), device=model.device, generator=generator)

    def step():
        hidden = model(input_ids, positions, attn, cache.layer_caches)
        return model.compute_logits(hidden if every_row_logits else hidden[-1:])

    return measure_seconds(step, model.device, repeats, warmup=WARMUP)


def time_linear_layers(model: Transformer, rows: int, repeats: int, every_row_logits: bool = False) -> list[float]:
    """Seconds of the model's own linear layers alone on ``rows`` random rows: ``repeats``
    samples. The output layer on the last row, as in a prefill, or (``every_row_logits``) on every
    row, as in a decode step of ``rows`` requests. Beside a whole step it says how fast this
    machine runs the model's matmuls at that shape, independently of the profile's probes."""
    cfg, device, dtype = model.config, model.device, model.dtype
    x_hidden, x_heads, x_inner = (torch.randn(rows, width, dtype=dtype, device=device)
                                  for width in (cfg.hidden_size, cfg.q_size, cfg.intermediate_size))

    @torch.inference_mode()
    def run():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.project(x_hidden)
            mlp.gate_up(x_hidden)
            attn.o_proj(x_heads)
            mlp.down_proj(x_inner)
        model.lm_head(x_hidden if every_row_logits else x_hidden[-1:])

    return measure_seconds(run, device, repeats, warmup=WARMUP)


def time_decode_step(model: Transformer, batch: int, ctx: int, steps: int,
                     kv_dtype: torch.dtype | None = None) -> list[float]:
    """Seconds of one decode step of ``batch`` requests, each attending to ``ctx`` tokens (their
    KV in ``kv_dtype``, default the model's).

    Every timed step is the same step: each request holds ``ctx - 1`` cached tokens and adds one
    at position ``ctx - 1`` (rewriting the same slot), so all samples measure context ``ctx``. The
    cached values are zeros: what is read, not its value, sets the time.
    """
    cache = ContiguousKVCache(model.config, batch, ctx, kv_dtype or model.dtype, model.device)
    for request in range(batch):
        cache.allocate(request, ctx)
    positions, attn = cache.prepare_step([(request, ctx - 1, 1) for request in range(batch)])
    generator = torch.Generator(device=model.device).manual_seed(batch)
    input_ids = torch.randint(model.config.vocab_size, (batch,), device=model.device,
                              generator=generator)

    def step():
        hidden = model(input_ids, positions, attn, cache.layer_caches)
        return model.compute_logits(hidden).argmax(dim=-1)

    return measure_seconds(step, model.device, steps, warmup=WARMUP)


def bench_prefill(model_name: str, device=None, dtype=None, lengths=(128, 512, 2048),
                  repeats: int = 5) -> dict:
    """Prefill time of one prompt per length ``n``, beside the ledger's FLOPs and time floor.

    ``model_name``: a preset or a folder with ``config.json``. The floor uses this device's probed
    matmul rate and copy bandwidth; achieved FLOP/s = ledger FLOPs / median time.
    """
    cfg = load_config(model_name)
    lengths = _check_sizes("lengths", lengths, cfg.max_position_embeddings)
    _check_count("repeats", repeats)
    model, results = _setup(model_name, device, dtype)
    probe, points = results["probe"], []
    for n in lengths:
        est = ledger.prefill(model.config, n, results["model"]["dtype"])
        point = {"n": n, "estimate": {
            "flops": est.flops, "bytes": est.bytes, "intensity": est.intensity,
            "time_floor_s": est.time_floor(probe["matmul_flops"], probe["copy_bandwidth"])}}
        seconds = _measure(point, lambda: time_prefill(model, n, repeats), model.device)
        if seconds is not None:
            median = statistics.median(seconds)
            point.update(seconds=seconds, median_s=median, achieved_flops=est.flops / median,
                         fraction_of_probed_flops=est.flops / median / probe["matmul_flops"])
        points.append(point)
    return {**results, "points": points}


def variant_name(quantization: str | None, kv_cache_dtype: str) -> str:
    """A quantized variant's name in ``bench decode``'s points: ``int4``, ``fp8-kv``, ``int4+fp8-kv``."""
    return "+".join([quantization] * bool(quantization) + ["fp8-kv"] * (kv_cache_dtype == "fp8"))


def _check_variants(cfg, variants, group_size: int) -> list[tuple[str | None, str]]:
    pairs = [tuple(v) for v in variants]
    for quantization, kv_cache_dtype in pairs:
        check_quantization(quantization, group_size)
        check_shapes(cfg, quantization, group_size)
        if kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
        if not variant_name(quantization, kv_cache_dtype):
            raise ValueError("a variant must quantize the weights or the KV cache; the baseline is always timed")
    if len(set(pairs)) < len(pairs):
        raise ValueError(f"variants repeat: {pairs}")
    return pairs


def bench_decode(model_name: str, device=None, dtype=None, batches=(1, 8, 32),
                 contexts=(512, 2048), steps: int = 10, variants=(), group_size: int = 32) -> dict:
    """Decode step time for every batch size and context, beside the ledger's bytes and floor.

    Achieved bandwidth = ledger bytes of the step (all weights + the batch's KV) / median time;
    its fraction of the probed copy bandwidth is the MBU the decode chapter reports. ``variants``
    are (quantization, kv_cache_dtype) pairs: at every point the unquantized model (``variant``
    "baseline") and each variant (named by :func:`variant_name`) are timed in turns, so all share
    one baseline, and a variant's point carries ``speedup`` = baseline median / its median.
    """
    cfg = load_config(model_name)
    batches = _check_sizes("batches", batches)
    contexts = _check_sizes("contexts", contexts, cfg.max_position_embeddings)
    _check_count("steps", steps)
    pairs = _check_variants(cfg, variants, group_size)
    model, results = _setup(model_name, device, dtype)
    models = {None: model}
    for quantization, _ in pairs:
        if quantization not in models:
            models[quantization] = load_model(model_name, device=model.device, dtype=model.dtype, weights="random",
                                              quantization=quantization, group_size=group_size)
    timed = [("baseline", None, "auto")] + [(variant_name(q, kv), q, kv) for q, kv in pairs]
    results["variants"] = [{"variant": name, "quantization": q, "kv_cache_dtype": kv} for name, q, kv in timed[1:]]
    results["group_size"] = group_size if pairs else None
    bandwidth, dtype_name, points = results["probe"]["copy_bandwidth"], results["model"]["dtype"], []
    for ctx in contexts:
        for batch in batches:
            baseline_median = None
            for name, quantization, kv in timed:
                net, kv_dtype = models[quantization], kv_storage_dtype(kv, model.dtype)
                est = ledger.decode_step(net.config, batch, ctx, bandwidth, dtype_name, quantization, group_size,
                                         str(kv_dtype).removeprefix("torch."))
                point = {"variant": name, "quantization": quantization, "kv_cache_dtype": kv, "batch": batch,
                         "ctx": ctx, "estimate": {
                             "bytes": est.bytes, "weight_bytes": est.weight_bytes,
                             "kv_read_bytes": est.kv_read_bytes, "flops": est.flops,
                             "time_floor_s": est.time_floor, "tokens_per_s": est.tokens_per_s}}
                seconds = _measure(point, lambda: time_decode_step(net, batch, ctx, steps, kv_dtype), net.device)
                if seconds is not None:
                    median = statistics.median(seconds)
                    point.update(seconds=seconds, median_s=median, tokens_per_s=batch / median,
                                 achieved_bandwidth=est.bytes / median,
                                 fraction_of_probed_bandwidth=est.bytes / median / bandwidth)
                    if name == "baseline":
                        baseline_median = median
                    elif baseline_median is not None:
                        point["speedup"] = baseline_median / median
                points.append(point)
    return {**results, "points": points}


# --- Summaries ----------------------------------------------------------------------------------

def _header(results: dict) -> list[str]:
    m, p = results["model"], results["probe"]
    return [f"model {m['name']} ({m['dtype']}, {m['params']:,} parameters) on {p['device']}",
            f"probed: copy {p['copy_bandwidth'] / 1e9:,.1f} GB/s (read+write), matmul "
            f"{p['matmul_flops'] / 1e12:,.3f} TFLOP/s ({p['matmul_dtype']}), ridge "
            f"{p['ridge_point']:,.1f} FLOP/byte"]


def format_prefill(results: dict) -> str:
    """The prefill sweep as a readable table."""
    lines = _header(results) + [f"{'n':>7} {'median ms':>10} {'floor ms':>9} {'TFLOP/s':>8} "
                                f"{'of probe':>8}"]
    for p in results["points"]:
        if "error" in p:
            lines.append(f"{p['n']:>7,} {p['error']}")
            continue
        lines.append(f"{p['n']:>7,} {p['median_s'] * 1e3:>10.2f} "
                     f"{p['estimate']['time_floor_s'] * 1e3:>9.2f} {p['achieved_flops'] / 1e12:>8.3f} "
                     f"{p['fraction_of_probed_flops']:>8.0%}")
    return "\n".join(lines)


def format_decode(results: dict) -> str:
    """The decode sweep as a readable table (with quantized variants: one row each, every one's
    speedup over the baseline timed beside it)."""
    variants = results.get("variants") or []
    lines = _header(results)
    for v in variants:
        weights = v["quantization"] or "unquantized"
        if v["quantization"] == "int4":
            weights += f" (groups of {results['group_size']})"
        lines.append(f"{v['variant']}: weights {weights}, KV cache {v['kv_cache_dtype']}")
    if variants:
        lines.append("the baseline and every variant timed in turns at each point")
    width = max([9] + [len(v["variant"]) for v in variants])
    lines.append(f"{'variant':>{width}} {'batch':>6} {'ctx':>7} {'ms/step':>8} {'floor ms':>9} "
                 f"{'tok/s':>9} {'GB/s':>8} {'of probe':>8} {'speedup':>8}")
    for p in results["points"]:
        if "error" in p:
            lines.append(f"{p['variant']:>{width}} {p['batch']:>6,} {p['ctx']:>7,} {p['error']}")
            continue
        speedup = f"{p['speedup']:>7.2f}x" if "speedup" in p else f"{'':>8}"
        lines.append(f"{p['variant']:>{width}} {p['batch']:>6,} {p['ctx']:>7,} {p['median_s'] * 1e3:>8.2f} "
                     f"{p['estimate']['time_floor_s'] * 1e3:>9.2f} {p['tokens_per_s']:>9,.1f} "
                     f"{p['achieved_bandwidth'] / 1e9:>8,.1f} "
                     f"{p['fraction_of_probed_bandwidth']:>8.0%} {speedup}")
    return "\n".join(lines)


# --- python -m minillm bench ... ----------------------------------------------------------------

def paged_decode_batch(cfg, seq_lens, block_size: int, dtype, device, seed: int = 0):
    """One layer's decode batch on a paged cache (chapter 分页的 KV cache): blocks handed out
    round-robin as the requests grow, so each request's blocks are scattered over the pool, and K/V
    written through ``store_kv``. Returns (q, k_cache, v_cache, block_tables, seq_lens)."""
    blocks_needed = [ceil_div(n, block_size) for n in seq_lens]
    cache = PagedKVCache(cfg.replace(num_layers=1), sum(blocks_needed), block_size, dtype, device)
    for step in range(max(blocks_needed)):
        for i, n in enumerate(seq_lens):
            if step < blocks_needed[i]:
                cache.allocate(i, min(n, (step + 1) * block_size))
    _, attn = cache.prepare_step([(i, 0, n) for i, n in enumerate(seq_lens)])
    k_cache, v_cache = cache.layer_caches[0]
    generator = torch.Generator(device=device).manual_seed(seed)
    k, v = (torch.randn(len(attn.slot_mapping), cfg.num_kv_heads, cfg.head_dim, generator=generator,
                        device=device, dtype=dtype) for _ in range(2))
    store_kv(k, v, k_cache, v_cache, attn.slot_mapping, backend=default_backend(k))
    q = torch.randn(len(seq_lens), cfg.num_heads, cfg.head_dim, generator=generator, device=device,
                    dtype=dtype)
    return q, k_cache, v_cache, attn.block_tables, attn.seq_lens


def gather_contiguous(k_cache, v_cache, block_tables, ctx: int):
    """The same context copied out of the pages into contiguous ``[B, n_kv, ctx, d]`` K and V."""
    blocks = block_tables[:, :ceil_div(ctx, k_cache.shape[1])].long()
    return [cache[blocks].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous() for cache in (k_cache, v_cache)]


def contiguous_decode_attention(q, k, v, scale: float):
    """The baseline: one query token per sequence over contiguous K/V, PyTorch SDPA with GQA."""
    return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale,
                                                            enable_gqa=True)[:, :, 0]


def bench_paged_decode(model_name: str, device=None, dtype=None, batch: int = 16,
                       contexts=(1024, 4096, 16384), block_size: int = 16, repeats: int = 5) -> dict:
    """One layer's paged decode attention (Triton on CUDA, the torch reference on the CPU) against
    contiguous SDPA on the same K/V: time and achieved bandwidth (K/V bytes read / time)."""
    cfg = load_config(model_name)
    contexts = _check_sizes("contexts", contexts, cfg.max_position_embeddings)
    for name, value in (("batch", batch), ("block_size", block_size), ("repeats", repeats)):
        _check_count(name, value)
    device = resolve_device(device)
    dtype = torch_dtype(dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    probe = probe_device(device, dtype).as_dict()
    backend, scale, points = ("triton" if device.type == "cuda" else "torch"), cfg.head_dim ** -0.5, []
    for ctx in contexts:
        q, k_cache, v_cache, tables, lens = paged_decode_batch(cfg, [ctx] * batch, block_size, dtype, device, ctx)
        k, v = gather_contiguous(k_cache, v_cache, tables, ctx)
        paged = measure_seconds(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                                               backend=backend), device, repeats, warmup=2)
        contiguous = measure_seconds(lambda: contiguous_decode_attention(q, k, v, scale), device, repeats,
                                     warmup=2)
        nbytes = 2 * batch * ctx * cfg.kv_size * k_cache.element_size()
        median = statistics.median(paged)
        points.append({"backend": backend, "batch": batch, "ctx": ctx, "block_size": block_size,
                       "kv_bytes": nbytes, "seconds": paged, "median_s": median,
                       "contiguous_seconds": contiguous, "contiguous_median_s": statistics.median(contiguous),
                       "achieved_bandwidth": nbytes / median,
                       "fraction_of_probed_bandwidth": nbytes / median / probe["copy_bandwidth"]})
        del q, k_cache, v_cache, k, v
    return {"model": {"name": cfg.name, "dtype": str(dtype).removeprefix("torch.")}, "probe": probe,
            "points": points}


def format_paged_decode(results: dict) -> str:
    """The paged decode attention sweep as a readable table."""
    lines = [f"{'ctx':>7} {'paged us':>9} {'SDPA us':>9} {'GB/s':>8} {'of probe':>8}"]
    for p in results["points"]:
        lines.append(f"{p['ctx']:>7,} {p['median_s'] * 1e6:>9.1f} {p['contiguous_median_s'] * 1e6:>9.1f} "
                     f"{p['achieved_bandwidth'] / 1e9:>8,.1f} {p['fraction_of_probed_bandwidth']:>8.0%}")
    return "\n".join(lines)


def add_cli(subparsers) -> argparse._SubParsersAction:
    """Register ``bench prefill|decode|paged-decode`` on the ``python -m minillm`` subparsers.

    Returns the ``bench`` subcommands, so other benchmarks (``bench throughput``) can add theirs.
    """
    bench = subparsers.add_parser("bench", help="benchmarks that write JSON records")
    commands = bench.add_subparsers(dest="bench_command", required=True)
    prefill = commands.add_parser("prefill", help="prefill time against prompt length")
    prefill.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    prefill.add_argument("--repeats", type=int, default=5)
    decode = commands.add_parser("decode", help="decode step time against batch size and context")
    decode.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    decode.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    decode.add_argument("--steps", type=int, default=10, help="timed steps per point")
    add_quantization_options(decode)
    paged = commands.add_parser("paged-decode", help="one layer's paged decode attention against contiguous SDPA")
    paged.add_argument("--batch", type=int, default=16)
    paged.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    paged.add_argument("--block-size", type=int, default=16)
    paged.add_argument("--repeats", type=int, default=5)
    for cmd, name in ((prefill, "prefill"), (decode, "decode"), (paged, "paged-decode")):
        add_options(cmd, out=f"data/measurements/h200-{name}.json")
        cmd.set_defaults(func=run_cli)
    return commands


def run_cli(args) -> int:
    """Run ``bench prefill``, ``decode`` or ``paged-decode``, print the table, write the record if ``--out``."""
    params = {"model": args.model, "dtype": args.dtype}
    if args.bench_command == "prefill":
        params.update(lengths=args.lengths, repeats=args.repeats)
        return report(args, "prefill", params, lambda device: bench_prefill(
            args.model, device, args.dtype, args.lengths, args.repeats), format_prefill)
    if args.bench_command == "paged-decode":
        params.update(batch=args.batch, contexts=args.contexts, block_size=args.block_size, repeats=args.repeats)
        return report(args, "paged-decode", params, lambda device: bench_paged_decode(
            args.model, device, args.dtype, args.batch, args.contexts, args.block_size, args.repeats),
            format_paged_decode)
    variants = [(args.quantization, args.kv_cache_dtype)] if variant_name(args.quantization, args.kv_cache_dtype) else []
    params.update(batches=args.batches, contexts=args.contexts, steps=args.steps, quantization=args.quantization,
                  group_size=args.group_size, kv_cache_dtype=args.kv_cache_dtype)
    return report(args, "decode", params, lambda device: bench_decode(
        args.model, device, args.dtype, args.batches, args.contexts, args.steps, variants, args.group_size),
        format_decode)
