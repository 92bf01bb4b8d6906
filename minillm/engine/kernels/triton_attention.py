"""Triton attention over a paged KV cache (chapters 解码 and 分页的 KV cache).

Same signatures and semantics as ``minillm.engine.kernels.reference``:

* :func:`store_kv` writes each new token's K and V into its slot of the paged cache.
* :func:`paged_decode_attention`: one query token per sequence against its whole context.
  One program serves one KV head's whole group of query heads (GQA), so each K/V tile is loaded
  once for the group; the group is padded to 16 rows because ``tl.dot`` needs 16. Long contexts
  are split into pieces handled by separate programs (flash-decoding); a second kernel merges
  the pieces with their log-sum-exp. The grid sets how many pieces a context may have; each
  sequence cuts its own context, read on the device, into pieces of at least
  ``MIN_SPLIT_TOKENS``, so a CUDA graph captured for the longest context splits a short one as
  an eager step would.
* :func:`paged_prefill_attention`: new tokens attend causally to themselves and fully to the
  cached prefix before them (chunked prefill, prefix-cache hits). One program serves a tile of
  query tokens times the group of query heads of one KV head.

Keys and values are gathered token by token through the block table, so any block size works.
Softmax runs online in fp32 with ``exp2``. Under ``TRITON_INTERPRET=1`` (CPU tests) every dot
runs in fp32, since the interpreter gets bf16 dots wrong; on a GPU fp16/bf16 caches use the
tensor cores with fp32 accumulation.

Compiled once per run: Triton specializes an integer argument equal to 1 or divisible by 16, and
a pointer 16-byte aligned, into a separate binary. The arguments that change from step to step
(block-table width and pointer, number of sequences, split count) are marked
``do_not_specialize``, so a run compiles one binary per kernel (two for decode: with and without
the split), all of which :func:`warmup` launches up front. Tile sizes, warps and stages are chosen
to fit sm_80 to sm_90 without register spills under Triton 3.6 and 3.7;
``tests/test_kernel_compile.py`` compiles every launch for each of them under the Triton installed.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = math.log2(math.e)
MIN_DOT_ROWS = 16  # tl.dot needs M, N, K >= 16
DECODE_BLOCK_N = 64  # context tokens per tile in decode
MIN_SPLIT_TOKENS = 256  # decode splits the context only into pieces at least this long
MAX_SPLITS = 64  # and into at most this many (one merge binary for every split count)
INDEX_DTYPES = (torch.int32, torch.int64)
FP8_MAX = tl.constexpr(448.0)  # the largest e4m3 value (torch.finfo(torch.float8_e4m3fn).max)


# -- building blocks shared by the kernels ------------------------------------------------------
@triton.jit
def _load_kv_tile(cache_ptr, block_table_ptr, positions, valid, kv_head, block_size,
                  stride_block, stride_slot, stride_head, offs_d, mask_d):
    """Rows ``[BLOCK_N, BLOCK_D]`` of one KV head at token ``positions``, through the block table."""
    block = tl.load(block_table_ptr + positions // block_size, mask=valid, other=0).to(tl.int64)
    rows = block * stride_block + (positions % block_size) * stride_slot + kv_head * stride_head
    return tl.load(cache_ptr + rows[:, None] + offs_d[None, :],
                   mask=valid[:, None] & mask_d[None, :], other=0.0)


@triton.jit
def _online_softmax_step(q, k, v, mask, m_i, l_i, acc, qk_scale, DOT_FP32: tl.constexpr):
    """Fold one tile of keys and values into the running max ``m_i``, sum ``l_i`` and ``acc``.

    Scores are in base 2 (``qk_scale`` includes log2(e)). Rows with no visible key yet keep
    ``m_i = -inf`` and contribute nothing (no NaN).
    """
    if DOT_FP32:
        scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:  # an fp8 cache's keys and values are read back in the queries' dtype
        scores = tl.dot(q, tl.trans(k.to(q.dtype)))
    scores = tl.where(mask, scores * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc * alpha[:, None] + pv


# -- store ---------------------------------------------------------------------------------------
@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, block_size,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SATURATE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # -1: this token's K/V is not stored
        return
    block = slot // block_size
    offset = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if SATURATE:  # an fp8 cache: clamp to e4m3's ±448 as torch's cast does, not to inf or NaN
        k = tl.minimum(tl.maximum(k.to(tl.float32), -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32), -FP8_MAX), FP8_MAX)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + offs_h[:, None] * stride_kch
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch
    tl.store(k_dst + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``k, v`` ``[T, n_kv, d]`` into the caches at flat slots ``slot_mapping`` (-1: skip)."""
    _check_caches(k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    for name, tensor in (("k", k), ("v", v)):
        if tensor.dim() != 3 or tuple(tensor.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must have shape [T, {num_kv_heads}, {head_dim}], "
                             f"got {tuple(tensor.shape)}")
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    _check_index("slot_mapping", slot_mapping, (k.shape[0],))
    if k.shape[0] == 0:
        return
    _store_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        SATURATE=k_cache.element_size() == 1)


