"""``python -m minillm serve MODEL``: the OpenAI-compatible server from the command line.

The options are vLLM's names for the same things. Only argparse is imported here, so the other
commands of ``python -m minillm`` work where the server's packages (FastAPI, uvicorn) are missing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from minillm.engine.device import add_threads_option
from minillm.engine.engine_config import add_compile_option, add_quantization_options

ENGINE_OPTIONS = ("block_size", "num_kv_blocks", "max_model_len", "max_num_seqs",
                  "max_num_batched_tokens", "gpu_memory_utilization", "memory_limit",
                  "enable_chunked_prefill", "enable_prefix_caching", "quantization", "group_size", "kv_cache_dtype",
                  "speculative_config", "tensor_parallel_size", "compile_decode")
MAX_QUEUE = 1024  # requests that may wait for their first step
SHUTDOWN_TIMEOUT_S = 10.0  # on SIGTERM/SIGINT, what in-flight requests get to finish


def add_cli(subparsers) -> None:
    """Register ``serve`` on the ``python -m minillm`` subparsers."""
    cmd = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine")
    cmd.add_argument("model", help="folder with config.json (+ weights, tokenizer), preset or hub id")
    cmd.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine only)")
    cmd.add_argument("--port", type=int, default=8000)
    cmd.add_argument("--device", help="cpu or cuda (default: $MINILLM_DEVICE, else CUDA if present)")
    cmd.add_argument("--dtype", help="bfloat16, float16, float32 or float64 (default: the model's "
                                     "on CUDA, float32 on the CPU)")
    cmd.add_argument("--weights", default="auto", choices=["auto", "random"],
                     help="random: the model's shape with random values (no checkpoint needed)")
    cmd.add_argument("--block-size", type=int)
    cmd.add_argument("--num-kv-blocks", type=int, help="default: the planner sizes the pool (on the "
                                                       "CPU: $MINILLM_CPU_KVCACHE_SPACE GiB, default 4)")
    cmd.add_argument("--memory-limit", help="plan the KV pool as if the device had this much, e.g. 2GiB")
    cmd.add_argument("--gpu-memory-utilization", type=float)
    cmd.add_argument("--max-model-len", type=int)
    cmd.add_argument("--max-num-seqs", type=int)
    cmd.add_argument("--max-num-batched-tokens", type=int)
    cmd.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                     help="split long prompts over steps (default on); with "
                          "--no-enable-chunked-prefill a prompt must fit --max-num-batched-tokens")
    cmd.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                     help="reuse the KV blocks of a prompt's cached prefix (default on)")
    add_quantization_options(cmd)
    add_compile_option(cmd)
    add_threads_option(cmd)
    cmd.add_argument("--speculative-config", type=speculative_config, metavar="JSON",
                     help='speculative decoding, vLLM\'s keys, e.g. \'{"method": "ngram", '
                          '"num_speculative_tokens": 4, "prompt_lookup_max": 3}\' or \'{"method": '
                          '"draft_layers", "num_draft_layers": 20, "num_speculative_tokens": 3}\'')
    cmd.add_argument("--tensor-parallel-size", type=int,
                     help="ranks (one process and device each) that split every layer (default 1)")
    cmd.add_argument("--served-model-name", help="the name clients ask for (default: MODEL as given)")
    cmd.add_argument("--api-key", default=os.environ.get("MINILLM_API_KEY") or None,
                     help="require 'Authorization: Bearer KEY' on /v1 routes, /tokenize and "
                          "/detokenize (default: $MINILLM_API_KEY, else none)")
    cmd.add_argument("--max-queue", type=int, default=MAX_QUEUE,
                     help="requests waiting at most; beyond it 503 with Retry-After (default %(default)s)")
    cmd.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT_S,
                     help="on SIGTERM/SIGINT, seconds in-flight requests get to finish before they "
                          "are aborted (default %(default)g)")
    cmd.add_argument("--access-log", action="store_true", help="log every HTTP request")
    cmd.set_defaults(func=run_cli)


def speculative_config(text: str) -> dict:
    """``--speculative-config``: a JSON object (its keys are checked by ``EngineConfig``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object, e.g. '{\"method\": \"ngram\"}'")
    return value


def run_cli(args) -> int:
    """Serve until SIGTERM/SIGINT (exit 0); exit code 1 if the engine loop stopped on an error, 2
    with a one-line reason for a bad setting."""
    try:
        from minillm.server.api_server import serve
    except ImportError as err:
        print(f"error: the server needs FastAPI and uvicorn ({err}): pip install -r requirements.txt",
              file=sys.stderr)
        return 2
    from minillm.engine.loader import torch_dtype

    engine_args = {name: getattr(args, name) for name in ENGINE_OPTIONS if getattr(args, name) is not None}
    try:
        return serve(args.model, host=args.host, port=args.port,
                     served_model_name=args.served_model_name, api_key=args.api_key,
                     max_queue=args.max_queue, shutdown_timeout=args.shutdown_timeout,
                     access_log=args.access_log, device=args.device, dtype=torch_dtype(args.dtype),
                     weights=args.weights, **engine_args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
