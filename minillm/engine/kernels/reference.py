"""Plain-PyTorch attention over a paged KV cache (chapters 解码 and 分页的 KV cache).

The correctness reference for the Triton kernels and the path the CPU runs. A layer's cache is
``k_cache, v_cache`` of shape ``[num_blocks, block_size, n_kv, d]``; token position ``p`` of
sequence ``i`` lives in block ``block_tables[i, p // block_size]`` at offset ``p % block_size``.
Attention gathers each sequence's context out of its blocks and runs
``scaled_dot_product_attention`` in at least float32 (GQA: query head h reads KV head h // group).
Unlike the Triton kernels, which never load a slot past a sequence's end, it may read (and mask)
slots it does not use, so the caches must hold finite values.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write the new tokens' K and V ``[T, n_kv, d]`` into flat cache slots (cast to the cache's
    dtype; an fp8 cache saturates at ±448); slot -1 is skipped."""
    if len(slot_mapping) and int(slot_mapping.min()) < 0:  # rows to skip (a decode graph's padding)
        kept = (slot_mapping >= 0).nonzero().squeeze(1)
        slot_mapping, k, v = (t.index_select(0, kept) for t in (slot_mapping, k, v))
    for new, cache in ((k, k_cache), (v, v_cache)):
        values = new.to(cache.dtype)
        if cache.element_size() == 1:  # fp8: copy the bytes (index_copy_ has no fp8 kernel)
            cache, values = cache.view(torch.uint8), values.view(torch.uint8)
        cache.flatten(0, 1).index_copy_(0, slot_mapping, values)


def _gather_context(cache, block_tables, length: int):
    """Positions 0..length-1 of every sequence, copied out of its blocks: ``[B, length, n_kv, d]``."""
    num_blocks = -(-length // cache.shape[1])
    # the first num_blocks blocks of each sequence, each block one row of the cache seen as 2-D
    blocks = cache.flatten(1).index_select(0, block_tables[:, :num_blocks].flatten())
    return blocks.view(block_tables.shape[0], -1, *cache.shape[2:])[:, :length]


def attend(q, k, v, scale, mask=None, is_causal=False):
    """Softmax attention of q ``[B, n_h, Lq, d]`` over k, v ``[B, n_kv, Lk, d]`` in >= float32."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    out = F.scaled_dot_product_attention(*(t if t.dtype == dtype else t.to(dtype) for t in (q, k, v)),
                                         attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len=None):
    """One query token per sequence ``q [B, n_h, d]`` attends to its whole context -> ``[B, n_h, d]``;
    ``max_seq_len``: ``seq_lens``' largest, when the caller knows it (else it is read here).

    The contexts are gathered into one batch padded to the longest; the padding is masked out.
    What it reads there must be finite (0 * NaN is NaN), as everywhere in the engine's caches, which
    start zeroed: zeroing the padding instead would cost another pass over all of K and V.
    """
    length = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    k = _gather_context(k_cache, block_tables, length)
    v = _gather_context(v_cache, block_tables, length)
    mask = None
    if len(seq_lens) > 1:  # one sequence attends to all `length` positions: nothing to mask
        past_end = torch.arange(length, device=q.device) >= seq_lens[:, None]
        mask = ~past_end[:, None, None, :] if past_end.any() else None
    out = attend(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2), scale, mask=mask)
    return out[:, :, 0, :]


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale):
    """New tokens ``q [T, n_h, d]`` attend causally to themselves and fully to their cached prefix.

    Query j of sequence i sits at position ``seq_lens[i] - q_len_i + j`` and sees cache positions
    0 through that position. The sequences that add one token (the decodes of a mixed step) go
    through one batched decode call; the others get one attention call each, so nothing is padded.
    """
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    q_lens = [end - start for start, end in zip(starts, starts[1:])]
    single = [i for i, q_len in enumerate(q_lens) if q_len == 1]
    if single:
        rows = torch.tensor(single, device=q.device)
        tokens = torch.tensor([starts[i] for i in single], device=q.device)
        out[tokens] = paged_decode_attention(q[tokens], k_cache, v_cache, block_tables[rows],
                                             seq_lens[rows], scale)
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 1:
            continue
        k = _gather_context(k_cache, block_tables[i:i + 1], seq_len).transpose(1, 2)
        v = _gather_context(v_cache, block_tables[i:i + 1], seq_len).transpose(1, 2)
        q_i = q[start:end].transpose(0, 1)[None]
        if q_len == seq_len:  # no cached prefix: plain causal attention
            o = attend(q_i, k, v, scale, is_causal=True)
        else:  # the causal diagonal shifts right by the prefix length
            visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - q_len)
            o = attend(q_i, k, v, scale, mask=visible)
        out[start:end] = o[0].transpose(0, 1)
    return out