# -- decode --------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["block_tables_ptr", "stride_bt", "stride_lb", "stride_lh"])
def _paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                         out_ptr, lse_ptr, qk_scale, block_size, min_split_len,
                         stride_qb, stride_qh,
                         stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                         stride_bt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         STORE_LSE: tl.constexpr, DOT_FP32: tl.constexpr):
    """Program (sequence, KV head, split): the group's query heads over one piece of the context.

    The sequence cuts its own context into pieces of whole tiles, at least ``min_split_len``
    tokens (a multiple of ``BLOCK_N``) each, and at most as many as the grid has splits; the
    splits past its last piece are empty."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N,
                           min_split_len)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(start, end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        valid = positions < end
        k = _load_kv_tile(k_cache_ptr, block_table, positions, valid, kv_head, block_size,
                          stride_kcb, stride_kcs, stride_kch, offs_d, mask_d)
        v = _load_kv_tile(v_cache_ptr, block_table, positions, valid, kv_head, block_size,
                          stride_vcb, stride_vcs, stride_vch, offs_d, mask_d)
        m_i, l_i, acc = _online_softmax_step(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale,
                                             DOT_FP32)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty piece has l = 0
    out = acc / l_safe[:, None]
    out_rows = out_ptr + seq * stride_ob + heads * stride_oh + split * stride_os
    tl.store(out_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_h[:, None] & mask_d[None, :])
    if STORE_LSE:  # log2-sum-exp2 of this piece's scores; -inf for an empty piece
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit(do_not_specialize=["num_splits", "stride_lb", "stride_lh"])
def _merge_splits_kernel(partial_ptr, lse_ptr, out_ptr, num_splits,
                         stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                         HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (sequence, query head): weigh each piece's output by its share of the softmax sum."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + offs_s, mask=mask_s,
                  other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weights = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))  # 0 if all empty
    partial = tl.load(partial_ptr + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps
                      + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    total = tl.sum(weights, 0)
    out = tl.sum(weights[:, None] * partial, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=mask_d)


def decode_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int,
                      min_split_tokens: int = MIN_SPLIT_TOKENS) -> int:
    """Pieces per context so that the decode grid fills ``num_sms`` SMs about twice, no more than
    a ``max_context`` needs: fewer splits would change the pieces, more would all be empty."""
    wanted = triton.cdiv(2 * num_sms, batch * num_kv_heads)
    return max(1, min(wanted, triton.cdiv(max_context, min_split_tokens), MAX_SPLITS))


def decode_launch(dtype: torch.dtype) -> tuple[int, int]:
    """``(num_warps, num_stages)`` of decode for a cache ``dtype``: every target from sm_80 to
    sm_90 fits them without spilling registers, under Triton 3.6 and 3.7.

    4 warps. fp16/bf16 double-buffer their loads: Triton's default 3 stages leave ptxas a few
    registers short on sm_90 at head_dim 128 under 3.6 (128 used, 8 bytes spilled), 2 use ~110.
    fp32 keeps 3 (with 2 it spills on sm_86 to sm_90; 8 warps spill on sm_86/89 under 3.7).
    """
    return (4, 3) if dtype == torch.float32 else (4, 2)


def _multiprocessor_count(device: torch.device) -> int:
    """SMs of a CUDA device; 0 elsewhere (one piece per context)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None,
                           min_split_tokens: int = MIN_SPLIT_TOKENS) -> torch.Tensor:
    """``q`` ``[B, n_h, d]``, one token per sequence, attends to its ``seq_lens[i]`` cached tokens.

    ``num_splits`` (default: :func:`decode_num_splits`, at most ``MAX_SPLITS``) caps the pieces
    of each context, which are at least ``min_split_tokens`` long (a multiple of
    ``DECODE_BLOCK_N``). The pieces follow ``seq_lens``, not the table's width: a decode graph,
    captured with the widest table, cuts each context as the eager step does.
    """
    _check_caches(k_cache, v_cache)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = _check_queries(q, num_kv_heads, head_dim)
    batch, num_heads, _ = q.shape
    _check_index("block_tables", block_tables, (batch, block_tables.shape[-1]))
    _check_index("seq_lens", seq_lens, (batch,))
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    if min_split_tokens < DECODE_BLOCK_N or min_split_tokens % DECODE_BLOCK_N:
        raise ValueError(f"min_split_tokens must be a positive multiple of {DECODE_BLOCK_N}, "
                         f"got {min_split_tokens}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    max_context = block_tables.shape[1] * block_size
    if batch == 0 or max_context == 0:
        return out.zero_()
    num_splits = min(num_splits or decode_num_splits(batch, num_kv_heads, max_context,
                                                     _multiprocessor_count(q.device), min_split_tokens),
                     MAX_SPLITS)
    num_warps, num_stages = decode_launch(k_cache.dtype)
    meta = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_H=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
                BLOCK_D=max(MIN_DOT_ROWS, triton.next_power_of_2(head_dim)), BLOCK_N=DECODE_BLOCK_N,
                DOT_FP32=_dot_in_fp32(k_cache), num_warps=num_warps, num_stages=num_stages)
    args = (q, k_cache, v_cache, block_tables, seq_lens)
    common = (scale * LOG2E, block_size, min_split_tokens, q.stride(0), q.stride(1),
              *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0))
    grid = (batch, num_kv_heads, num_splits)
    if num_splits == 1:
        _paged_decode_kernel[grid](*args, out, out, *common, out.stride(0), out.stride(1), 0, 0, 0,
                                   STORE_LSE=False, **meta)
        return out
    partial = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    _paged_decode_kernel[grid](*args, partial, lse, *common, *partial.stride()[:3], *lse.stride()[:2],
                               STORE_LSE=True, **meta)
    _merge_splits_kernel[(batch, num_heads)](
        partial, lse, out, num_splits, *partial.stride()[:3], *lse.stride()[:2],
        out.stride(0), out.stride(1), HEAD_DIM=head_dim,
        BLOCK_S=MAX_SPLITS, BLOCK_D=triton.next_power_of_2(head_dim))
    return out


