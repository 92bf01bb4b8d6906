"""The radix-tree prefix index on its own: match, insert, split, lock, LRU eviction of leaves."""
import pytest

from minillm.engine.paging import RadixPrefixIndex

BS = 2
A = [1, 1, 2, 2, 3, 3]  # three blocks
B = [1, 1, 4, 4, 5, 5]  # shares A's first block


def release(index, blocks):
    """The inserting request lets go of its blocks, tail first."""
    for block in reversed(blocks):
        index.unlock(block)


def test_insert_then_match_whole_blocks_only():
    index = RadixPrefixIndex(BS)
    assert index.insert(A, [10, 11, 12]) == [10, 11, 12]
    assert index.match(A) == [10, 11, 12]
    assert index.match(A[:5]) == [10, 11]  # the partial third block does not count
    assert index.match(A[:4] + [9, 9]) == [10, 11]  # stops inside the node
    assert index.match([9, 9] + A) == []
    assert (index.num_nodes, index.num_cached_blocks, index.num_evictable_blocks) == (1, 3, 0)


def test_a_branch_inside_a_node_splits_it():
    index = RadixPrefixIndex(BS)
    index.insert(A, [10, 11, 12])
    assert index.insert(B, [20, 21, 22]) == [10, 21, 22]  # block 20 duplicates 10
    assert 20 not in index and 10 in index
    assert index.num_nodes == 3
    (shared,) = index.root.children.values()
    assert shared.blocks == [10] and shared.lock_ref == 1
    assert sorted(child.blocks for child in shared.children.values()) == [[11, 12], [21, 22]]
    assert index.match(B) == [10, 21, 22] and index.match(A) == [10, 11, 12]


def test_inserting_a_known_prefix_adds_nothing():
    index = RadixPrefixIndex(BS)
    index.insert(A, [10, 11, 12])
    assert index.insert(A[:4], [30, 31]) == [10, 11]
    assert (index.num_nodes, index.num_cached_blocks) == (1, 3)


def test_locks_follow_the_path_from_the_root():
    index = RadixPrefixIndex(BS)
    index.insert(A, [10, 11, 12])
    with pytest.raises(ValueError, match="tail up"):
        index.unlock(11)
    with pytest.raises(ValueError, match="root down"):
        index.lock(12)  # already locked by the insert
    release(index, [10, 11, 12])
    assert index.num_evictable_blocks == 3
    with pytest.raises(ValueError, match="root down"):
        index.lock(11)
    index.lock(10)
    assert index.num_evictable_blocks == 2
    with pytest.raises(KeyError, match="not cached"):
        index.lock(99)


def test_a_block_above_a_locked_one_stays_locked():
    index = RadixPrefixIndex(BS)
    index.insert(A, [10, 11, 12])
    index.insert(B, [20, 21, 22])  # B shares block 10, which A's insert locked already
    release(index, [11, 12])  # A is done; block 10 is still held by B
    with pytest.raises(ValueError, match="below it is still locked"):
        index.unlock(10)  # B still holds 21 and 22 below block 10
    release(index, [10, 21, 22])
    assert index.num_evictable_blocks == 5


def test_eviction_takes_the_least_recently_used_leaf_tail_first():
    index = RadixPrefixIndex(BS)
    index.insert(A, [10, 11, 12])
    index.insert(B, [20, 21, 22])
    release(index, [11, 12])
    release(index, [10, 21, 22])
    index.match(A)  # A's branch is now the most recently used
    assert index.evict(1) == [22]
    assert index.evict(2) == [21, 12]  # B's leaf empties; then A's leaf, the only one left
    assert index.evict(2) == [11, 10]  # the emptied leaf's parent becomes a leaf
    assert index.num_cached_blocks == 0 and index.num_nodes == 0
    assert index.match(A) == []


def test_locked_leaves_are_never_evicted():
    index = RadixPrefixIndex(BS)
    index.insert(A, [10, 11, 12])
    index.insert([7, 7, 8, 8], [30, 31])
    release(index, [30, 31])
    assert index.num_evictable_blocks == 2
    with pytest.raises(ValueError, match="cannot evict 3"):
        index.evict(3)
    assert index.evict(2) == [31, 30]
    assert index.match(A) == [10, 11, 12]


def test_bad_arguments():
    index = RadixPrefixIndex(BS)
    with pytest.raises(ValueError, match="2 blocks for 3 full blocks"):
        index.insert(A, [10, 11])
    index.insert(A[:2], [10])
    with pytest.raises(ValueError, match="already cached"):
        index.insert([5, 5], [10])
