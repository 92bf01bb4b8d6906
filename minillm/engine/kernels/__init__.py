"""Attention kernels over a paged KV cache (chapters 解码 and 分页的 KV cache).

Each op has two implementations with one signature: ``backend="torch"`` (plain PyTorch, the
reference, used on the CPU) and ``backend="triton"`` (the GPU kernels). ``default_backend``
picks Triton for CUDA tensors; :func:`warmup` compiles them before a run.
"""
from __future__ import annotations

import importlib

import torch

BACKENDS = ("torch", "triton")
_MODULES = {"torch": "minillm.engine.kernels.reference", "triton": "minillm.engine.kernels.triton_attention"}


def default_backend(tensor: torch.Tensor) -> str:
    """Triton on CUDA, the torch reference elsewhere."""
    return "triton" if tensor.is_cuda else "torch"


def _impl(backend: str):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return importlib.import_module(_MODULES[backend])


def store_kv(k, v, k_cache, v_cache, slot_mapping, backend: str = "torch") -> None:
    """Write the new tokens' K and V ``[T, n_kv, d]`` into the cache at flat ``slot_mapping``."""
    _impl(backend).store_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len: int | None = None,
                           backend: str = "torch") -> torch.Tensor:
    """One query token per sequence ``[B, n_heads, d]`` attends to its whole paged context.
    ``max_seq_len``: the largest of ``seq_lens`` when the caller knows it on the host, so that the
    reference need not read it back (the Triton kernel needs no such bound)."""
    if backend == "torch":
        return _impl(backend).paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len)
    return _impl(backend).paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                            backend: str = "torch") -> torch.Tensor:
    """New tokens ``[T, n_heads, d]`` attend causally to themselves and fully to their paged prefix."""
    return _impl(backend).paged_prefill_attention(q, k_cache, v_cache, block_tables,
                                                  cu_seqlens_q, seq_lens, scale)


def warmup(config, dtype: torch.dtype, device, block_size: int, kv_dtype: torch.dtype | None = None) -> None:
    """Compile every Triton binary a run of ``config`` with ``dtype`` activations and ``kv_dtype``
    caches (default ``dtype``) of ``block_size`` launches, so that no timed step compiles; a no-op
    off CUDA, where the reference runs."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    with torch.cuda.device(device):
        _impl("triton").warmup(config, dtype, device, block_size, kv_dtype)