# -- prefill / extend ----------------------------------------------------------------------------
@triton.jit
def _find_sequence(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence that owns query tile ``tile``: sequence i owns tiles ``cu[i] // BLOCK_Q + i`` on."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:  # the largest i whose first tile is <= tile
        mid = (lo + hi + 1) // 2
        owns_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(owns_tile, mid, lo)
        hi = tl.where(owns_tile, hi, mid - 1)
    return lo


@triton.jit(do_not_specialize=["block_tables_ptr", "num_seqs", "stride_bt"])
def _paged_prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr,
                          seq_lens_ptr, out_ptr, qk_scale, block_size, num_seqs,
                          stride_qt, stride_qh,
                          stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                          stride_bt, stride_ot, stride_oh,
                          GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                          BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                          DOT_FP32: tl.constexpr):
    """Program (query tile, KV head): rows are (query token, head of the group) pairs."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q)
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    q_start = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if q_start >= q_len:  # a spare tile of the grid
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len  # cached tokens before the new ones

    rows = tl.arange(0, BLOCK_Q * BLOCK_G)
    q_index = q_start + rows // BLOCK_G
    head_in_group = rows % BLOCK_G
    row_valid = (q_index < q_len) & (head_in_group < GROUP)
    heads = kv_head * GROUP + head_in_group
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    tokens = (q_begin + q_index).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & mask_d[None, :], other=0.0)
    row_position = prefix_len + q_index

    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_end = tl.minimum(seq_len, prefix_len + q_start + BLOCK_Q)  # past the tile's last query
    for tile_start in range(0, kv_end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        valid = positions < kv_end
        k = _load_kv_tile(k_cache_ptr, block_table, positions, valid, kv_head, block_size,
                          stride_kcb, stride_kcs, stride_kch, offs_d, mask_d)
        v = _load_kv_tile(v_cache_ptr, block_table, positions, valid, kv_head, block_size,
                          stride_vcb, stride_vcs, stride_vch, offs_d, mask_d)
        causal = valid[None, :] & (positions[None, :] <= row_position[:, None])
        m_i, l_i, acc = _online_softmax_step(q, k, v, causal, m_i, l_i, acc, qk_scale, DOT_FP32)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l = 0 only in padding rows
    tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & mask_d[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` ``[T, n_h, d]``: query j of sequence i (position ``seq_lens[i] - q_len_i + j``)
    attends to cache positions ``0..p``; the new tokens' K/V are already in the cache."""
    _check_caches(k_cache, v_cache)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = _check_queries(q, num_kv_heads, head_dim)
    num_tokens = q.shape[0]
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    _check_index("seq_lens", seq_lens, (num_seqs,))
    _check_index("block_tables", block_tables, (num_seqs, block_tables.shape[-1]))
    _check_index("cu_seqlens_q", cu_seqlens_q, (num_seqs + 1,))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_g = triton.next_power_of_2(group)
    block_d = max(MIN_DOT_ROWS, triton.next_power_of_2(head_dim))
    block_m, block_n, num_warps, num_stages = prefill_tiles(k_cache.dtype, block_d)
    block_q = max(1, block_m // block_g)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, scale * LOG2E, block_size,
        num_seqs, q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_G=block_g, BLOCK_Q=block_q, BLOCK_D=block_d,
        BLOCK_N=block_n, DOT_FP32=_dot_in_fp32(k_cache), num_warps=num_warps, num_stages=num_stages)
    return out


