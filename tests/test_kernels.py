"""The Triton kernels against the torch reference: compiled on a GPU, else run on the CPU by
Triton's interpreter (``conftest.py`` sets TRITON_INTERPRET=1 when there is no GPU)."""
import pytest
import torch

from minillm.engine.kernels import reference, triton_attention

if not triton_attention.INTERPRET and not torch.cuda.is_available():
    pytest.skip("no GPU, and Triton was imported without TRITON_INTERPRET=1",
                allow_module_level=True)
DEVICE = "cpu" if triton_attention.INTERPRET else "cuda"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
SHORT_PIECES = dict(min_split_tokens=triton_attention.DECODE_BLOCK_N)  # split short test contexts


def finite(cache):
    """The reference reads (and masks) unused slots, so it needs them finite; the kernels never read them."""
    return cache.nan_to_num(0.0)


def paged_context(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=0):
    """Caches full of NaN except the sequences' tokens, stored in shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-length // block_size) for length in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # two blocks nobody uses
    shuffled = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    taken = 0
    for i, count in enumerate(blocks_per_seq):
        block_tables[i, :count] = shuffled[taken:taken + count]
        taken += count
    slots = torch.cat([block_tables[i, torch.arange(n) // block_size].long() * block_size
                       + torch.arange(n) % block_size for i, n in enumerate(seq_lens)])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    k = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)
    reference.store_kv(k, v, k_cache, v_cache, slots)
    to = dict(device=DEVICE)
    return (k_cache.to(**to), v_cache.to(**to), block_tables.to(**to),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE))


# block_size, head_dim, num_kv_heads, group (GQA ratio), cache dtype, seq_lens, num_splits
DECODE_CASES = [
    (1, 64, 2, 1, torch.float32, [1, 5, 17], None),
    (16, 128, 1, 4, torch.bfloat16, [16, 32, 7], None),
    (64, 80, 2, 8, torch.float16, [1, 64, 130], None),
    (16, 64, 2, 4, torch.float32, [200, 33, 1], 3),
    (8, 80, 1, 8, torch.bfloat16, [150, 64], 4),
    (32, 128, 2, 1, torch.float16, [96, 1], 2),
]


@pytest.mark.parametrize("block_size, head_dim, num_kv_heads, group, dtype, seq_lens, num_splits",
                         DECODE_CASES)
def test_decode_matches_reference(block_size, head_dim, num_kv_heads, group, dtype, seq_lens,
                                  num_splits):
    k_cache, v_cache, block_tables, lens = paged_context(seq_lens, block_size, num_kv_heads,
                                                        head_dim, dtype)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim).to(dtype).to(DEVICE)
    scale = head_dim ** -0.5
    out = triton_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale,
                                                  num_splits=num_splits, **SHORT_PIECES)
    expected = reference.paged_decode_attention(q, finite(k_cache), finite(v_cache), block_tables, lens, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_decode_splits_agree_with_one_pass():
    k_cache, v_cache, block_tables, lens = paged_context([300, 2], 16, 2, 64, torch.float32)
    q = torch.randn(2, 8, 64, device=DEVICE)
    one = triton_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125,
                                                  num_splits=1)
    # 5 pieces of 64 tokens: the short sequence leaves four of them empty
    split = triton_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125,
                                                    num_splits=5, **SHORT_PIECES)
    torch.testing.assert_close(split, one, atol=1e-5, rtol=1e-5)
    assert not split.isnan().any()


def test_decode_splits_into_at_most_max_splits():
    """The merge reads MAX_SPLITS pieces; asking for more must not lose any."""
    k_cache, v_cache, block_tables, lens = paged_context([4200], 64, 1, 64, torch.float32)
    q = torch.randn(1, 2, 64, device=DEVICE)
    out = triton_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125,
                                                  num_splits=2 * triton_attention.MAX_SPLITS,
                                                  **SHORT_PIECES)
    expected = reference.paged_decode_attention(q, finite(k_cache), finite(v_cache), block_tables, lens, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_decode_pieces_follow_the_context_not_the_table_width(monkeypatch):
    """A decode graph passes its full-width table: each context must be cut as in the eager step
    (4 pieces of 256 for ~1k tokens), not into pieces of the table's width over the split count."""
    monkeypatch.setattr(triton_attention, "_multiprocessor_count", lambda device: 32)
    seq_lens = [1000, 990, 700, 300, 1, 64, 257, 1024]
    k_cache, v_cache, tight, lens = paged_context(seq_lens, 16, 2, 64, torch.float32, seed=3)
    wide = torch.zeros(len(seq_lens), 512, dtype=torch.int32, device=DEVICE)  # 8,192 tokens
    wide[:, :tight.shape[1]] = tight
    assert triton_attention.decode_num_splits(8, 2, 64 * 16, 32) == 4  # eager: 4 pieces of 256
    q = torch.randn(len(seq_lens), 8, 64, device=DEVICE)
    eager = triton_attention.paged_decode_attention(q, k_cache, v_cache, tight, lens, 0.125)
    graph = triton_attention.paged_decode_attention(q, k_cache, v_cache, wide, lens, 0.125)
    assert torch.equal(graph, eager)
    expected = reference.paged_decode_attention(q, finite(k_cache), finite(v_cache), tight, lens, 0.125)
    torch.testing.assert_close(eager, expected, atol=1e-5, rtol=1e-5)
    one_piece = triton_attention.paged_decode_attention(q, k_cache, v_cache, tight, lens, 0.125,
                                                        num_splits=1)
    assert not torch.equal(one_piece, eager)  # the pieces change the rounding: equality means something


