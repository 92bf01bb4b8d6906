"""``python -m minillm estimate|plan|generate|bench|diagnose|serve|loadgen ...``: the one command line."""
from __future__ import annotations

import argparse
import json
import sys

from minillm.engine.config import load_config
from minillm.lab import estimate as ledger


class CLIError(Exception):
    """A one-line reason for exit code 2."""


def _model_config(name):
    try:
        return load_config(name)
    except ValueError as err:
        raise CLIError(str(err)) from None


def _estimate_rows(cfg, args):
    """The ledger as (label, value) rows, values already formatted."""
    from minillm.lab.gpus import lookup_gpu

    gpu = lookup_gpu(args.gpu) if args.gpu else None
    memory = args.gpu_memory or (f"{gpu.memory_bytes}" if gpu else "24GiB")
    bandwidth = gpu.bandwidth if gpu else 1e12
    weights = ledger.weight_bytes(cfg, args.dtype)
    budget = ledger.memory_budget(cfg, memory, args.util, args.dtype)
    rows = [
        ("model", cfg.name),
        ("parameters", ledger.fmt_int(ledger.param_count(cfg))),
        (f"weights ({args.dtype})", f"{weights / ledger.GB:,.2f} GB = {weights / ledger.GiB:,.2f} GiB"),
        ("matmul FLOPs per token", f"{ledger.matmul_flops_per_token(cfg) / 1e9:,.2f} GFLOP"),
        ("KV per token", f"{ledger.kv_bytes_per_token(cfg, args.dtype) / ledger.KiB:,.0f} KiB"),
    ]
    for ctx in args.ctx:
        rows.append((f"attention FLOPs per token @ctx {ctx:,}",
                     f"{ledger.attention_flops_per_token(cfg, ctx) / 1e9:,.3f} GFLOP"))
        rows.append((f"KV per request @ctx {ctx:,}", f"{ledger.kv_bytes(cfg, ctx, args.dtype) / ledger.GiB:,.3f} GiB"))
    rows.append(("GPU", f"{gpu.name if gpu else 'assumed'}: {budget.total_bytes / ledger.GiB:,.2f} GiB, "
                        f"{bandwidth / 1e9:,.0f} GB/s"))
    rows.append((f"usable at util {args.util}", f"{budget.budget_bytes / ledger.GiB:,.2f} GiB"))
    if not budget.weights_fit:
        rows.append(("left after weights", "weights alone do not fit"))
        return rows
    rows.append(("left after weights", f"{budget.kv_budget_bytes / ledger.GiB:,.2f} GiB"))
    rows.append(("KV tokens that fit (upper bound)", ledger.fmt_int(budget.tokens)))
    for ctx in args.ctx:
        rows.append((f"concurrent requests @ctx {ctx:,}", f"{budget.requests_at(ctx):,.1f}"))
    for batch in args.batch:
        for ctx in args.ctx:
            step = ledger.decode_step(cfg, batch, ctx, bandwidth, args.dtype)
            rows.append((f"decode B={batch} ctx={ctx:,}",
                         f"{step.bytes / ledger.GB:,.2f} GB/step, >= {step.time_floor * 1e3:,.2f} ms, "
                         f"<= {ledger.fmt_int(step.tokens_per_s)} tok/s"))
    return rows


def cmd_estimate(args) -> int:
    cfg = _model_config(args.model)
    if not 0 < args.util <= 1:
        raise CLIError(f"--util must be in (0, 1], got {args.util}")
    try:
        rows = _estimate_rows(cfg, args)
    except ValueError as err:
        raise CLIError(str(err)) from None
    if args.json:
        print(json.dumps(dict(rows), ensure_ascii=False, indent=2))
    else:
        _print_rows(rows)
    return 0


