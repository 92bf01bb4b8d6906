"""Block pool, block tables, prefix caching and eviction (chapter 分页的 KV cache)."""
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.engine.paging import (BlockPool, HashPrefixIndex, KVCacheManager, RadixPrefixIndex,
                            full_blocks)

INDEXES = ["hash", "radix"]


# -- the pool --------------------------------------------------------------------------------------
def test_pool_allocates_from_the_head_and_frees_to_the_tail():
    pool = BlockPool(4)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    for block in (1, 0):
        assert pool.decref(block) == 0
        pool.free(block)
    assert pool.num_free == 3
    assert [pool.allocate() for _ in range(3)] == [3, 1, 0]
    assert pool.ref_counts == [1, 1, 1, 1]


def test_pool_rejects_double_free_and_unknown_blocks():
    pool = BlockPool(2)
    block = pool.allocate()
    with pytest.raises(ValueError, match="still held"):
        pool.free(block)
    assert pool.incref(block) == 2
    pool.decref(block)
    pool.decref(block)
    pool.free(block)
    with pytest.raises(ValueError, match="double free"):
        pool.free(block)
    with pytest.raises(ValueError, match="double free"):
        pool.decref(block)
    with pytest.raises(ValueError, match="is free"):
        pool.incref(block)
    with pytest.raises(KeyError, match="unknown block"):
        pool.free(7)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