# block_size, head_dim, num_kv_heads, group, cache dtype, new tokens per seq, cached prefix per seq
PREFILL_CASES = [
    (1, 64, 2, 1, torch.float32, [5, 1], [0, 3]),
    (16, 128, 1, 4, torch.bfloat16, [16, 20], [16, 0]),
    (64, 80, 2, 8, torch.float16, [9, 70], [55, 0]),
    (8, 64, 1, 8, torch.float32, [1, 1, 3], [0, 9, 40]),
    (32, 80, 2, 4, torch.bfloat16, [33], [31]),
]


@pytest.mark.parametrize("block_size, head_dim, num_kv_heads, group, dtype, q_lens, prefix_lens",
                         PREFILL_CASES)
def test_prefill_matches_reference(block_size, head_dim, num_kv_heads, group, dtype, q_lens,
                                   prefix_lens):
    seq_lens = [q + p for q, p in zip(q_lens, prefix_lens)]
    k_cache, v_cache, block_tables, lens = paged_context(seq_lens, block_size, num_kv_heads,
                                                        head_dim, dtype, seed=1)
    cu_seqlens_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_seqlens_q = cu_seqlens_q.to(DEVICE)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim).to(dtype).to(DEVICE)
    scale = head_dim ** -0.5
    out = triton_attention.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                                   lens, scale)
    expected = reference.paged_prefill_attention(q, finite(k_cache), finite(v_cache), block_tables, cu_seqlens_q,
                                                  lens, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("seed", range(8))
def test_random_shapes_match_reference(seed):
    """Random block size, head_dim, GQA ratio, dtype and ragged lengths: decode and prefill."""
    gen = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    block_size = pick([1, 2, 4, 8, 16, 32, 64])
    head_dim, group, num_kv_heads = pick([64, 80, 128]), pick([1, 4, 8]), pick([1, 2])
    dtype = pick([torch.float32, torch.float16, torch.bfloat16])
    batch = int(torch.randint(1, 4, (1,), generator=gen))
    seq_lens = [pick([1, block_size, 2 * block_size, int(torch.randint(1, 150, (1,), generator=gen))])
                for _ in range(batch)]
    q_lens = [int(torch.randint(1, n + 1, (1,), generator=gen)) for n in seq_lens]
    k_cache, v_cache, block_tables, lens = paged_context(seq_lens, block_size, num_kv_heads,
                                                        head_dim, dtype, seed=seed)
    num_heads, scale, tol = num_kv_heads * group, head_dim ** -0.5, TOLERANCE[dtype]
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    out = triton_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale,
                                                  num_splits=pick([None, 2, 3]), **SHORT_PIECES)
    expected = reference.paged_decode_attention(q, finite(k_cache), finite(v_cache), block_tables, lens, scale)
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)

    cu_seqlens_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32).to(DEVICE)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    out = triton_attention.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                                   lens, scale)
    expected = reference.paged_prefill_attention(q, finite(k_cache), finite(v_cache), block_tables, cu_seqlens_q,
                                                  lens, scale)
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


def test_prefill_of_one_token_equals_decode():
    k_cache, v_cache, block_tables, lens = paged_context([7, 40], 16, 2, 64, torch.float32)
    q = torch.randn(2, 8, 64, device=DEVICE)
    cu_seqlens_q = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    prefill = triton_attention.paged_prefill_attention(q, k_cache, v_cache, block_tables,
                                                       cu_seqlens_q, lens, 0.125)
    decode = triton_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125)
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size, num_kv_heads, head_dim, dtype",
                         [(1, 1, 64, torch.float32), (16, 2, 80, torch.bfloat16),
                          (64, 8, 128, torch.float16)])