def prefill_tiles(dtype: torch.dtype, block_d: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of prefill for a cache ``dtype``: every
    target from sm_80 to sm_90 fits them without spilling registers.

    fp16/bf16 dot on the tensor cores, 64 rows by 64 keys over 4 warps; past head_dim 64, by 32
    keys (64 keys spill on sm_80 and sm_89 at head_dim 128, and so do 8 warps, which ptxas squeezes
    into 128 registers on some targets). fp32 dots run on the CUDA cores (``ieee``) with both
    operands staged in shared memory: 64 x 64 tiles would need 115,200 B, over the 101,376 B of
    sm_86 and sm_89, and spill, so 32 x 32 over 8 warps.
    """
    if dtype == torch.float32:
        return 32, 32, 8, 2
    return (64, 64, 4, 3) if block_d <= 64 else (64, 32, 4, 2)


# -- warmup --------------------------------------------------------------------------------------
def warmup(config, dtype: torch.dtype, device: torch.device | str, block_size: int,
           kv_dtype: torch.dtype | None = None) -> None:
    """Launch each kernel once per binary a run of ``config`` needs, so that no step compiles.

    The launches use the engine's argument kinds (int32 block tables, lengths and offsets, int64
    slots, ``dtype`` queries, ``kv_dtype`` caches, default ``dtype``); their sizes do not matter,
    as nothing step-varying is specialized. Decode runs once whole and once split in two, which
    also compiles the merge.
    """
    n_heads, n_kv, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    context = 2 * DECODE_BLOCK_N  # long enough for two pieces
    num_blocks = triton.cdiv(context, block_size)
    k_cache, v_cache = (torch.zeros(num_blocks, block_size, n_kv, head_dim, dtype=kv_dtype or dtype,
                                    device=device) for _ in range(2))
    table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]
    seq_lens = torch.tensor([context], dtype=torch.int32, device=device)
    kv = torch.zeros(2, n_kv, head_dim, dtype=dtype, device=device)
    store_kv(kv, kv, k_cache, v_cache, torch.arange(2, device=device))
    q = torch.zeros(2, n_heads, head_dim, dtype=dtype, device=device)
    for num_splits in (1, 2):
        paged_decode_attention(q[:1], k_cache, v_cache, table, seq_lens, 1.0, num_splits=num_splits)
    cu_seqlens_q = torch.tensor([0, 2], dtype=torch.int32, device=device)
    paged_prefill_attention(q, k_cache, v_cache, table, cu_seqlens_q, seq_lens, 1.0)


# -- argument checks -----------------------------------------------------------------------------
def _dot_in_fp32(k_cache: torch.Tensor) -> bool:
    return INTERPRET or k_cache.dtype == torch.float32


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must have shape [num_blocks, block_size, n_kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache must match k_cache: {tuple(v_cache.shape)} {v_cache.dtype} vs "
                         f"{tuple(k_cache.shape)} {k_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous in head_dim")


def _check_queries(q: torch.Tensor, num_kv_heads: int, head_dim: int) -> int:
    """Validate ``q`` ``[N, n_h, d]`` against the cache; return the GQA group size."""
    if q.dim() != 3 or q.shape[2] != head_dim or q.stride(-1) != 1:
        raise ValueError(f"q must have shape [N, n_heads, {head_dim}], contiguous in the last "
                         f"dimension, got {tuple(q.shape)}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the cache's {num_kv_heads} KV heads")
    return q.shape[1] // num_kv_heads


def _check_index(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tensor.dtype not in INDEX_DTYPES or tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must be an int32 or int64 tensor of shape {list(shape)}, "
                         f"got {tensor.dtype} {list(tensor.shape)}")
