"""KV events: chained block hashes, BlockStored / BlockRemoved / AllCleared, and their agreement with the tree."""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import KVBlockPool, RadixCache
from prefixcache.cache.events import (
    AllCleared,
    BlockIndex,
    BlockRemoved,
    BlockStored,
    block_hashes,
    namespace_root_hash,
)
from prefixcache.errors import (
    InvalidArgumentError,
    InvalidTokensError,
    KVEventError,
    NamespaceError,
    OutOfBlocksError,
    PrefixCacheError,
)


def _h(parent: int, tokens: list[int], seed: int = 0) -> int:
    return xxhash.xxh64_intdigest(parent.to_bytes(8, "little") + struct.pack(f"<{len(tokens)}I", *tokens), seed)


def _expected_blocks(cache: RadixCache, namespaces) -> set[tuple[str | None, int]]:
    """The full blocks of every cached sequence, computed from the sequences alone."""
    out = set()
    for ns in namespaces:
        for seq in cache.cached_sequences(ns):
            out.update((ns, h) for h in block_hashes(seq, cache.block_size, ns, cache.hash_seed))
    return out


def test_root_hash_is_xxh64_of_the_namespace_and_none_differs_from_the_empty_string() -> None:
    assert namespace_root_hash("tenant-a", 7) == xxhash.xxh64_intdigest(b"tenant-a", 7)
    assert namespace_root_hash(None) == xxhash.xxh64_intdigest(b"\xff", 0)
    assert namespace_root_hash(None) != namespace_root_hash("")


def test_block_hashes_chain_from_the_root_over_little_endian_uint32_tokens() -> None:
    root = namespace_root_hash(None, 3)
    h0 = _h(root, [1, 2], 3)
    h1 = _h(h0, [70000, 4], 3)
    assert block_hashes([1, 2, 70000, 4, 5], 2, None, seed=3) == [h0, h1]


def test_block_hashes_reject_a_bad_block_size() -> None:
    with pytest.raises(InvalidArgumentError):
        block_hashes([1, 2], 0)


@pytest.mark.parametrize("tokens", [[-1, 2], [2**40, 2], [1.5, 2], "ab", [True, 2]])
def test_block_hashes_reject_what_a_cache_would_refuse_as_tokens(tokens) -> None:
    with pytest.raises(InvalidTokensError):
        block_hashes(tokens, 2)


@pytest.mark.parametrize("namespace", [5, b"tenant"])
def test_block_hashes_reject_a_namespace_that_is_not_none_or_str(namespace) -> None:
    with pytest.raises(NamespaceError):
        block_hashes([1, 2], 2, namespace)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5])
def test_block_hashes_reject_a_seed_no_cache_can_have(seed) -> None:
    # A cache refuses these seeds, so hashes made with one would never match anything.
    with pytest.raises(InvalidArgumentError):
        block_hashes([1, 2], 2, None, seed)


def _snapshot(index: BlockIndex):
    return set(index.hashes), {k: set(v) for k, v in index.media.items()}, index.num_events


@pytest.mark.parametrize(
    ("held", "event"),
    [
        ([BlockStored(None, (1,), 0, 0, (1, 2), 2)], BlockStored(None, (2, 1), 0, 0, (1, 2, 3, 4), 2)),
        ([], BlockStored(None, (3, 3), 0, 0, (1, 2, 3, 4), 2)),
        ([BlockStored(None, (1,), 0, 0, (1, 2), 2)], BlockRemoved(None, (1, 9))),
        ([BlockStored(None, (1,), 0, 0, (1, 2), 2, "GPU")], BlockStored(None, (3, 1), 0, 0, (1, 2, 3, 4), 2, "GPU")),
        ([BlockStored(None, (1,), 0, 0, (1, 2), 2, "GPU")], BlockRemoved(None, (1, 9), "GPU")),
        ([BlockStored(None, (1,), 0, 0, (1, 2), 2)], AllCleared()),
    ],
)
def test_a_strict_index_refuses_a_contradicting_event_whole(held, event) -> None:
    index = BlockIndex()
    for e in held:
        index(e)
    before = _snapshot(index)
    with pytest.raises(KVEventError) as raised:
        index(event)
    assert isinstance(raised.value, PrefixCacheError) and isinstance(raised.value, AssertionError)
    assert _snapshot(index) == before


def test_an_index_refuses_what_is_not_an_event_and_counts_nothing() -> None:
    index = BlockIndex(strict=False)
    with pytest.raises(InvalidArgumentError):
        index("not an event")
    assert index.num_events == 0


def test_insert_announces_only_the_full_blocks_of_the_new_leaf(make_cache, put) -> None:
    cache = make_cache(num_blocks=16, block_size=2)
    events = []
    cache.subscribe(events.append)
    put(cache, [1, 2, 3, 4, 5])
    root = namespace_root_hash(None)
    h0, h1 = _h(root, [1, 2]), _h(_h(root, [1, 2]), [3, 4])
    assert events == [BlockStored(None, (h0, h1), root, 0, (1, 2, 3, 4), 2)]

    # Diverging at token 3 (inside block 1) splits the node; block 1 of the new leaf is [3, 9].
    events.clear()
    put(cache, [1, 2, 3, 9, 9, 9])
    h1b = _h(h0, [3, 9])
    assert events == [BlockStored(None, (h1b, _h(h1b, [9, 9])), h0, 1, (3, 9, 9, 9), 2)]


