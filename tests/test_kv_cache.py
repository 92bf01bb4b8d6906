"""The KV caches (chapters KV cache and 分页): sizes are the ledger's, metadata is right, and the
contiguous and paged caches are interchangeable behind one interface."""
import pytest
import torch

from minillm import SamplingParams, generate, load_model
from minillm.engine.attention_metadata import StepBuilder
from minillm.engine.config import load_config
from minillm.engine.contiguous_cache import ContiguousKVCache
from minillm.engine.engine_config import EngineConfig
from minillm.engine.paged_cache import PagedKVCache
from minillm.lab import estimate


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
    cache.append([0, 1], [16, 8])
    cache.append([0], [1])
    assert (cache.num_tokens(0), cache.num_tokens(1)) == (17, 8)
    assert cache.used_bytes == 25 * estimate.kv_bytes_per_token(cfg, torch.float32)
    assert cache.waste == pytest.approx(estimate.preallocation_waste(128, 25))
    cache.free(0)
    assert cache.used_bytes == 8 * cache.bytes_per_token and cache.reserved_bytes == cache.kv.nbytes


def test_step_metadata_points_into_each_requests_row():
    cfg = load_config("tiny")
    cache = ContiguousKVCache(cfg, num_requests=3, max_len=10)
    cache.append([0, 2], [4, 2])
    positions, attn = cache.append([2, 0, 1], [3, 1, 2])
    assert positions.tolist() == [2, 3, 4, 4, 0, 1]
    assert attn.cu_seqlens_q.tolist() == [0, 3, 4, 6]
    assert attn.seq_lens.tolist() == [5, 5, 2]
    assert attn.block_tables.tolist() == [[1], [0], [2]]  # request 2 took the second free block
    assert attn.slot_mapping.tolist() == [12, 13, 14, 4, 20, 21]
    assert attn.max_query_len == 3
    assert (attn.cu_seqlens_q.dtype, attn.seq_lens.dtype, attn.block_tables.dtype,
            attn.slot_mapping.dtype) == (torch.int32, torch.int32, torch.int32, torch.int64)


def test_layer_caches_are_views_of_the_one_tensor():
    cfg = load_config("tiny")
    cache = ContiguousKVCache(cfg, num_requests=2, max_len=8)
    layers = cache.layer_caches
    assert len(layers) == cfg.num_layers
    k, v = layers[1]
    assert k.shape == (2, 8, cfg.num_kv_heads, cfg.head_dim)
    k[1, 3].fill_(7.0)
    v[0, 0].fill_(5.0)
    assert torch.all(cache.kv[1, 0, 1, 3] == 7.0) and torch.all(cache.kv[1, 1, 0, 0] == 5.0)


@pytest.mark.parametrize("requests, new, match", [
    ([0], [9], "no room"), ([0, 0], [1, 1], "distinct"), ([0], [1, 1], "as many as"),
    ([0], [0], "num_new must be"), ([], [], "non-empty"),
])
def test_bad_steps_are_refused_without_side_effects(requests, new, match):
    cache = ContiguousKVCache(load_config("tiny"), num_requests=2, max_len=8)
    with pytest.raises(ValueError, match=match):
        cache.append(requests, new)
    assert cache.request_ids == [] and cache.used_bytes == 0


def test_a_full_cache_says_so():
    cache = ContiguousKVCache(load_config("tiny"), num_requests=1, max_len=8)
    cache.append(["a"], [8])
    assert not cache.allocate("b", 1) and not cache.allocate("a", 9)
    cache.free("a")
    assert cache.allocate("b", 1) and cache.block_tables(["b"]).tolist() == [[0]]


def test_prepare_step_needs_room_first():
    cache = PagedKVCache(load_config("tiny"), num_blocks=4, block_size=4)
    cache.allocate("a", 6)
    with pytest.raises(ValueError, match="holds room for 6"):
        cache.prepare_step([("a", 4, 3)])


