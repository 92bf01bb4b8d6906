"""The Triton kernels compiled for real GPUs without one: sm_80, sm_86, sm_89 and sm_90.

Nothing here guesses what the engine launches. A stand-in CUDA driver tells Triton the target, and
Triton's ``jit_cache_hook`` records each launch (the key Triton's own binder computes from the real
arguments, the signature, constexprs, alignment attributes, num_warps, num_stages) and skips it;
two launches share a binary exactly when they share a key. Then:

* no compile per step: an engine-like sweep (decode batches of 1..48 sequences, prefill chunks,
  contexts up to 2000 tokens, block tables of varying width, metadata from ``StepBuilder`` as the
  engine builds it) gives at most 2 keys per kernel, and ``warmup`` launches every one of them;
* the quantized matmul (``triton_quant``) compiles once per layer shape, whatever the row count;
* every binary fits: each distinct launch of ``warmup`` over the model matrix (fp8 caches
  included), and of the quantized matmul over real layer shapes, is compiled with
  ``triton.compile`` for each target; its shared memory must fit the target's per-block limit
  (``metadata.shared``) and ptxas must spill nothing. The metadata has no spill count (Triton reads
  it from the driver when it loads the binary), so the ``ptxas -v`` log Triton prints under
  ``TRITON_DUMP_PTXAS_LOG`` is parsed instead.

All of it runs in one subprocess (``python tests/test_kernel_compile.py`` prints the results as
JSON) without TRITON_INTERPRET, which this process may have set, and with a fresh Triton cache
(a cache hit would skip ptxas). Distinct launches compile in parallel, a process per core (up
to 8).
"""
import contextlib
import io
import json
import multiprocessing
import os
import random
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minillm.engine import kernels

TARGETS = (80, 86, 89, 90)
# Shared memory one block may use (the opt-in maximum, which Triton checks when it loads a binary):
# "Maximum amount of shared memory per thread block", CUDA C++ Programming Guide, Technical
# Specifications per Compute Capability: 163 KB (8.0), 99 KB (8.6, 8.9), 227 KB (9.0); also the
# Ampere, Ada and Hopper tuning guides ("CUDA reserves 1 KB of shared memory per thread block").
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
# (num_heads, num_kv_heads): GQA group 4 (Llama 3 8B), group 7 (Qwen2.5 0.5B), MHA
SHAPES = ((32, 8), (14, 2), (32, 32))
FP8 = torch.float8_e4m3fn
FP8_MIN_TARGET = 89  # e4m3 (Triton's fp8e4nv) exists from sm_89 (Ada, Hopper) on
# (activation dtype, head_dim, cache dtype): the model's dtype, or an fp8 cache (kv_cache_dtype="fp8")
DTYPES = ((torch.bfloat16, 64, None), (torch.bfloat16, 128, None), (torch.float16, 64, None),
          (torch.float16, 128, None), (torch.float32, 128, None), (torch.bfloat16, 128, FP8),
          (torch.float16, 64, FP8))
# (in_features, out_features) of the quantized linears: Llama-3.1-8B's and SmolLM2-135M's
LINEAR_SHAPES = ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256),
                 (576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))
QUANT_FORMATS = (("int8", 0), ("int4", 32), ("int4", 128))
BLOCK_SIZE = 16
SWEEP_SMS = 132  # split decode as on an H100 SXM
MAX_VARIANTS = 2


def model_matrix():
    """``(name, config, dtype, kv_dtype)`` for each shape, dtype, head_dim and cache dtype."""
    return [(f"{str(dtype)[6:]} d{head_dim} {n_heads}/{n_kv}" + (" fp8 KV" if kv_dtype else ""),
             SimpleNamespace(num_heads=n_heads, num_kv_heads=n_kv, head_dim=head_dim), dtype, kv_dtype)
            for n_heads, n_kv in SHAPES for dtype, head_dim, kv_dtype in DTYPES]


# -- in the subprocess ---------------------------------------------------------------------------
class _FakeCudaDriver:
    """Just enough of Triton's CUDA driver for a launch to reach the cache hook."""

    def __init__(self, cc):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", cc, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


@contextlib.contextmanager
def recorded_launches():
    """Launches inside record ``{"kernel", "key", "compile"}`` into the yielded list and run nothing
    (this process has no GPU to go back to: the stand-in driver stays)."""
    from triton import knobs
    from triton.runtime.driver import driver

    launches = []

    def hook(*, key, fn, compile, **_):
        launches.append({"kernel": fn.name, "module": fn.module, "key": key, "compile": compile})
        return True  # skip the compile and the launch

    driver.set_active(_FakeCudaDriver(90))
    knobs.runtime.jit_cache_hook = hook
    try:
        yield launches
    finally:
        knobs.runtime.jit_cache_hook = None


