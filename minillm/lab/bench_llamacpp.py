"""minillm beside llama.cpp on the same GGUF file (chapter 解码: a small model on a laptop).

``python -m minillm bench llamacpp``: one request at a time, the same prompt token ids (the first
``prompt_len`` tokens of ``bench quality``'s English text), greedy, the same CPU threads on both
sides (the thread policy's). Each round runs minillm's engine, then
llama.cpp (through ``llama-cpp-python``), so that a machine whose load drifts slows both alike;
the medians over the rounds give prefill tokens per second (the prompt's step, its first token
sampled) and decode tokens per second (one step per token after it), and their ratios. Each round
also times minillm's linear layers alone on one row (every matmul of the layers and the output
layer, ``bench.time_linear_layers``): beside llama.cpp's whole decode step, it says how much of
the gap is the matmul kernels and how much everything else minillm's step issues. End to end,
each round also starts one fresh process per side that answers the same chat prompt, greedy, with
exactly ``e2e_tokens`` tokens (both go on past the end-of-sequence token, so both do the same
work), as a user's command would: ``python -m minillm generate --ignore-eos`` against
llama-cpp-python's ``create_chat_completion``; their wall times (imports, loading, tokenizer,
prefill, decode, exit) and their ratio. The greedy tokens of the two sides are compared up to
their first difference: both round differently (llama.cpp quantizes the activations to 8 bits;
minillm's int4 kernel rounds them to bf16, its compiled output layer keeps float32), so a near
tie can split them.

``llama-cpp-python`` is optional and not a requirement of the book: it builds llama.cpp from
source (``pip install llama-cpp-python``, minutes on a laptop), so this benchmark is not in CI.
"""
from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time

import torch

from minillm.engine.config import resolve_checkpoint
from minillm.engine.engine_config import add_compile_option, add_quantization_options
from minillm.engine.llm import LLM
from minillm.engine.loader import torch_dtype
from minillm.engine.sampling import SamplingParams
from minillm.lab.bench import time_linear_layers
from minillm.lab.bench_cli import add_options, report
from minillm.lab.bench_quality import text_tokens


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise ValueError("bench llamacpp needs llama-cpp-python, which is not a requirement of the "
                         "book: pip install llama-cpp-python (it builds llama.cpp from source)") from None
    return llama_cpp


