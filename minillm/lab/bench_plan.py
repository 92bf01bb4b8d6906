"""A 24 GiB card's memory plan, emulated on a bigger GPU (chapter 一张 24 GiB 的卡放 8B 模型).

``python -m minillm bench plan --out data/measurements/<gpu>-plan-24gib.json``. On CUDA,
``torch.cuda.set_per_process_memory_fraction`` caps PyTorch's allocator at the emulated size, so
the profiled plan and the engines built from it live within that card. The record holds the plan
(``max_model_len=-1``: the longest that fits), the error for a full-length request, the dry-run
plan and the ledger's bound beside it, the device's real free/total memory, and for each context
how many requests the engine actually ran at once. ``--device cpu --model tiny --memory-limit
64MiB --contexts 64`` runs the same steps on a CPU in seconds.
"""
from __future__ import annotations

import gc
import traceback

import torch

from minillm.engine.device import resolve_device
from minillm.engine.engine_config import EngineConfig
from minillm.engine.llm import LLM
from minillm.engine.loader import TORCH_DTYPES, load_model
from minillm.engine.memory_plan import MemoryPlan, MemoryPlanError
from minillm.engine.planner import clamp_to_device, plan
from minillm.engine.sampling import SamplingParams
from minillm.engine.units import ceil_div, parse_size
from minillm.lab.bench_cli import add_options, report
from minillm.lab.estimate import memory_budget


def run_admission(model, engine_args: dict, ctx: int) -> dict:
    """Run planned + 2 requests that each hold ``ctx`` tokens of KV (a prompt in the first slot of
    its last block, decoded to the block's end) and count how many ran at once. Planned: the
    whole requests the KV blocks hold, at most ``max_num_seqs``.

    A request lives ``block_size + 1`` steps and chunked prefill is off, so the step budget is set
    to admit everyone within that time (``planned + 2`` prompts over ``block_size`` steps; the
    planner counts the larger step's activations): what caps the count is memory alone.
    """
    block_size = EngineConfig(**engine_args).block_size
    settings = {**engine_args, "max_model_len": -1, "enable_chunked_prefill": False,
                "enable_prefix_caching": False}
    first_guess = plan(model, **{**settings, "max_num_batched_tokens": ctx}).concurrent_requests(ctx)
    budget = ctx * ceil_div(first_guess + 2, block_size)
    llm = LLM(model, **{**settings, "max_num_batched_tokens": budget})
    planned = min(llm.memory_plan.concurrent_requests(ctx), llm.config.max_num_seqs)
    generator = torch.Generator().manual_seed(ctx)
    prompts = [torch.randint(model.config.vocab_size, (ctx - block_size + 1,), generator=generator).tolist()
               for _ in range(planned + 2)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=block_size, ignore_eos=True),
                 use_tqdm=False)
    stats = llm.stats()
    del llm  # free this engine's KV cache before the next one is built under the same cap
    gc.collect()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    steps = stats["steps"]
    return {"context": ctx, "planned": planned, "num_requests": len(prompts),
            "max_num_batched_tokens": budget, "num_kv_blocks": stats["num_kv_blocks"],
            "max_running": max(step["num_running"] for step in steps),
            "max_decode_batch": max(step["num_decode_tokens"] for step in steps),
            "running": [step["num_running"] for step in steps],
            "waiting": [step["num_waiting"] for step in steps],
            "num_free_blocks": stats["num_free_blocks"],
            "num_preemptions": stats["num_preemptions"], "num_steps": len(steps)}


def emulate_card(limit: int, device: torch.device) -> tuple[int, dict]:
    """On CUDA, cap PyTorch's allocator at ``limit`` bytes (at most the card's), so that all
    that runs next lives within the emulated card; return the limit and the record's fields.
    Elsewhere the limit as is: the planner's ``memory_limit`` is the CPU's only card."""
    if device.type != "cuda":
        return limit, {}
    index = torch.cuda.current_device() if device.index is None else device.index
    device = torch.device("cuda", index)  # torch >= 2.11 refuses the fraction for a bare "cuda"
    free, total = torch.cuda.mem_get_info(device)
    limit = clamp_to_device(limit, total, torch.cuda.get_device_name(device))
    torch.cuda.set_per_process_memory_fraction(limit / total, device)
    return limit, {"device_before": {"free_bytes": free, "total_bytes": total},
                   "memory_fraction": limit / total}