# -- block tables ----------------------------------------------------------------------------------
def slots(kv, request_id, start, end):
    """Flat cache slots of token positions [start, end): table[p // size] * size + p % size."""
    table, size = kv.block_table(request_id), kv.block_size
    return [table[p // size] * size + p % size for p in range(start, end)]


def test_allocate_grows_the_block_table_and_maps_slots():
    kv = KVCacheManager(8, 4)
    assert kv.allocate("a", 5)
    assert kv.block_table("a") == [0, 1]
    assert slots(kv, "a", 3, 5) == [3, 4]
    assert kv.allocate("b", 1)
    assert kv.allocate("a", 9)
    assert kv.block_table("a") == [0, 1, 3]
    assert slots(kv, "a", 7, 9) == [7, 12]
    assert slots(kv, "a", 4, 4) == []
    assert (kv.num_used_blocks, kv.num_free_blocks) == (4, 4)
    assert kv.utilization() == pytest.approx((9 + 1) / (4 * 4))


def test_running_out_of_blocks_is_an_answer_without_side_effects():
    kv = KVCacheManager(3, 4)
    assert kv.allocate("a", 8)
    assert not kv.allocate("a", 13)
    assert kv.block_table("a") == [0, 1] and kv.num_free_blocks == 1
    assert not kv.allocate("b", 5)
    assert "b" not in kv and kv.num_free_blocks == 1
    assert kv.allocate("b", 4)
    assert kv.num_free_blocks == 0


def test_bad_calls_raise_clear_errors():
    kv = KVCacheManager(4, 4)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0, 4)
    with pytest.raises(ValueError, match="prefix_index"):
        KVCacheManager(4, 4, prefix_index="trie")
    for call in (lambda: kv.free("x"), lambda: kv.block_table("x"),
                 lambda: kv.num_tokens("x"), lambda: kv.commit("x", [1])):
        with pytest.raises(KeyError, match="unknown request 'x'"):
            call()
    assert kv.allocate("a", 6)
    with pytest.raises(ValueError, match="num_tokens"):
        kv.allocate("a", 5)
    with pytest.raises(ValueError, match="a prefix comes with the first allocate"):
        kv.allocate("a", 8, [0])
    with pytest.raises(ValueError, match="holds slots for 6"):
        kv.commit("a", list(range(7)))
    with pytest.raises(ValueError, match="empty"):
        kv.cached_prefix([])
    kv.free("a")
    with pytest.raises(KeyError, match="already freed"):
        kv.free("a")


# -- prefix caching ----------------------------------------------------------------------------------
def run_request(kv, request_id, tokens):
    """Look up, allocate and compute a whole prompt; return the cached token count."""
    prefix = kv.cached_prefix(tokens)
    assert kv.allocate(request_id, len(tokens), prefix)
    kv.commit(request_id, tokens)
    return len(prefix) * kv.block_size


def hold(kv, request_id, tokens):
    """A new request holds the cached blocks its prompt starts with; returns their token count."""
    prefix = kv.cached_prefix(tokens)
    assert kv.allocate(request_id, len(prefix) * kv.block_size, prefix)
    return len(prefix) * kv.block_size


@pytest.mark.parametrize("index", INDEXES)
def test_a_shared_prompt_is_computed_once(index):
    kv = KVCacheManager(16, 4, prefix_index=index)
    prompt = list(range(10))
    assert run_request(kv, "a", prompt) == 0
    assert kv.num_cached_blocks == 2
    assert hold(kv, "b", prompt) == 8
    assert kv.block_table("b") == kv.block_table("a")[:2]
    assert kv.allocate("b", 10)
    assert kv.block_table("b")[2] != kv.block_table("a")[2]
    assert kv.num_used_blocks == 4  # two shared blocks counted once
    assert kv.pool.ref_counts[kv.block_table("a")[0]] == 2
    assert kv.utilization() == pytest.approx((8 + 2 + 2) / (4 * 4))


@pytest.mark.parametrize("index", INDEXES)
def test_a_fully_cached_prompt_still_computes_its_last_token(index):
    kv = KVCacheManager(16, 4, prefix_index=index)
    prompt = list(range(8))
    run_request(kv, "a", prompt)
    assert hold(kv, "b", prompt) == 4
    assert hold(kv, "c", prompt + [99]) == 8


def computed_and_left(index, prompt):
    """A pool of 4 blocks of 4 after request "a" computed ``prompt`` and left: its full blocks stay
    cached, held by nobody."""
    kv = KVCacheManager(4, 4, prefix_index=index)
    run_request(kv, "a", prompt)
    kv.free("a")
    return kv


@pytest.mark.parametrize("index", INDEXES)
def test_freed_blocks_keep_their_key_until_reused(index):
    prompt = list(range(13))
    kv = computed_and_left(index, prompt)
    assert (kv.num_free_blocks, kv.num_cached_blocks, kv.num_used_blocks) == (4, 3, 0)
    assert hold(kv, "b", prompt) == 12
    assert (kv.num_free_blocks, kv.num_used_blocks) == (1, 3)


@pytest.mark.parametrize("index", INDEXES)
def test_a_prefix_that_leaves_too_few_blocks_is_refused_and_nothing_changes(index):
    prompt = list(range(13))
    kv = computed_and_left(index, prompt)
    assert kv.allocate("c", 4)  # the free block: the three cached ones stay evictable
    prefix = kv.cached_prefix(prompt + [99])
    assert len(prefix) == 3 and kv.num_free_blocks == 3  # the prefix alone fits, one more block does not
    assert not kv.allocate("b", 14, prefix)
    assert "b" not in kv and (kv.num_free_blocks, kv.num_cached_blocks) == (3, 3)
    assert kv.allocate("b", 12, prefix) and kv.num_free_blocks == 0


@pytest.mark.parametrize("index", INDEXES)
def test_eviction_takes_free_blocks_first_then_cached_tail_first(index):
    kv = KVCacheManager(4, 4, prefix_index=index)
    prompt = list(range(13))
    run_request(kv, "a", prompt)
    a_blocks = kv.block_table("a")
    kv.free("a")
    assert kv.allocate("c", 4)
    assert kv.block_table("c") == [a_blocks[3]]  # the uncached partial block, no eviction
    assert kv.num_cached_blocks == 3
    assert kv.allocate("d", 4)
    assert kv.block_table("d") == [a_blocks[2]]  # a's tail block goes first
    assert kv.num_cached_blocks == 2
    assert hold(kv, "b", prompt) == 8


@pytest.mark.parametrize("index", INDEXES)
def test_the_least_recently_used_prompt_is_evicted_first(index):
    kv = KVCacheManager(4, 4, prefix_index=index)
    old, new = [1] * 8, [2] * 8
    run_request(kv, "old", old)
    run_request(kv, "new", new)
    kv.free("old")
    kv.free("new")
    assert kv.allocate("c", 8)
    assert hold(kv, "x", old + [0]) == 0
    assert hold(kv, "y", new + [0]) == 8


@pytest.mark.parametrize("index", INDEXES)
def test_blocks_computed_twice_are_deduplicated_on_commit(index):
    kv = KVCacheManager(8, 4, prefix_index=index)
    prompt = list(range(9))
    for name in ("a", "b"):  # both start before either has committed
        assert hold(kv, name, prompt) == 0
        assert kv.allocate(name, len(prompt))
    assert kv.num_used_blocks == 6
    kv.commit("a", prompt)
    b_own = kv.block_table("b")
    kv.commit("b", prompt)
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.block_table("b")[2] == b_own[2]
    assert kv.num_used_blocks == 4 and kv.num_cached_blocks == 2
    assert all(kv.pool.is_free(block) for block in b_own[:2])


def test_a_hash_collision_is_a_miss():
    class CollidingIndex(HashPrefixIndex):
        @staticmethod
        def block_key(parent_key, tokens):
            return 42

    index = CollidingIndex(block_size=2)
    assert index.insert([1, 2, 3, 4], [7, 8]) == [7, 8]  # block 8 collides with block 7
    assert 8 not in index and index.num_cached_blocks == 1
    assert index.match([1, 2, 3, 4]) == [7]
    assert index.match([5, 6]) == []


def test_disabled_prefix_caching_never_shares():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    prompt = list(range(9))
    assert run_request(kv, "a", prompt) == 0
    assert run_request(kv, "b", prompt) == 0
    assert not set(kv.block_table("a")) & set(kv.block_table("b"))
    assert kv.num_cached_blocks == 0
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 8


def test_paging_wastes_less_than_four_percent_at_block_size_16():
    """A realistic mix: long-tailed prompt and output lengths, nothing shared."""
    rng = random.Random(0)
    lengths = [min(int(rng.lognormvariate(6.0, 0.8)), 4000) + rng.randint(1, 512) for _ in range(400)]
    kv = KVCacheManager(sum(-(-n // 16) for n in lengths), 16, enable_prefix_caching=False)
    for i, length in enumerate(lengths):
        assert kv.allocate(f"r{i}", length)
    assert kv.num_free_blocks == 0
    assert kv.num_live_tokens == sum(lengths)
    assert kv.utilization() >= 0.96


# -- properties over random workloads --------------------------------------------------------------
SYSTEM_PROMPTS = [[], [5, 6, 7, 5, 6], [9] * 8, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]]
BLOCK_SIZE = 4


class Workload:
    """Drives a KVCacheManager like a scheduler and checks it against a model of the cache.

    The model writes, into each slot a request computes, the token prefix whose KV the slot would
    hold; a prefix hit or a deduplicated block must then read back exactly the request's prefix.
    """

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.tokens: dict[str, list[int]] = {}  # live requests
        self.computed: dict[str, int] = {}
        self.history: list[list[int]] = []  # every prompt seen, for requests that repeat one
        self.slot_content: dict[int, tuple[int, ...]] = {}
        self.hits: list[int] = []
        self.next_id = 0

    def apply(self, op: int, seed: int) -> None:
        rng = random.Random(seed)
        live = sorted(self.tokens)
        if op == 0 or (op == 1 and not self.history):
            prompt = rng.choice(SYSTEM_PROMPTS) + [rng.randrange(4) for _ in range(rng.randint(1, 12))]
            self.admit(prompt)
        elif op == 1:  # a prompt seen before, or the start of one
            earlier = rng.choice(self.history)
            self.admit(earlier[:rng.randint(1, len(earlier))])
        elif op == 2 and live:  # one engine step: a prefill chunk or decoded tokens
            self.step(rng.choice(live), rng.randint(1, 13), rng)
        elif op == 3 and live:
            request_id = rng.choice(live)
            self.kv.free(request_id)
            del self.tokens[request_id], self.computed[request_id]

    def admit(self, prompt: list[int]) -> None:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        prefix = self.kv.cached_prefix(prompt)
        hits = len(prefix) * BLOCK_SIZE
        assert self.kv.allocate(request_id, hits, prefix)  # holding cached blocks always fits
        assert hits % BLOCK_SIZE == 0 and 0 <= hits < len(prompt)
        self.hits.append(hits)
        self.tokens[request_id], self.computed[request_id] = list(prompt), hits
        self.history.append(list(prompt))

    def step(self, request_id: str, num_new: int, rng: random.Random) -> None:
        tokens, start = self.tokens[request_id], self.computed[request_id]
        while len(tokens) < start + num_new:  # decoding: generated tokens join the sequence
            tokens.append(rng.randrange(4))
        before = (self.kv.block_table(request_id), self.kv.num_free_blocks, self.kv.num_cached_blocks)
        if not self.kv.allocate(request_id, start + num_new):
            assert before == (self.kv.block_table(request_id), self.kv.num_free_blocks,
                              self.kv.num_cached_blocks)
            return
        for position, slot in enumerate(slots(self.kv, request_id, start, start + num_new), start):
            block = slot // BLOCK_SIZE
            assert self.kv.pool.ref_counts[block] == 1 and block not in (self.kv.index or ())
            self.slot_content[slot] = tuple(tokens[:position + 1])
        self.computed[request_id] = start + num_new
        self.kv.commit(request_id, tokens[:start + num_new])

    def check(self) -> None:
        kv = self.kv
        holders = Counter()
        for request_id, tokens in self.tokens.items():
            table = kv.block_table(request_id)
            holders.update(table)
            computed = self.computed[request_id]
            assert len(table) == -(-computed // BLOCK_SIZE)
            for position, slot in enumerate(slots(kv, request_id, 0, computed)):
                assert self.slot_content[slot] == tuple(tokens[:position + 1])
        assert kv.pool.ref_counts == [holders[b] for b in range(kv.num_blocks)]
        assert kv.num_used_blocks == len(holders)
        assert kv.num_free_blocks + kv.num_used_blocks == kv.num_blocks
        cached = [b for b in range(kv.num_blocks) if kv.index is not None and b in kv.index]
        assert kv.num_cached_blocks == len(cached)
        assert not any(kv.pool.is_free(b) for b in cached)
        assert kv.pool.num_free == sum(1 for b in range(kv.num_blocks)
                                       if holders[b] == 0 and b not in cached)
        assert 0.0 <= kv.utilization() <= 1.0
        if isinstance(kv.index, RadixPrefixIndex):
            check_radix_locks(kv.index, kv.pool.ref_counts)

    def finish(self) -> None:
        """Free everything; then every block must be allocatable again."""
        for request_id in list(self.tokens):
            self.kv.free(request_id)
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert self.kv.pool.ref_counts == [0] * self.kv.num_blocks
        assert self.kv.allocate("everything", self.kv.num_blocks * BLOCK_SIZE)
        assert sorted(self.kv.block_table("everything")) == list(range(self.kv.num_blocks))
        assert self.kv.num_cached_blocks == 0


def check_radix_locks(index: RadixPrefixIndex, ref_counts: list[int]) -> None:
    """Held blocks are the first ``lock_ref`` blocks of each node, and only those."""
    stack = list(index.root.children.values())
    while stack:
        node = stack.pop()
        assert all(ref_counts[b] > 0 for b in node.blocks[:node.lock_ref])
        assert all(ref_counts[b] == 0 for b in node.blocks[node.lock_ref:])
        assert len(node.block_tokens) == len(node.blocks) > 0
        stack.extend(node.children.values())


OPS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2**32)), min_size=10, max_size=60)


@settings(max_examples=120, deadline=None)
@given(ops=OPS, index=st.sampled_from(INDEXES), num_blocks=st.integers(6, 30))
def test_random_workloads_keep_the_books_straight(ops, index, num_blocks):
    workload = Workload(KVCacheManager(num_blocks, BLOCK_SIZE, prefix_index=index))
    for op, seed in ops:
        workload.apply(op, seed)
        workload.check()
    workload.finish()


@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_hash_and_radix_find_the_same_prefixes_when_nothing_is_evicted(ops):
    workloads = [Workload(KVCacheManager(1000, BLOCK_SIZE, prefix_index=index)) for index in INDEXES]
    for workload in workloads:
        for op, seed in ops:
            workload.apply(op, seed)
    hashed, radix = workloads
    assert hashed.hits == radix.hits
    assert hashed.kv.num_cached_blocks == radix.kv.num_cached_blocks


def test_full_blocks_leaves_out_the_partial_tail():
    assert full_blocks([1, 2, 3, 4, 5], 2) == [(1, 2), (3, 4)]
    assert full_blocks([1], 2) == []