def cmd_generate(args) -> int:
    """One prompt through the engine, its answer streamed to stdout as it is generated; the
    request's length, finish reason, TTFT and TPOT on stderr."""
    from minillm import LLM, SamplingParams
    from minillm.engine.loader import torch_dtype

    if (args.prompt is None) == (args.token_ids is None):
        raise CLIError("give exactly one of --prompt TEXT or --token-ids 1,2,3")
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
        llm = LLM(args.model, device=args.device, dtype=torch_dtype(args.dtype), weights=args.weights,
                  num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len,
                  quantization=args.quantization, group_size=args.group_size,
                  kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
                  compile_decode=bool(args.compile_decode))
        if args.token_ids is not None:
            prompt = args.token_ids
        elif args.raw or not getattr(llm.tokenizer, "chat_template", None):
            prompt = llm.prompt_token_ids(args.prompt)
        else:
            prompt = llm.chat_prompt_ids([{"role": "user", "content": args.prompt}])
        llm.add_request("cli", prompt, params)
    except ValueError as err:
        raise CLIError(str(err)) from None
    while llm.has_unfinished():
        for out in llm.step():
            print(out.new_text or "", end="", flush=True)
    if llm.tokenizer is None:
        print(" ".join(map(str, out.token_ids)), end="")
    print(flush=True)
    m = out.metrics
    tpot = f", TPOT {m.tpot * 1e3:.1f} ms" if m.tpot is not None else ""
    print(f"[{len(out.token_ids)} tokens, finish={out.finish_reason}, TTFT {m.ttft * 1e3:.1f} ms{tpot}]",
          file=sys.stderr)
    return 0


def cmd_plan(args) -> int:
    """Print the plan; exit code 2 with a one-line reason when it does not fit."""
    from minillm.engine.planner import plan

    try:
        result = plan(args.model, device=args.device, dtype=args.dtype, gpu_memory=args.gpu_memory,
                      gpu_memory_utilization=args.util, block_size=args.block_size,
                      max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                      max_num_seqs=args.max_num_seqs, memory_limit=args.memory_limit,
                      quantization=args.quantization, group_size=args.group_size,
                      kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size)
    except ValueError as err:
        raise CLIError(str(err)) from None
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        _print_rows(result.rows())
    return 0


def _print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(label) for label, _ in rows)
    print("\n".join(f"{label:<{width}}  {value}" for label, value in rows))


