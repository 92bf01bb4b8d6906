"""Plain-PyTorch attention over a paged KV cache (chapters 解码 and 分页的 KV cache).

The correctness reference for the Triton kernels and the path the CPU runs. A layer's cache is
``k_cache, v_cache`` of shape ``[num_blocks, block_size, n_kv, d]``; token position ``p`` of
sequence ``i`` lives in block ``block_tables[i, p // block_size]`` at offset ``p % block_size``.
Attention gathers each sequence's context out of its blocks and runs
``scaled_dot_product_attention`` in at least float32 (GQA: query head h reads KV head h // group).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write the new tokens' K and V ``[T, n_kv, d]`` into flat cache slots; slot -1 is skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.flatten(0, 1).index_copy_(0, slots, k[keep])
    v_cache.flatten(0, 1).index_copy_(0, slots, v[keep])


def _context_slots(block_tables, seq_lens, block_size: int, length: int):
    """Flat cache slots of positions 0..length-1 of every sequence ``[B, length]``, and which of
    them hold context (position < seq_len)."""
    positions = torch.arange(length, device=block_tables.device)
    block_columns = (positions // block_size).clamp(max=block_tables.shape[1] - 1)
    slots = block_tables[:, block_columns].long() * block_size + positions % block_size
    return slots, positions < seq_lens[:, None]


def _attend(q, k, v, scale, mask=None, is_causal=False):
    """Softmax attention of q ``[B, n_h, Lq, d]`` over k, v ``[B, n_kv, Lk, d]`` in >= float32."""
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    out = F.scaled_dot_product_attention(q.to(compute_dtype), k.to(compute_dtype),
                                         v.to(compute_dtype), attn_mask=mask,
                                         is_causal=is_causal, scale=scale, enable_gqa=True)
    return out.to(q.dtype)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """One query token per sequence ``q [B, n_h, d]`` attends to its whole context -> ``[B, n_h, d]``.

    The contexts are gathered into one padded ``[B, max_len, n_kv, d]`` batch; padding is zeroed
    (unwritten cache memory may hold NaN) and masked out.
    """
    slots, valid = _context_slots(block_tables, seq_lens, k_cache.shape[1], int(seq_lens.max()))
    padding = ~valid[:, :, None, None]
    k = k_cache.flatten(0, 1)[slots].masked_fill_(padding, 0)
    v = v_cache.flatten(0, 1)[slots].masked_fill_(padding, 0)
    out = _attend(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2), scale,
                  mask=valid[:, None, None, :])
    return out[:, :, 0, :]


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale):
    """New tokens ``q [T, n_h, d]`` attend causally to themselves and fully to their cached prefix.

    Query j of sequence i sits at position ``seq_lens[i] - q_len_i + j`` and sees cache positions
    0 through that position. One attention call per sequence, so no query is padded.
    """
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        slots, _ = _context_slots(block_tables[i:i + 1], seq_lens[i:i + 1], k_cache.shape[1], seq_len)
        k = k_cache.flatten(0, 1)[slots].transpose(1, 2)
        v = v_cache.flatten(0, 1)[slots].transpose(1, 2)
        q_i = q[start:end].transpose(0, 1)[None]
        if q_len == seq_len:  # no cached prefix: plain causal attention
            o = _attend(q_i, k, v, scale, is_causal=True)
        else:  # the causal diagonal shifts right by the prefix length
            visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - q_len)
            o = _attend(q_i, k, v, scale, mask=visible)
        out[start:end] = o[0].transpose(0, 1)
    return out
