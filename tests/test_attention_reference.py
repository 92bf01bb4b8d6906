"""The plain-torch paged attention (chapters 解码, 分页的 KV cache) against a naive dense loop."""
import pytest
import torch

from minillm.engine.kernels import reference

N_HEADS, N_KV, D, BLOCK = 6, 2, 8, 4


def _naive(q_rows, k_seq, v_seq, positions, scale):
    """q_rows [n, n_h, d] at ``positions`` attend to k/v_seq [L, n_kv, d] up to their position."""
    group = N_HEADS // N_KV
    k = k_seq.double().repeat_interleave(group, dim=1)
    v = v_seq.double().repeat_interleave(group, dim=1)
    out = []
    for q, p in zip(q_rows.double(), positions):
        scores = torch.einsum("hd,lhd->hl", q, k[:p + 1]) * scale
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v[:p + 1]))
    return torch.stack(out)


def _paged_setup(seq_lens, generator):
    """A shuffled block pool holding random K/V for each sequence; returns contexts and tables."""
    blocks_per_seq = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    # unwritten slots hold garbage (finite, as in the engine's caches): it must be masked out
    k_cache = 1e4 * torch.randn(num_blocks, BLOCK, N_KV, D, generator=generator)
    v_cache = 1e4 * torch.randn(num_blocks, BLOCK, N_KV, D, generator=generator)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    contexts = []
    for i, n in enumerate(seq_lens):
        ids = [order.pop() for _ in range(blocks_per_seq[i])]
        tables[i, :len(ids)] = torch.tensor(ids)
        k = torch.randn(n, N_KV, D, generator=generator)
        v = torch.randn(n, N_KV, D, generator=generator)
        slots = torch.tensor([ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        reference.store_kv(k, v, k_cache, v_cache, slots)
        contexts.append((k, v))
    return k_cache, v_cache, tables, contexts


def test_store_kv_writes_slots_and_skips_minus_one():
    generator = torch.Generator().manual_seed(2)
    k_cache = torch.zeros(3, BLOCK, N_KV, D)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(2, 3, N_KV, D, generator=generator)
    reference.store_kv(k, v, k_cache, v_cache, torch.tensor([9, -1, 0]))
    assert torch.equal(k_cache[2, 1], k[0]) and torch.equal(v_cache[0, 0], v[2])
    written = torch.zeros(3 * BLOCK, dtype=torch.bool)
    written[[9, 0]] = True
    assert torch.all(k_cache.flatten(0, 1)[~written] == 0) and torch.all(v_cache.flatten(0, 1)[~written] == 0)
    half_cache = torch.zeros(3, BLOCK, N_KV, D, dtype=torch.bfloat16)
    reference.store_kv(k, v, half_cache, half_cache.clone(), torch.tensor([9, -1, 0]))
    assert torch.equal(half_cache[2, 1], k[0].to(torch.bfloat16))


def test_decode_over_shuffled_blocks_matches_naive():
    generator = torch.Generator().manual_seed(0)
    seq_lens = [1, 7, 12, 5]
    k_cache, v_cache, tables, contexts = _paged_setup(seq_lens, generator)
    q = torch.randn(len(seq_lens), N_HEADS, D, generator=generator)
    out = reference.paged_decode_attention(q, k_cache, v_cache, tables,
                                           torch.tensor(seq_lens, dtype=torch.int32), 0.3)
    assert out.shape == q.shape and out.dtype == q.dtype
    for i, (k, v) in enumerate(contexts):
        expected = _naive(q[i:i + 1], k, v, [seq_lens[i] - 1], 0.3)
        torch.testing.assert_close(out[i:i + 1].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_with_cached_prefix_matches_naive(dtype):
    generator = torch.Generator().manual_seed(1)
    seq_lens, q_lens = [9, 4, 13], [9, 1, 5]  # no prefix, decode-like, 8-token prefix
    k_cache, v_cache, tables, contexts = _paged_setup(seq_lens, generator)
    q = torch.randn(sum(q_lens), N_HEADS, D, generator=generator)
    cu = torch.tensor([0, 9, 10, 15], dtype=torch.int32)
    out = reference.paged_prefill_attention(q.to(dtype), k_cache.to(dtype), v_cache.to(dtype),
                                            tables, cu, torch.tensor(seq_lens, dtype=torch.int32), 0.3)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for i, (k, v) in enumerate(contexts):
        positions = range(seq_lens[i] - q_lens[i], seq_lens[i])
        expected = _naive(q[cu[i]:cu[i + 1]].to(dtype), k.to(dtype), v.to(dtype), positions, 0.3)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]].double(), expected, atol=tol, rtol=tol)