def test_store_kv_matches_reference(block_size, num_kv_heads, head_dim, dtype):
    num_blocks = 8
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:5]
    slots[2] = -1  # skipped
    k = torch.randn(5, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(5, num_kv_heads, head_dim).to(dtype)
    caches = [torch.zeros(shape, dtype=dtype, device=DEVICE) for _ in range(4)]
    triton_attention.store_kv(k.to(DEVICE), v.to(DEVICE), caches[0], caches[1], slots.to(DEVICE))
    reference.store_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0].cpu(), caches[2]) and torch.equal(caches[1].cpu(), caches[3])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert caches[0].flatten(0, 1)[untouched].abs().sum() == 0
    assert caches[0].flatten(0, 1)[slots[[0, 1, 3, 4]]].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_store_kv_casts_to_the_cache_dtype(dtype):
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    k_cache, v_cache = (torch.zeros(2, 4, 2, 64, dtype=dtype, device=DEVICE) for _ in range(2))
    slots = torch.tensor([5, 0, 2])
    triton_attention.store_kv(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    # the interpreter rounds toward zero, the GPU to nearest: equal within one unit of the last place
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(k_cache.flatten(0, 1)[slots].float().cpu(), k, atol=0, rtol=ulp)
    torch.testing.assert_close(v_cache.flatten(0, 1)[slots].float().cpu(), v, atol=0, rtol=ulp)


def test_bad_arguments_name_the_argument():
    k_cache, v_cache, block_tables, lens = paged_context([5], 4, 2, 64, torch.float32)
    q = torch.randn(1, 6, 64)
    with pytest.raises(ValueError, match="not a multiple"):
        triton_attention.paged_decode_attention(torch.randn(1, 3, 64), k_cache, v_cache,
                                                block_tables, lens, 0.1)
    with pytest.raises(ValueError, match="q must have shape"):
        triton_attention.paged_decode_attention(torch.randn(1, 4, 32), k_cache, v_cache,
                                                block_tables, lens, 0.1)
    with pytest.raises(ValueError, match="seq_lens"):
        triton_attention.paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                lens.float(), 0.1)
    with pytest.raises(ValueError, match="v_cache must match"):
        triton_attention.paged_decode_attention(q, k_cache, v_cache.half(), block_tables, lens, 0.1)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        triton_attention.paged_prefill_attention(q, k_cache, v_cache, block_tables,
                                                 torch.tensor([0, 1, 2], dtype=torch.int32), lens, 0.1)
    with pytest.raises(ValueError, match="num_splits"):
        triton_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.1,
                                                num_splits=0)
    with pytest.raises(ValueError, match="slot_mapping"):
        triton_attention.store_kv(torch.randn(2, 2, 64), torch.randn(2, 2, 64), k_cache, v_cache,
                                  torch.tensor([0, 1, 2]))


def test_an_fp8_cache_is_stored_saturated_and_read_back_in_the_queries_dtype():
    """kv_cache_dtype="fp8": store clamps to e4m3's ±448 (no inf, no NaN) and rounds; decode and
    prefill read the e4m3 values back and attend in the queries' dtype, as the reference does."""
    fp8 = torch.float8_e4m3fn
    k = torch.randn(6, 2, 64) * 3
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 448.0, 0.3])
    v = torch.randn(6, 2, 64)
    caches = [torch.zeros(2, 4, 2, 64, dtype=fp8, device=DEVICE) for _ in range(4)]
    slots = torch.arange(6)
    triton_attention.store_kv(k.to(DEVICE), v.to(DEVICE), caches[0], caches[1], slots.to(DEVICE))
    reference.store_kv(k, v, caches[2], caches[3], slots)
    stored = caches[0].flatten(0, 1)[:6].float().cpu()
    assert stored[0, 0, :3].tolist() == [448.0, -448.0, 448.0] and torch.isfinite(stored).all()
    if not triton_attention.INTERPRET:  # the interpreter's e4m3 cast is off by up to a power of 2
        torch.testing.assert_close(stored, caches[2].flatten(0, 1)[:6].float(), rtol=0.07, atol=1e-2)
    k_cache, v_cache = caches[2].to(DEVICE), caches[3].to(DEVICE)
    table = torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([6], dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, 4, 64).to(torch.bfloat16).to(DEVICE)
    out = triton_attention.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125)
    expected = reference.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    q6 = torch.randn(6, 4, 64).to(torch.bfloat16).to(DEVICE)
    cu = torch.tensor([0, 6], dtype=torch.int32, device=DEVICE)
    out = triton_attention.paged_prefill_attention(q6, k_cache, v_cache, table, cu, lens, 0.125)
    expected = reference.paged_prefill_attention(q6, k_cache, v_cache, table, cu, lens, 0.125)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
