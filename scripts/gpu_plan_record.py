#!/usr/bin/env python3
"""Record the memory plan of a 24 GiB card, emulated on a bigger GPU (chapter 一张 24 GiB 的卡放 8B 模型).

    python scripts/gpu_plan_record.py --out data/measurements/<gpu>-plan-24gib.json

On CUDA, ``torch.cuda.set_per_process_memory_fraction`` caps PyTorch's allocator at the emulated
size, so the profiled plan and the engine built from it live within that card. The record holds
the plan (max_model_len=-1: the longest that fits), the error for a 131072-token request, the
dry-run plan and the ledger's bound beside it, the real free/total memory of the device, and, for
each context, how many requests the engine actually ran at once. ``--device cpu --model tiny
--memory-limit 64MiB --contexts 64`` runs the same steps on a CPU in seconds (a smoke test).
"""
from __future__ import annotations

import argparse
import gc
import sys
import traceback

import torch

from minillm.bench import environment_record, write_record
from minillm.engine import LLM
from minillm.estimate import memory_budget, parse_size
from minillm.hardware import resolve_device
from minillm.loader import TORCH_DTYPES, load_model
from minillm.memory import MemoryPlanError, plan
from minillm.sampling import SamplingParams


def admitted(model, memory_limit: int, ctx: int, args) -> dict:
    """Run planned + 2 requests that each hold ``ctx`` tokens of KV (a prompt in the first slot of
    its last block, decoded to the block's end) and count how many ran at once.

    Chunked prefill is off and the step budget is one whole prompt, so what caps the count is
    memory, not the token budget (with a small budget early requests finish before late ones start).
    """
    llm = LLM(model, memory_limit=memory_limit, gpu_memory_utilization=args.util,
              block_size=args.block_size, max_model_len=-1, enable_chunked_prefill=False,
              max_num_batched_tokens=max(args.contexts), max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=False)
    planned = llm.memory_plan.concurrent_requests(ctx)
    prompt_len = ctx - args.block_size + 1
    generator = torch.Generator().manual_seed(ctx)
    prompts = [torch.randint(model.config.vocab_size, (prompt_len,), generator=generator).tolist()
               for _ in range(planned + 2)]
    params = SamplingParams(temperature=0.0, max_tokens=args.block_size, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    del llm  # free this engine's KV cache before the next one is built under the same cap
    gc.collect()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return {"context": ctx, "planned": planned, "num_requests": len(prompts),
            "num_kv_blocks": stats["num_kv_blocks"],
            "max_running": max(step["num_running"] for step in stats["steps"]),
            "max_decode_batch": max(step["num_decode_tokens"] for step in stats["steps"]),
            "num_preemptions": stats["num_preemptions"], "num_steps": len(stats["steps"])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON record to write")
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=sorted(TORCH_DTYPES))
    parser.add_argument("--memory-limit", default="24GiB", help="the emulated card")
    parser.add_argument("--util", type=float, default=0.92)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--contexts", type=int, nargs="*", default=[1024, 4096, 8192],
                        help="contexts at which the engine's concurrency is measured (none: skip)")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    limit = parse_size(args.memory_limit)
    dtype = TORCH_DTYPES[args.dtype]
    plan_args = dict(gpu_memory_utilization=args.util, block_size=args.block_size,
                     max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)

    results: dict = {}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        results["device_before"] = {"free_bytes": free, "total_bytes": total}
        if limit > total:
            raise SystemExit(f"--memory-limit {args.memory_limit} exceeds this device's {total:,} B")
        torch.cuda.set_per_process_memory_fraction(limit / total, device)
        results["memory_fraction"] = limit / total
    model = load_model(args.model, device=device, dtype=dtype, weights="random")
    profiled = plan(model, memory_limit=limit, max_model_len=-1, **plan_args)
    results["plan"] = profiled.as_dict()
    try:
        plan(model, memory_limit=limit, max_model_len=model.config.max_position_embeddings, **plan_args)
        results["full_length_error"] = None
    except MemoryPlanError as err:
        results["full_length_error"] = str(err)
    results["dry_run"] = plan(model.config, gpu_memory=limit, max_model_len=-1, dtype=dtype,
                              **plan_args).as_dict()
    bound = memory_budget(model.config, limit, args.util, dtype)
    results["ledger"] = {"left_after_weights_bytes": bound.left, "tokens": bound.tokens}
    results["concurrency"] = []
    for ctx in args.contexts:
        planned = profiled.concurrent_requests(ctx)
        try:
            results["concurrency"].append(admitted(model, limit, ctx, args))
        except Exception as err:  # keep the plan even when a run fails (e.g. out of memory)
            traceback.print_exc()
            results["concurrency"].append({"context": ctx, "planned": planned,
                                           "error": f"{type(err).__name__}: {err}"})
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        results["device_after"] = {"free_bytes": free, "total_bytes": total,
                                   "max_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    params = {"model": args.model, "dtype": args.dtype, "memory_limit": args.memory_limit,
              "weights": "random", **plan_args, "contexts": args.contexts}
    write_record(args.out, "plan", params, results, environment_record(device))
    for label, value in profiled.rows(args.contexts or (1024,)):
        print(f"{label:<40} {value}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