def bench_plan(model_name: str = "llama-3.1-8b", device=None, dtype: str = "bf16",
               memory_limit="24GiB", contexts=(1024, 4096, 8192), **engine_args) -> dict:
    """The profiled plan of a card of ``memory_limit`` on ``device``, beside the dry run and the
    ledger, and the concurrency the engine reached at each of ``contexts``."""
    device = resolve_device(device)
    torch_dtype = TORCH_DTYPES[dtype]
    limit, results = emulate_card(parse_size(memory_limit), device)
    engine_args = {**engine_args, "memory_limit": limit}
    model = load_model(model_name, device=device, dtype=torch_dtype, weights="random")
    profiled = plan(model, max_model_len=-1, **engine_args)
    results["plan"] = profiled.as_dict()
    try:
        plan(model, max_model_len=model.config.max_position_embeddings, **engine_args)
        results["full_length_error"] = None
    except MemoryPlanError as err:
        results["full_length_error"] = str(err)
    dry_args = {k: v for k, v in engine_args.items() if k != "memory_limit"}
    try:  # the dry run counts a GPU's memory outside PyTorch, which an emulated CPU card has not
        results["dry_run"] = plan(model.config, gpu_memory=limit, max_model_len=-1, dtype=torch_dtype,
                                  **dry_args).as_dict()
    except MemoryPlanError as err:
        results["dry_run"] = {"error": str(err)}
    results["ledger"] = memory_budget(model.config, limit, profiled.utilization, dtype).as_dict()
    results["concurrency"] = []
    for ctx in contexts:
        try:
            results["concurrency"].append(run_admission(model, engine_args, ctx))
        except Exception as err:  # keep the plan even when a run fails (e.g. out of memory)
            traceback.print_exc()
            results["concurrency"].append({"context": ctx, "planned": profiled.concurrent_requests(ctx),
                                           "error": f"{type(err).__name__}: {err}"})
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        results["device_after"] = {"free_bytes": free, "total_bytes": total,
                                   "max_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    return results


def add_cli(bench_commands) -> None:
    """Register ``plan`` on the ``bench`` subcommands."""
    cmd = bench_commands.add_parser("plan", help="a card's memory plan, emulated, with the "
                                                 "concurrency the engine reaches")
    add_options(cmd, model="llama-3.1-8b", dtype="bf16")
    cmd.add_argument("--memory-limit", default="24GiB", help="the emulated card")
    cmd.add_argument("--util", type=float, default=0.92, help="gpu_memory_utilization")
    cmd.add_argument("--block-size", type=int, default=16)
    cmd.add_argument("--max-num-batched-tokens", type=int, default=2048)
    cmd.add_argument("--max-num-seqs", type=int, default=256)
    cmd.add_argument("--contexts", type=int, nargs="*", default=[1024, 4096, 8192],
                     help="contexts at which the engine's concurrency is measured (none: skip)")
    cmd.set_defaults(func=run_cli)


def run_cli(args) -> int:
    """Print the profiled plan; write the record if ``--out``."""
    engine_args = dict(gpu_memory_utilization=args.util, block_size=args.block_size,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    params = {"model": args.model, "dtype": args.dtype, "memory_limit": args.memory_limit,
              "weights": "random", **engine_args, "contexts": args.contexts}

    def show(results: dict) -> str:
        rows = MemoryPlan.from_dict(results["plan"]).rows(args.contexts or (1024,))
        return "\n".join(f"{label:<40} {value}" for label, value in rows)

    return report(args, "plan", params, lambda device: bench_plan(
        args.model, device, args.dtype, args.memory_limit, args.contexts, **engine_args), show)