def _minillm_round(llm: LLM, prompt: list[int], new_tokens: int) -> tuple[float, list[float], list[int]]:
    """(prefill seconds, decode step seconds, tokens) of one greedy request through the engine."""
    llm.add_request("bench", prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    seconds, tokens = [], []
    while llm.has_unfinished():
        start = time.perf_counter()
        (out,) = llm.step()
        seconds.append(time.perf_counter() - start)
        tokens += out.new_token_ids
    return seconds[0], seconds[1:], tokens


def _llama_round(llama, prompt: list[int], new_tokens: int) -> tuple[float, list[float], list[int]]:
    """The same through llama.cpp: its ``generate`` yields each token once it is sampled (after
    ``reset``, which keeps it from reusing the last round's prompt)."""
    seconds, tokens = [], []
    llama.reset()
    start = time.perf_counter()
    for token in llama.generate(prompt, top_k=1, temp=0.0, reset=True):
        now = time.perf_counter()
        seconds.append(now - start)
        tokens.append(token)
        if len(tokens) == new_tokens:
            break
        start = time.perf_counter()
    return seconds[0], seconds[1:], tokens


E2E_PROMPT = "Explain the KV cache in three sentences."
LLAMA_CHAT = """import sys
from llama_cpp import Llama
path, tokens, threads, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
eos = [int(t) for t in sys.argv[5].split(",")]
llama = Llama(path, n_ctx=tokens + 512, n_threads=threads, n_threads_batch=threads, verbose=False)
reply = llama.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=tokens, temperature=0.0,
                                     logit_bias={t: float("-inf") for t in eos})
print(reply["choices"][0]["message"]["content"])
print(reply["usage"]["completion_tokens"])
"""


def timed_process(command: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    """(wall seconds, what it printed) of ``command`` in a new process; ``ValueError`` with the
    end of its stderr if it fails."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise ValueError(f"{' '.join(command[:4])} ... failed: {done.stderr.strip()[-500:]}")
    return seconds, done


def minillm_process(model_name: str, tokens: int, threads: int, options: list[str] = ()) -> tuple[float, int]:
    """(wall seconds, tokens answered) of ``python -m minillm generate`` answering
    :data:`E2E_PROMPT` greedily with exactly ``tokens`` tokens (past the end-of-sequence token), in
    a fresh process; ``options``: more of its command-line options (device, dtype, quantization)."""
    seconds, done = timed_process([sys.executable, "-m", "minillm", "generate", model_name, "--prompt", E2E_PROMPT,
                                    "--max-tokens", str(tokens), "--ignore-eos", "--temperature", "0",
                                    "--threads", str(threads), *options])
    return seconds, int(re.search(r"\[(\d+) tokens", done.stderr)[1])


def llama_process(path, tokens: int, threads: int, eos_token_ids: tuple[int, ...]) -> tuple[float, int]:
    """The same through llama-cpp-python's chat completion, in a fresh process (its context room
    for the short prompt and ``tokens`` more; the end-of-sequence tokens' logits at -inf, the way it
    goes on past them)."""
    seconds, done = timed_process([sys.executable, "-c", LLAMA_CHAT, str(path), str(tokens), str(threads), E2E_PROMPT,
                                    ",".join(map(str, eos_token_ids))])
    return seconds, int(done.stdout.split()[-1])


def bench_llamacpp(model_name: str = "smollm2-135m", device=None, dtype=None, quantization=None,
                   group_size: int = 32, kv_cache_dtype: str = "auto", prompt_len: int = 128, new_tokens: int = 64, rounds: int = 3,
                   e2e_tokens: int = 128, compile_decode: bool = False) -> dict:
    """Prefill and decode tokens per second of minillm and llama.cpp on ``model_name``'s GGUF file,
    ``rounds`` rounds interleaved, and minillm's over llama.cpp's; with ``e2e_tokens`` (0: not),
    the wall time of a fresh process per side answering a chat prompt; ``compile_decode``: minillm's
    decode steps compiled (``EngineConfig.compile_decode``; its warm-up round compiles)."""
    for name, value in (("prompt_len", prompt_len), ("new_tokens", new_tokens), ("rounds", rounds),
                        ("e2e_tokens", e2e_tokens)):
        least = {"new_tokens": 2, "e2e_tokens": 0}.get(name, 1)
        if not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    path = resolve_checkpoint(model_name)
    if path is None or path.suffix != ".gguf":
        raise ValueError(f"{model_name}: bench llamacpp needs a .gguf file (or a preset that names one, "
                         f"e.g. smollm2-135m)")
    llama_cpp = _llama_cpp()
    threads = torch.get_num_threads()
    context = prompt_len + new_tokens
    llm = LLM(model_name, device=device, dtype=torch_dtype(dtype), quantization=quantization,
              group_size=group_size, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=-(-context // 16),
              max_model_len=context, max_num_batched_tokens=context,  # the prompt in one step
              enable_prefix_caching=False,  # each round computes the whole prompt, on both sides
              compile_decode=compile_decode)
    llama = llama_cpp.Llama(str(path), n_ctx=context, n_batch=prompt_len, n_threads=threads,
                            n_threads_batch=threads, verbose=False)
    prompt = text_tokens(llm.tokenizer, prompt_len)
    _minillm_round(llm, prompt, 2)  # warm-up, untimed
    _llama_round(llama, prompt, 2)
    sides = {"minillm": (_minillm_round, llm), "llama.cpp": (_llama_round, llama)}
    prefill, decode, agree = {side: [] for side in sides}, {side: [] for side in sides}, []
    linears, e2e = [], {side: [] for side in sides}
    options = ["--device", llm.model.device.type, "--dtype", str(llm.model.dtype).removeprefix("torch."),
               "--kv-cache-dtype", kv_cache_dtype]
    options += [] if quantization is None else ["--quantization", quantization, "--group-size", str(group_size)]
    options += ["--compile-decode"] if compile_decode else []
    for _ in range(rounds):
        tokens = {}
        for side, (run, engine) in sides.items():
            first, steps, tokens[side] = run(engine, prompt, new_tokens)
            prefill[side].append(first)
            decode[side].append(statistics.median(steps))
        linears.append(statistics.median(time_linear_layers(llm.model, 1, new_tokens)))
        same = [a == b for a, b in zip(tokens["minillm"], tokens["llama.cpp"])]
        agree.append(same.index(False) if False in same else len(same))
        if e2e_tokens:
            e2e["minillm"].append(minillm_process(model_name, e2e_tokens, threads, options))
            e2e["llama.cpp"].append(llama_process(path, e2e_tokens, threads, llm.model.config.eos_token_ids))
    result = {side: {"prefill_tokens_per_s": prompt_len / statistics.median(prefill[side]),
                     "decode_tokens_per_s": 1 / statistics.median(decode[side])} for side in sides}
    quant = "none" if quantization is None else (f"int4-g{group_size}" if quantization == "int4" else quantization)
    return {"model": llm.model.config.name, "gguf": path.name, "dtype": str(llm.model.dtype).removeprefix("torch."),
            "quantization": quant, "compile_decode": compile_decode, "llama_cpp_version": llama_cpp.__version__, "cpu_threads": threads,
            "prompt_len": prompt_len, "new_tokens": new_tokens, "rounds": rounds, **result,
            "decode_ratio": result["minillm"]["decode_tokens_per_s"] / result["llama.cpp"]["decode_tokens_per_s"],
            "prefill_ratio": result["minillm"]["prefill_tokens_per_s"] / result["llama.cpp"]["prefill_tokens_per_s"],
            "minillm_linears_s": statistics.median(linears),
            "greedy_tokens_agreed": min(agree), "e2e_tokens": e2e_tokens,
            "end_to_end": {side: {"wall_s": statistics.median(s for s, _ in runs),
                                  "tokens": statistics.median(n for _, n in runs)}
                           for side, runs in e2e.items() if runs}}


def format_llamacpp(r: dict) -> str:
    compiled = ", decode compiled" if r["compile_decode"] else ""
    lines = [f"{r['gguf']}: minillm ({r['dtype']}, quantization {r['quantization']}{compiled}) beside llama.cpp "
             f"(llama-cpp-python {r['llama_cpp_version']}), {r['cpu_threads']} CPU threads, prompt "
             f"{r['prompt_len']} tokens, {r['new_tokens']} new, {r['rounds']} rounds interleaved",
             f"{'':<14} {'minillm':>10} {'llama.cpp':>10} {'ratio':>7}"]
    for kind in ("prefill", "decode"):
        ours, theirs = r["minillm"][f"{kind}_tokens_per_s"], r["llama.cpp"][f"{kind}_tokens_per_s"]
        lines.append(f"{kind + ' tok/s':<14} {ours:>10,.1f} {theirs:>10,.1f} {r[f'{kind}_ratio']:>6.2f}x")
    step = 1 / r["llama.cpp"]["decode_tokens_per_s"]
    lines.append(f"minillm's linears alone, one row: {r['minillm_linears_s'] * 1e3:.1f} ms a token, "
                 f"{r['minillm_linears_s'] / step:.2f}x llama.cpp's whole decode step ({step * 1e3:.1f} ms)")
    lines.append(f"greedy tokens the same on both sides before the first difference: {r['greedy_tokens_agreed']} "
                 f"of {r['new_tokens']}")
    if r["end_to_end"]:
        ours, theirs = r["end_to_end"]["minillm"], r["end_to_end"]["llama.cpp"]
        lines.append(f"end to end, a fresh process answering {E2E_PROMPT!r} ({r['e2e_tokens']} tokens): "
                     f"minillm {ours['wall_s']:.2f} s ({ours['tokens']:g} tokens), llama.cpp "
                     f"{theirs['wall_s']:.2f} s ({theirs['tokens']:g} tokens): "
                     f"{ours['wall_s'] / theirs['wall_s']:.2f}x its wall time")
    return "\n".join(lines)


def add_cli(bench_commands) -> None:
    cmd = bench_commands.add_parser("llamacpp", help="minillm beside llama.cpp (llama-cpp-python, optional) "
                                                     "on the same GGUF: prefill and decode, interleaved")
    add_options(cmd, model="smollm2-135m", out=None)
    add_quantization_options(cmd)
    add_compile_option(cmd)
    cmd.add_argument("--prompt-len", type=int, default=128)
    cmd.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default 64)")
    cmd.add_argument("--rounds", type=int, default=3, help="rounds, each side once per round (default 3)")
    cmd.add_argument("--e2e-tokens", type=int, default=128,
                     help="end to end: a fresh process per side answers a chat prompt with exactly this "
                          "many tokens, each round (default 128; 0: skip)")
    cmd.add_argument("--json", action="store_true", help="print one JSON object")
    cmd.set_defaults(func=run_cli)


def run_cli(args) -> int:
    return report(args, "llamacpp", {}, lambda device: bench_llamacpp(
        args.model, device, args.dtype, args.quantization, args.group_size, args.kv_cache_dtype, args.prompt_len, args.max_tokens,
        args.rounds, args.e2e_tokens, compile_decode=bool(args.compile_decode)), json.dumps if args.json else format_llamacpp)
