"""The contiguous KV cache (chapter KV cache): its size is the ledger's, its metadata is right."""
import pytest
import torch

from minillm import estimate
from minillm.config import load_config
from minillm.kv_cache import ContiguousKVCache


@pytest.mark.parametrize("preset, dtype", [("tiny", torch.float32), ("qwen3-0.6b", torch.bfloat16)])
def test_reserved_bytes_equal_the_ledger(preset, dtype):
    cfg = load_config(preset).replace(num_layers=2)
    cache = ContiguousKVCache(cfg, num_requests=3, max_len=40, dtype=dtype)
    assert cache.kv.shape == (2, 2, 3, 40, cfg.num_kv_heads, cfg.head_dim)
    assert cache.reserved_bytes == cache.kv.nbytes == estimate.kv_bytes(cfg, 3 * 40, dtype)
    assert cache.bytes_per_token == estimate.kv_bytes_per_token(cfg, dtype)
    assert cache.used_bytes == 0 and cache.waste == 1.0


def test_used_bytes_and_waste_follow_the_written_tokens():
    cfg = load_config("tiny")
    cache = ContiguousKVCache(cfg, num_requests=2, max_len=64)
    cache.prepare_step([0, 1], [16, 8])
    cache.prepare_step([0], [1])
    assert cache.lengths == [17, 8]
    assert cache.used_bytes == 25 * estimate.kv_bytes_per_token(cfg, torch.float32)
    assert cache.waste == pytest.approx(estimate.preallocation_waste(128, 25))
    cache.free(0)
    assert cache.used_bytes == 8 * cache.bytes_per_token and cache.reserved_bytes == cache.kv.nbytes


def test_step_metadata_points_into_each_requests_row():
    cfg = load_config("tiny")
    cache = ContiguousKVCache(cfg, num_requests=3, max_len=10)
    cache.prepare_step([0, 2], [4, 2])
    positions, attn = cache.prepare_step([2, 0, 1], [3, 1, 2])
    assert positions.tolist() == [2, 3, 4, 4, 0, 1]
    assert attn.cu_seqlens_q.tolist() == [0, 3, 4, 6]
    assert attn.seq_lens.tolist() == [5, 5, 2]
    assert attn.block_tables.tolist() == [[2], [0], [1]]
    assert attn.slot_mapping.tolist() == [22, 23, 24, 4, 10, 11]
    assert attn.max_query_len == 3
    assert (attn.cu_seqlens_q.dtype, attn.seq_lens.dtype, attn.block_tables.dtype,
            attn.slot_mapping.dtype) == (torch.int32, torch.int32, torch.int32, torch.int64)


def test_layer_caches_are_views_of_the_one_tensor():
    cfg = load_config("tiny")
    cache = ContiguousKVCache(cfg, num_requests=2, max_len=8)
    layers = cache.layer_caches()
    assert len(layers) == cfg.num_layers
    k, v = layers[1]
    assert k.shape == (2, 8, cfg.num_kv_heads, cfg.head_dim)
    k[1, 3].fill_(7.0)
    v[0, 0].fill_(5.0)
    assert torch.all(cache.kv[1, 0, 1, 3] == 7.0) and torch.all(cache.kv[1, 1, 0, 0] == 5.0)


@pytest.mark.parametrize("rows, new, match", [
    ([0], [9], "does not fit max_len=8"), ([2], [1], "row 2"), ([0, 0], [1, 1], "distinct"),
    ([0], [1, 1], "as many as"), ([0], [0], "does not fit"),
])
def test_bad_steps_are_refused_without_side_effects(rows, new, match):
    cache = ContiguousKVCache(load_config("tiny"), num_requests=2, max_len=8)
    with pytest.raises(ValueError, match=match):
        cache.prepare_step(rows, new)
    assert cache.lengths == [0, 0]


@pytest.mark.parametrize("kwargs", [dict(num_requests=0, max_len=4), dict(num_requests=1, max_len=0)])
def test_bad_sizes(kwargs):
    with pytest.raises(ValueError, match="num_requests|max_len"):
        ContiguousKVCache(load_config("tiny"), **kwargs)
