"""The drafter: its lookups against a brute-force search over the same sequences, namespace isolation, the cache's
events kept in step, and the adaptive draft length."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache.pool import KVBlockPool
from prefixcache.cache.radix_cache import RadixCache
from prefixcache.engine import draft
from prefixcache.engine.draft import ContextIndex, Drafter, DraftLength, DraftProposal, SharedPrefix
from prefixcache.engine.draft_index import latest_matches, ngram_hashes_before, suffix_hashes
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
    # The rule is deterministic: eight full drafts rejected outright use up the acceptance estimate, then nothing is
    # proposed until the estimate has relaxed back toward its prior (two steps here), and full drafts resume.
    assert budgets == [8] * 8 + [0]
    steps = 0
    while length.next_budget() == 0:
        length.update(0, 0)
        steps += 1
    assert steps == 2 and length.next_budget() == 8


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


def _proposals(drafter: Drafter, index: ContextIndex) -> list[DraftProposal]:
    return [drafter.lookup(index, None, k) for k in (1, 3, 8)]


shared_runs = st.lists(st.integers(0, 3), min_size=0, max_size=30)


@settings(max_examples=150, deadline=None)
@given(shared_runs, st.lists(shared_runs, min_size=1, max_size=4), st.lists(st.integers(0, 3), max_size=40),
       st.integers(1, 12))  # fmt: skip
def test_an_index_grown_on_a_shared_prefix_drafts_as_one_built_from_scratch(
    common: list[int], tails: list[list[int]], answer: list[int], chunk: int
) -> None:
    drafter = Drafter(8)
    shared = SharedPrefix(SIZES, common + tails[0])
    for tail in tails:
        context = common + tail
        grown = ContextIndex(SIZES, context[: len(context) // 2], shared=shared)
        rest = context[len(context) // 2 :] + answer
        for at in range(0, len(rest), chunk):
            grown.extend(rest[at : at + chunk])
            whole = ContextIndex(SIZES, context[: len(context) // 2] + rest[: at + chunk])
            assert grown.tokens == whole.tokens
            assert _proposals(drafter, grown) == _proposals(drafter, whole)


@settings(max_examples=150, deadline=None)
@given(shared_runs, shared_runs, st.lists(st.integers(0, 3), max_size=60))
def test_latest_matches_finds_what_a_lookup_before_each_token_finds(
    common: list[int], prompt: list[int], answer: list[int]
) -> None:
    shared = SharedPrefix(SIZES, common + [9, 9])
    slow = ContextIndex(SIZES, common + prompt)
    expected = {n: [] for n in SIZES}
    for token in answer:
        for n in SIZES:
            draft = slow.lookup(n, 64)
            expected[n].append(len(slow) - len(draft) if draft else -1)  # a draft runs to the context's end
        slow.push(token)
    tokens = np.array(common + prompt + answer, dtype=np.int64)
    queries = np.arange(len(common + prompt), len(tokens), dtype=np.int64)
    for n in SIZES:
        assert latest_matches(tokens, n, queries, shared, len(common)).tolist() == expected[n]
        assert latest_matches(tokens, n, queries).tolist() == expected[n]
        asked = queries[queries >= n]
        hashes = [suffix_hashes(tokens[:q].tolist(), n)[n - 1] for q in asked.tolist()]
        assert ngram_hashes_before(tokens, asked, n).tolist() == hashes


def test_a_long_context_becomes_a_shared_prefix_for_the_next(monkeypatch) -> None:
    monkeypatch.setattr(draft, "SHARED_PREFIX_MIN_TOKENS", 8)
    drafter = Drafter(8)
    first = drafter.context(list(range(20)))
    second = drafter.context([*range(16), 7])
    assert (first.shared_tokens, second.shared_tokens) == (20, 16)
    assert second.lookup(1, 3) == [8, 9, 10] and second.tokens == [*range(16), 7]  # 7 then 8 .. in the shared part
    assert drafter.context([5, 5, 5, 5, 5, 5, 5, 5, 5]).shared_tokens == 9  # shares nothing: a prefix of its own


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=60), st.lists(st.integers(0, 8), min_size=1, max_size=60),
       st.lists(st.integers(0, 8), min_size=1, max_size=60))  # fmt: skip
def test_forced_steps_are_next_budget_and_update_step_by_step(
    costs: list[float], drafts: list[int], matching: list[int]
) -> None:
    costs = [1.0] + [1.0 + c for c in costs[:8]]
    size = min(len(drafts), len(matching))
    drafts, matching = drafts[:size], [min(m, d) for m, d in zip(matching, drafts, strict=False)]
    fast, slow = DraftLength(8, costs), DraftLength(8, costs)
    expected, i = [], 0
    while i < size:
        k = min(drafts[i], slow.next_budget())
        accepted = min(matching[i], k)
        slow.update(k, accepted)
        expected.append(k)
        i += accepted + 1
    assert fast.forced_steps(drafts, matching) == expected
    assert (fast.p_first, fast.p_next, fast.next_budget()) == (slow.p_first, slow.p_next, slow.next_budget())


@settings(max_examples=100, deadline=None)
@given(st.lists(tokens, max_size=6), st.lists(tokens, min_size=1, max_size=4))
def test_a_tree_restricted_to_the_asked_ngrams_drafts_as_a_whole_one(
    sequences: list[list[int]], contexts: list[list[int]]
) -> None:
    keys = {n: set() for n in SIZES}
    for context in contexts:
        for n, h in zip(range(1, 5), suffix_hashes(context, 4), strict=False):
            keys[n].add(h)
    restricted, whole = Drafter(8, block_size=2), Drafter(8, block_size=2)
    restricted.restrict_tree({n: np.array(sorted(keys[n]), dtype=np.uint64) for n in SIZES})
    for sequence in sequences:
        restricted.add_sequence(sequence)
        whole.add_sequence(sequence)
    restricted.check_invariants()
    for context in contexts:
        assert restricted.propose(context) == whole.propose(context)


def test_a_tree_is_restricted_before_its_first_block_only() -> None:
    drafter = Drafter(8, block_size=2)
    with pytest.raises(InvalidArgumentError, match="sizes"):
        drafter.restrict_tree({4: np.zeros(0, dtype=np.uint64)})
    drafter.add_sequence([1, 2, 3, 4])
    with pytest.raises(InvalidArgumentError, match="before any block"):
        drafter.restrict_tree({n: np.zeros(0, dtype=np.uint64) for n in SIZES})