def test_the_engines_pool_is_built_from_its_settings_and_ranks_above_0_keep_no_books():
    cfg = load_config("tiny")
    settings = EngineConfig(block_size=4, num_kv_blocks=6, prefix_index="radix",
                            preemption_mode="swap").resolved(cfg.max_position_embeddings, 4 * 1024)
    cache = PagedKVCache.from_config(cfg, settings, torch.float32, "cpu")
    assert cache.kv.shape[2:4] == (6, 4) and cache.manager.table_width == 6
    assert cache.swap_kv.shape[0] == settings.num_cpu_blocks == 6
    assert type(cache.manager.index).__name__ == "RadixPrefixIndex"
    tensors_only = PagedKVCache.from_config(cfg, settings, torch.float32, "cpu", bookkeeping=False)
    assert not hasattr(tensors_only, "manager") and tensors_only.kv.shape == cache.kv.shape
    tensors_only.kv[:, :, 2] = 1.0
    tensors_only.swap([(2, 0)], [(0, 5)])  # what a rank > 0 does with the pairs rank 0 sends
    assert bool((tensors_only.kv[:, :, 5] == 1.0).all())


def test_metadata_is_built_on_the_device_from_tables_and_counts():
    tables = torch.tensor([[3, 1, 0], [2, 0, 0]], dtype=torch.int32)
    builder = StepBuilder("cpu")
    input_ids, positions, attn = builder.build(tables, [5, 0], [2, 3], block_size=4, token_ids=[7, 8, 9, 10, 11])
    assert input_ids.tolist() == [7, 8, 9, 10, 11] and input_ids.dtype == torch.int64
    assert positions.tolist() == [5, 6, 0, 1, 2]
    assert attn.slot_mapping.tolist() == [1 * 4 + 1, 1 * 4 + 2, 8, 9, 10]
    assert attn.seq_lens.tolist() == [7, 3] and attn.cu_seqlens_q.tolist() == [0, 2, 5]
    assert attn.max_query_len == 3
    with pytest.raises(ValueError, match="one row"):
        builder.build(tables, [0], [1, 1], block_size=4)


def test_paged_tables_are_the_managers_rows():
    cache = PagedKVCache(load_config("tiny"), num_blocks=8, block_size=2, enable_prefix_caching=True,
                         max_model_len=8)
    cache.allocate("a", 3)
    cache.allocate("b", 2)
    assert cache.block_tables(["a", "b"]).tolist() == [[0, 1], [2, 0]]
    cache.allocate("a", 5)  # one more block for a
    assert cache.block_tables(["b", "a"]).tolist() == [[2, 0, 0], [0, 1, 3]]
    with pytest.raises(ValueError, match="more than the 4 blocks a block table holds"):
        cache.allocate("a", 9)  # past max_model_len: refused, nothing taken
    assert cache.manager.block_table("a") == [0, 1, 3] and cache.manager.num_free_blocks == 4
    cache.free("a")
    cache.allocate("a", 2)  # freed and holding blocks afresh: its row is rewritten from scratch
    assert cache.block_tables(["a"]).tolist() == [[cache.manager.block_table("a")[0]]]
    rows = len(cache.manager.tables)
    for i in range(3 * rows):  # many more requests than table rows: the rows of freed ones are reused
        assert cache.allocate(f"r{i}", 2)
        assert cache.block_tables([f"r{i}", "a"]).tolist() == [cache.manager.block_table(f"r{i}"),
                                                             cache.manager.block_table("a")]
        cache.free(f"r{i}")
    assert len(cache.manager.tables) == rows


@pytest.mark.parametrize("make_cache", [
    lambda model: None,
    lambda model: PagedKVCache(model.config, num_blocks=12, block_size=4, dtype=model.dtype),
    lambda model: PagedKVCache(model.config, num_blocks=12, block_size=4, dtype=model.dtype,
                               enable_prefix_caching=True, prefix_index="radix"),
])
def test_generate_gives_the_same_tokens_whichever_cache(make_cache):
    model = load_model("tiny", device="cpu", weights="random")
    prompts = [[5, 6, 7, 8, 9, 10], [1, 2, 3], [4] * 11]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = generate(model, prompts, params, use_cache=False)
    assert generate(model, prompts, params, kv_cache=make_cache(model)) == expected


@pytest.mark.parametrize("kwargs", [dict(num_requests=0, max_len=4), dict(num_requests=1, max_len=0)])
def test_bad_sizes(kwargs):
    with pytest.raises(ValueError, match="num_requests|max_len"):
        ContiguousKVCache(load_config("tiny"), **kwargs)