def sweep(config, dtype, kv_dtype=None, device="cpu"):
    """The attention launches of an engine's steps, the metadata built as the engine builds it
    (every table entry is block 0, so on a GPU they run too)."""
    from minillm.engine.attention_metadata import StepBuilder
    from minillm.engine.kernels import triton_attention as ta

    rng = random.Random(0)
    n_heads, n_kv, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    k_cache, v_cache = (torch.zeros(4, BLOCK_SIZE, n_kv, head_dim, dtype=kv_dtype or dtype, device=device)
                        for _ in range(2))
    builder = StepBuilder(device)
    steps = [([rng.randint(0, 42 * batch - 1) for _ in range(batch)], [1] * batch)  # decode
             for batch in range(1, 49)]
    steps += [([rng.randint(1000, 1999) for _ in range(batch)], [1] * batch) for batch in range(1, 9)]
    steps += [([rng.choice([0, rng.randint(0, 1000)]) for _ in range(n)],
               [rng.randint(1, 300) for _ in range(n)]) for n in range(1, 9) for _ in range(4)]
    for computed, new in steps:
        width = max(-(-(c + n) // BLOCK_SIZE) for c, n in zip(computed, new)) + rng.randint(0, 3)
        tables = torch.zeros(len(new), width, dtype=torch.int32)
        _, _, attn = builder.build(tables, computed, new, BLOCK_SIZE, token_ids=[0] * sum(new))
        tokens = sum(new)
        q, k, v = (torch.zeros(tokens, heads * head_dim, dtype=dtype, device=device)
                   .view(tokens, heads, head_dim) for heads in (n_heads, n_kv, n_kv))
        ta.store_kv(k, v, k_cache, v_cache, attn.slot_mapping)
        if attn.max_query_len == 1:
            ta.paged_decode_attention(q, k_cache, v_cache, attn.block_tables, attn.seq_lens, 0.1)
        else:
            ta.paged_prefill_attention(q, k_cache, v_cache, attn.block_tables, attn.cu_seqlens_q,
                                       attn.seq_lens, 0.1)


def variants():
    """Per model: the sweep's distinct keys per kernel, and the kernels with a key warmup lacks."""
    from minillm.engine.kernels import triton_attention as ta

    ta._multiprocessor_count = lambda device: SWEEP_SMS
    result = {}
    for name, config, dtype, kv_dtype in model_matrix():
        with recorded_launches() as swept:
            sweep(config, dtype, kv_dtype)
        with recorded_launches() as warmed:
            ta.warmup(config, dtype, "cpu", BLOCK_SIZE, kv_dtype)
        keys = defaultdict(set)
        for launch in swept:
            keys[launch["kernel"]].add(launch["key"])
        warm_keys = {launch["key"] for launch in warmed}
        result[name] = {"keys": {kernel: len(k) for kernel, k in keys.items()},
                        "launches": len(swept),
                        "not_warmed": sorted({launch["kernel"] for launch in swept
                                              if launch["key"] not in warm_keys})}
    return result


def quant_launches(rows=(1,)):
    """The quantized matmul's launches for every linear shape and format, in bf16 and fp16, at
    ``rows`` input rows (decode batches and prefill chunks)."""
    from minillm.engine.kernels.triton_quant import int4_linear, int8_linear
    from minillm.engine.quantization import pack_int4

    with recorded_launches() as launches:
        for k, n in LINEAR_SHAPES:
            for dtype in (torch.bfloat16, torch.float16):
                for m in rows:
                    x = torch.zeros(m, k, dtype=dtype)
                    for method, group in QUANT_FORMATS:
                        if k % max(group, 1):
                            continue  # the engine refuses int4 groups that do not tile K
                        if method == "int8":
                            int8_linear(x, torch.zeros(n, k, dtype=torch.int8), torch.zeros(n))
                        else:
                            params = torch.zeros(k // group, n, 2, dtype=torch.float16)
                            int4_linear(x, pack_int4(torch.zeros(n, k, dtype=torch.uint8)), params, group)
    return launches


def compile_one(module, kernel, signature, constants, attrs, num_warps, num_stages, cc):
    """Compile one launch for ``sm_{cc}``: its shared memory, registers and spills (ptxas -v)."""
    import importlib

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    knobs.nvidia.dump_ptxas_log = True
    src = triton.compiler.ASTSource(getattr(importlib.import_module(module), kernel), signature, constants, attrs)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                                  options={"num_warps": num_warps, "num_stages": num_stages})
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log.getvalue())
    registers = re.search(r"Used (\d+) registers", log.getvalue())
    if not spills or not registers:
        raise RuntimeError(f"no ptxas -v report for {kernel} on sm_{cc}:\n{log.getvalue()}")
    return {"shared": compiled.metadata.shared, "registers": int(registers[1]),
            "spill_stores": int(spills[1]), "spill_loads": int(spills[2])}


def compile_all():
    """Each distinct launch of ``warmup`` over the model matrix, compiled for each target."""
    from minillm.engine.kernels import triton_attention as ta

    launches = {}
    for name, config, dtype, kv_dtype in model_matrix():
        with recorded_launches() as warmed:
            ta.warmup(config, dtype, "cpu", BLOCK_SIZE, kv_dtype)
        for launch in warmed:
            launches.setdefault((launch["kernel"], launch["key"]), (name, launch))
    for launch in quant_launches():
        launches.setdefault((launch["kernel"], launch["key"]), ("quantized linears", launch))
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # fresh: a cache hit would skip ptxas
        workers = min(8, os.cpu_count() or 1)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            jobs = []
            for cc in TARGETS:
                for name, launch in launches.values():
                    if "fp8 KV" in name and cc < FP8_MIN_TARGET:
                        continue  # Triton has no e4m3 before sm_89: the engine refuses fp8 KV there
                    c = launch["compile"]
                    future = pool.submit(compile_one, launch["module"], launch["kernel"], c["signature"],
                                         c["constants"], c["configs"][0], c["num_warps"],
                                         c["num_stages"], cc)
                    names = list(c["signature"])
                    jobs.append(({"target": cc, "kernel": launch["kernel"], "model": name,
                                  "num_warps": c["num_warps"], "num_stages": c["num_stages"],
                                  "constexprs": {names[i]: v for (i,), v in c["constants"].items()}},
                                 future))
            return [{**job, **future.result()} for job, future in jobs]


# -- in pytest -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).parent.parent, timeout=900)
    assert done.returncode == 0, done.stderr[-5000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("cc", TARGETS)
def test_every_launch_fits_the_target_without_spills(report, cc):
    compiled = [r for r in report["compiled"] if r["target"] == cc]
    assert {r["kernel"] for r in compiled} == {"_store_kv_kernel", "_paged_decode_kernel",
                                               "_merge_splits_kernel", "_paged_prefill_kernel",
                                               "_quant_matmul_kernel"}
    models = {name for name, *_ in model_matrix() if cc >= FP8_MIN_TARGET or "fp8 KV" not in name}
    assert {r["model"] for r in compiled} == models | {"quantized linears"}
    too_big = [r for r in compiled if r["shared"] > SHARED_LIMIT[cc]]
    assert not too_big, f"over {SHARED_LIMIT[cc]} B of shared memory: {too_big}"
    spilling = [r for r in compiled if r["spill_stores"] or r["spill_loads"]]
    assert not spilling, f"register spills: {spilling}"


def test_a_run_compiles_each_kernel_at_most_twice_all_in_warmup(report):
    for name, found in report["variants"].items():
        assert found["launches"] > 100, name
        assert max(found["keys"].values()) <= MAX_VARIANTS, (name, found["keys"])
        assert found["keys"]["_paged_decode_kernel"] == 2, (name, found["keys"])  # whole, split
        assert not found["not_warmed"], (name, found["not_warmed"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_after_warmup_a_run_compiles_nothing(monkeypatch):
    from triton import knobs

    for _, config, dtype, kv_dtype in model_matrix()[:2]:
        kernels.warmup(config, dtype, "cuda", BLOCK_SIZE, kv_dtype)
        compiled = []
        monkeypatch.setattr(knobs.runtime, "jit_cache_hook",
                            lambda *, fn, **_: compiled.append(fn.name))  # on a cache miss
        sweep(config, dtype, kv_dtype, "cuda")
        torch.cuda.synchronize()
        monkeypatch.undo()
        assert not compiled


def test_warmup_is_a_no_op_off_cuda(monkeypatch):
    monkeypatch.setattr(kernels, "_impl", lambda backend: pytest.fail("warmup launched off CUDA"))
    config = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=64)
    assert kernels.warmup(config, torch.float32, "cpu", BLOCK_SIZE) is None


def quant_variants():
    """Distinct keys of the quantized matmul per linear shape, format and dtype, over decode
    batches of 1..48 rows and prefill chunks: the row count must not make a new binary."""
    keys = defaultdict(set)
    for launch in quant_launches(rows=(1, 2, 3, 8, 16, 17, 48, 300, 2048)):
        c = launch["compile"]
        keys[json.dumps([sorted(map(str, c["constants"].items())), sorted(map(str, c["signature"].items()))])
             ].add(launch["key"])
    return max(len(k) for k in keys.values())


def test_the_quantized_matmul_compiles_once_per_layer_shape(report):
    assert report["quant_variants"] == 1


if __name__ == "__main__":
    torch.set_num_threads(1)  # tiny tensors; the cores go to the compiles
    print(json.dumps({"variants": variants(), "compiled": compile_all(), "quant_variants": quant_variants()}))
