"""The drafter: its lookups against a brute-force search over the same sequences, namespace isolation, the cache's
events kept in step, and the adaptive draft length."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache.pool import KVBlockPool
from prefixcache.cache.radix_cache import RadixCache
from prefixcache.engine.draft import Drafter, DraftLength, DraftProposal
from prefixcache.errors import InvalidArgumentError

SIZES = (4, 3, 2, 1)


def reference_draft(context: list[int], sequences: list[list[int]], block_size: int, k: int) -> DraftProposal:
    """Brute force: for n = 4..1, the latest earlier occurrence of the context's last n tokens in the context, else
    the latest stored position of them among the sequences' full blocks (blocks in the order first stored, positions
    in order), continued through the latest stored block after each block."""
    blocks: dict[tuple[int, ...], int] = {}  # a block, named by the prefix it ends: the order it was stored in
    for sequence in sequences:
        for j in range(len(sequence) // block_size):
            blocks.setdefault(tuple(sequence[: (j + 1) * block_size]), len(blocks))
    stored = sorted(blocks, key=blocks.get)

    def continuation(prefix: tuple[int, ...], offset: int) -> list[int]:
        out = list(prefix[len(prefix) - block_size + offset :])
        while len(out) < k:
            children = [b for b in stored if len(b) == len(prefix) + block_size and b[: len(prefix)] == prefix]
            if not children:
                break
            prefix = children[-1]
            out += prefix[-block_size:]
        return out[:k]

    for n in SIZES:
        if len(context) < n:
            continue
        for p in range(len(context) - 1, n - 1, -1):
            if context[p - n : p] == context[-n:]:
                return DraftProposal(tuple(context[p : p + k]), "context", n)
        for prefix in reversed(stored):
            for offset in range(block_size - 1, -1, -1):
                end = len(prefix) - block_size + offset
                if end >= n and list(prefix[end - n : end]) == context[-n:]:
                    return DraftProposal(tuple(continuation(prefix, offset)), "tree", n)
    return DraftProposal()


tokens = st.lists(st.integers(0, 4), max_size=40)


@settings(max_examples=200, deadline=None)
@given(st.lists(tokens, max_size=6), tokens, st.sampled_from([1, 2, 4]), st.integers(1, 9))
def test_a_draft_is_the_brute_force_searchs(sequences: list[list[int]], context: list[int], block_size: int, k: int):
    drafter = Drafter(k, block_size=block_size)
    for sequence in sequences:
        drafter.add_sequence(sequence)
    drafter.check_invariants()
    assert drafter.propose(context) == reference_draft(context, sequences, block_size, k)


@settings(max_examples=100, deadline=None)
@given(st.lists(tokens, min_size=1, max_size=5), tokens)
def test_a_draft_never_comes_from_another_namespace(sequences: list[list[int]], context: list[int]) -> None:
    drafter = Drafter(8, block_size=2)
    for sequence in sequences:
        drafter.add_sequence(sequence, namespace="tenant-a")
    proposal = drafter.propose(context, namespace="tenant-b")
    assert proposal.source != "tree"
    assert (
        drafter.num_blocks("tenant-b") == 0
        and drafter.num_blocks("tenant-a") > 0
        or not any(len(s) >= 2 for s in sequences)
    )


def test_a_session_drafts_as_a_fresh_lookup_after_each_token() -> None:
    drafter = Drafter(4, block_size=2)
    drafter.add_sequence([7, 8, 9, 10, 11, 12])
    session = drafter.session([1, 2, 3, 1, 2])
    assert session.propose() == DraftProposal((3, 1, 2), "context", 2)
    session.advance([3, 1, 2, 8], 3, 3)
    assert session.propose() == DraftProposal((9, 10, 11, 12), "tree", 1)
    assert session.propose() == drafter.propose(session.tokens)


def _commit(cache: RadixCache, tokens: list[int]) -> None:
    lease = cache.acquire(tokens, num_tokens=len(tokens))
    cache.reserve(lease, len(tokens))
    cache.commit(lease, tokens)


def test_the_drafter_follows_the_caches_inserts_and_evictions() -> None:
    cache = RadixCache(KVBlockPool(64, 4))
    drafter = Drafter(8)
    cache.subscribe(drafter)
    _commit(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # two full blocks and a partial one, never announced
    assert drafter.num_blocks() == 2
    assert drafter.propose([0, 3]) == DraftProposal((4, 5, 6, 7, 8), "tree", 1)
    _commit(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])  # the third block fills: the draft runs on into it
    assert drafter.propose([0, 3]) == DraftProposal((4, 5, 6, 7, 8, 9, 10, 11), "tree", 1)
    cache.evict_all()
    assert drafter.num_blocks() == 0
    assert drafter.propose([0, 3]) == DraftProposal()
    drafter.check_invariants()


def test_a_removed_block_takes_its_ngrams_with_it_and_a_later_store_brings_them_back() -> None:
    cache = RadixCache(KVBlockPool(4, 4))  # room for 16 tokens: the second sequence evicts the first
    drafter = Drafter(8)
    cache.subscribe(drafter)
    _commit(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    _commit(cache, [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35])
    drafter.check_invariants()
    assert drafter.propose([2]) == DraftProposal()
    assert drafter.propose([33]) == DraftProposal((34, 35), "tree", 1)


def test_block_sizes_must_agree() -> None:
    drafter = Drafter(block_size=8)
    cache = RadixCache(KVBlockPool(8, 4))
    cache.subscribe(drafter)
    _commit(cache, [1, 2, 3, 4])
    with pytest.raises(InvalidArgumentError, match="block size 4"):
        drafter.sync()


def test_a_flat_verify_cost_always_drafts_the_most() -> None:
    length = DraftLength(8)
    for _ in range(50):
        assert length.next_budget() == 8
        length.update(8, 0)
    assert length.next_budget() == 8


def test_a_costly_verify_shrinks_on_rejection_stops_after_failures_and_tries_again_later() -> None:
    costs = (1.0, 1.27, 1.58, 1.67, 1.97, 1.98, 2.13, 2.18, 2.21)
    length = DraftLength(8, costs)
    for _ in range(6):
        length.update(length.next_budget(), length.next_budget())  # every draft accepted whole
    assert length.next_budget() == 8
    budgets = []
    while not budgets or budgets[-1]:
        budgets.append(length.next_budget())
        length.update(budgets[-1], 0)
    assert budgets == sorted(budgets, reverse=True) and budgets[0] == 8 and len(budgets) <= 12
    steps = 0
    while length.next_budget() == 0:
        length.update(0, 0)
        steps += 1
    assert 1 <= steps <= 40 and length.next_budget() >= 1


def test_draft_length_refuses_an_acceptance_beyond_the_draft() -> None:
    with pytest.raises(InvalidArgumentError):
        DraftLength(8).update(2, 3)
    with pytest.raises(InvalidArgumentError):
        DraftLength(0)
    with pytest.raises(InvalidArgumentError):
        DraftLength(8, (1.0, 0.0))


def test_a_session_index_grows_as_one_built_at_once() -> None:
    drafter = Drafter(8)
    tokens = array("I", [i % 7 for i in range(300)])
    grown = drafter.session(tokens[:10])
    for token in tokens[10:]:
        grown.extend([token])
    whole = drafter.session(tokens)
    assert grown.tokens == whole.tokens and grown.propose() == whole.propose()