def _ints(text):
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minillm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    est = commands.add_parser("estimate", help="the ledger of a model on a GPU")
    est.add_argument("--model", required=True, help="preset name or directory with config.json")
    est.add_argument("--gpu-memory", help="e.g. 24GiB, 80GB (default: the --gpu's memory, else 24GiB)")
    est.add_argument("--gpu", help="GPU name from data/gpus.csv, for bandwidth (default 1 TB/s)")
    est.add_argument("--util", type=float, default=0.92, help="gpu_memory_utilization (default 0.92)")
    est.add_argument("--ctx", type=_ints, default=[1024, 4096, 8192], help="contexts, e.g. 1024,8192")
    est.add_argument("--batch", type=_ints, default=[1, 16, 48], help="decode batch sizes")
    est.add_argument("--dtype", default="bf16", choices=sorted(ledger.DTYPE_BYTES))
    est.add_argument("--json", action="store_true", help="print JSON instead of a table")
    est.set_defaults(func=cmd_estimate)
    from minillm.engine.device import add_threads_option
    from minillm.engine.engine_config import add_compile_option, add_quantization_options
    from minillm.engine.loader import TORCH_DTYPES

    gen = commands.add_parser(
        "generate", help="answer one prompt with the engine, streamed",
        description="Answer one prompt with the engine, streaming the text as it is generated, e.g. "
                    "python -m minillm generate smollm2-135m --prompt \"Explain the KV cache in three "
                    "sentences.\" A text prompt goes through the model's chat template when it has one "
                    "(--raw sends it as it is).")
    gen.add_argument("model", help="preset (smollm2-135m: the real SmolLM2-135M-Instruct), .gguf file, "
                                   "directory with config.json (+ weights) or hub id")
    gen.add_argument("--prompt", help="prompt text (needs a tokenizer: presets other than "
                                      "smollm2-135m have none)")
    gen.add_argument("--raw", action="store_true", help="send --prompt as it is, without the chat template")
    gen.add_argument("--token-ids", type=_ints, help="prompt as comma-separated token ids")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--ignore-eos", action="store_true",
                     help="go on past the model's end-of-sequence tokens: exactly --max-tokens tokens")
    gen.add_argument("--device", help="cpu or cuda (default: $MINILLM_DEVICE, else CUDA if present)")
    gen.add_argument("--dtype", choices=sorted(TORCH_DTYPES), help="default: the model's on CUDA, "
                                                                   "float32 on the CPU")
    gen.add_argument("--weights", default="auto", choices=["auto", "random"])
    gen.add_argument("--num-kv-blocks", type=int, help="KV blocks of 16 tokens (default: the planner on "
                                                       "CUDA; on the CPU $MINILLM_CPU_KVCACHE_SPACE GiB, default 4)")
    gen.add_argument("--max-model-len", type=int, help="longest request (default: what the pool holds)")
    gen.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks that split every layer (default 1)")
    add_quantization_options(gen)
    add_compile_option(gen)
    add_threads_option(gen)
    gen.set_defaults(func=cmd_generate)
    pln = commands.add_parser("plan", help="where a card's memory goes: weights, activations, KV blocks")
    pln.add_argument("--model", required=True, help="preset name or directory with config.json")
    pln.add_argument("--gpu-memory", help="dry run for a card you do not have, e.g. 24GiB, 80GB")
    pln.add_argument("--memory-limit", help="profile this device as a card of this size, e.g. 512MiB "
                                            "(required on the CPU)")
    pln.add_argument("--device", help="cpu or cuda (default: $MINILLM_DEVICE, else CUDA if present)")
    pln.add_argument("--util", type=float, default=0.92, help="gpu_memory_utilization (default 0.92)")
    pln.add_argument("--max-model-len", type=int, help="default: the model's max positions; -1: the "
                                                       "longest that fits")
    pln.add_argument("--block-size", type=int, default=16)
    pln.add_argument("--max-num-batched-tokens", type=int, default=2048,
                     help="tokens of the largest step, profiled (default 2048)")
    pln.add_argument("--max-num-seqs", type=int, default=256)
    pln.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="plan one rank's card of N (dry run only; default 1)")
    pln.add_argument("--dtype", choices=sorted(TORCH_DTYPES), help="default: the model's")
    pln.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_quantization_options(pln)
    pln.set_defaults(func=cmd_plan)
    from minillm.lab import (bench, bench_host, bench_llamacpp, bench_plan, bench_quality, bench_serve,
                             bench_speculative, bench_step, bench_structured, bench_throughput, diagnose,
                             loadgen)

    bench_commands = bench.add_cli(commands)
    bench_host.add_cli(bench_commands)
    bench_llamacpp.add_cli(bench_commands)
    bench_quality.add_cli(bench_commands)
    bench_throughput.add_cli(bench_commands)
    bench_plan.add_cli(bench_commands)
    bench_serve.add_cli(bench_commands)
    bench_speculative.add_cli(bench_commands)
    bench_step.add_cli(bench_commands)
    bench_structured.add_cli(bench_commands)
    diagnose.add_cli(commands)
    loadgen.add_cli(commands)
    from minillm.server import cli as server_cli

    server_cli.add_cli(commands)
    return parser


def _attach_negative_values(argv: list[str]) -> list[str]:
    """``--gpu-memory -3GiB`` -> ``--gpu-memory=-3GiB``, so a nonsense size gets our error, not argparse's."""
    out = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and token[:1] == "-" and token[1:2].isdigit():
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _apply_threads(threads: int | None) -> None:
    """The thread policy, applied once per command (``--threads``), and said on stderr."""
    from minillm.engine.device import set_threads

    try:
        print(f"minillm: {set_threads(threads)}", file=sys.stderr, flush=True)
    except ValueError as err:
        raise CLIError(str(err)) from None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(_attach_negative_values(argv))
    try:
        if getattr(args, "thread_policy", False):
            _apply_threads(args.threads)
        return args.func(args)
    except CLIError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