def test_a_sequence_shorter_than_a_block_announces_nothing(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    events = []
    cache.subscribe(events.append)
    put(cache, [1, 2, 3])
    assert events == []


def test_evicting_a_leaf_removes_the_blocks_ending_inside_it(make_cache, put) -> None:
    cache = make_cache(num_blocks=16, block_size=2)
    put(cache, [1, 2, 3, 4, 5])
    put(cache, [1, 2, 3, 9, 9, 9])
    events = []
    cache.subscribe(events.append)
    events.clear()
    cache.evict(1)  # LRU: the older leaf, positions [3, 5): it gives up its own partial block [5] first
    assert events == []  # a partial block has no hash
    cache.evict(1)  # then [4], with the full block [3, 4] it ended inside (the other leaf takes the parent's block)
    h0 = _h(namespace_root_hash(None), [1, 2])
    assert events == [BlockRemoved(None, (_h(h0, [3, 4]),))]
    assert cache.cached_sequences() == [[1, 2, 3, 9, 9, 9]]


def test_evicting_everything_ends_with_all_cleared(make_cache, put) -> None:
    cache = make_cache(num_blocks=16, block_size=2)
    index = BlockIndex()
    cache.subscribe(index)
    put(cache, [1, 2, 3, 4, 5])
    put(cache, [7, 8, 9], "tenant")
    events = []
    cache.subscribe(events.append)
    events.clear()
    cache.evict_all()
    assert isinstance(events[-1], AllCleared)
    assert sum(isinstance(e, AllCleared) for e in events) == 1
    assert index.hashes == set()


def test_no_all_cleared_while_a_locked_path_stays_cached(make_cache, put) -> None:
    cache = make_cache(num_blocks=16, block_size=2)
    put(cache, [1, 2, 3, 4])
    put(cache, [5, 6])
    handle = cache.lock(cache.match([1, 2, 3, 4]))
    events = []
    cache.subscribe(events.append)
    events.clear()
    cache.evict_all()
    assert events == [BlockRemoved(None, (_h(namespace_root_hash(None), [5, 6]),))]
    cache.unlock(handle)


def test_a_late_subscriber_first_receives_every_cached_block(make_cache, put) -> None:
    cache = make_cache(num_blocks=32, block_size=2)
    put(cache, [1, 2, 3, 4, 5])
    put(cache, [1, 2, 3, 9, 9, 9])
    put(cache, [4, 4], "other")
    index = BlockIndex()
    cache.subscribe(index)
    assert index.hashes == _expected_blocks(cache, [None, "other"])
    assert len(index.hashes) == 5


def test_unsubscribed_callbacks_hear_nothing_more(make_cache, put) -> None:
    cache = make_cache(block_size=2)
    events = []
    cache.subscribe(events.append)
    cache.unsubscribe(events.append)
    put(cache, [1, 2, 3, 4])
    assert events == []
    with pytest.raises(InvalidArgumentError):
        cache.unsubscribe(events.append)


def test_a_failing_listener_is_logged_and_never_breaks_the_cache(make_cache, put, caplog) -> None:
    def broken(event) -> None:
        raise RuntimeError("listener bug")

    cache = make_cache(block_size=2)
    cache.subscribe(broken)
    put(cache, [1, 2, 3, 4])
    cache.evict_all()
    cache.check_invariants()
    assert "listener" in caplog.text


def test_event_listener_argument_and_hash_seed_are_used(put) -> None:
    index = BlockIndex()
    cache = RadixCache(KVBlockPool(8, 2), event_listener=index, hash_seed=42)
    put(cache, [1, 2, 3])
    assert index.hashes == {(None, _h(namespace_root_hash(None, 42), [1, 2], 42))}


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.lists(st.integers(0, 2), min_size=1, max_size=14), st.sampled_from([None, "b"])),
        st.tuples(st.just("request"), st.lists(st.integers(0, 2), min_size=1, max_size=14), st.just(None)),
        st.tuples(st.just("evict"), st.integers(0, 6), st.just(None)),
        st.tuples(st.just("evict_all"), st.just(0), st.just(None)),
        st.tuples(st.just("subscribe"), st.just(0), st.just(None)),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(block_size=st.integers(1, 4), ops=OPS)
def test_replaying_the_events_reconstructs_exactly_the_cached_full_blocks(block_size: int, ops) -> None:
    cache = RadixCache(KVBlockPool(24, block_size))
    mirrors = [BlockIndex()]
    cache.subscribe(mirrors[0])
    for op, arg, namespace in ops:
        try:
            if op == "put":
                cache.insert(arg, cache.allocate(-(-len(arg) // block_size)), namespace)
            elif op == "request":
                lease = cache.acquire(arg, request_id="r")
                try:
                    cache.reserve(lease, len(arg) + 1)
                    cache.commit(lease, [*arg, 1])
                finally:
                    if not lease.closed:
                        cache.release(lease)
            elif op == "evict":
                cache.evict(arg)
            elif op == "evict_all":
                cache.evict_all()
            else:
                mirrors.append(BlockIndex())
                cache.subscribe(mirrors[-1])
        except OutOfBlocksError:
            pass
        cache.check_invariants()
        expected = _expected_blocks(cache, [None, "b"])
        for mirror in mirrors:
            assert mirror.hashes == expected


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True])
def test_the_hash_seed_must_fit_xxh64(seed) -> None:
    with pytest.raises(InvalidArgumentError):
        RadixCache(KVBlockPool(4, 2), hash_seed=seed)
