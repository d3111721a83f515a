"""The block-level cache model of prefixcache.replay.belady and the policy benchmark built on it.

Belady's policy is checked against an exhaustive search over every possible cache content after every request, and
both policies against slow, obviously correct references.  No timings are asserted.
"""

from __future__ import annotations

import functools
import itertools

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from prefixcache.errors import InvalidArgumentError
from prefixcache.replay.belady import (
    BlockTrace,
    _simulate_belady,
    _simulate_lru,
    _unbounded_hits,
    build_block_trace,
    simulate,
)

# Six requests of two tokens (block size 1): a shared first token cycling a, b, c, then a private second token.
CYCLE = [([first, 10 + i], []) for i, first in enumerate([1, 2, 3, 1, 2, 3])]


def chains(trace: BlockTrace) -> list[list[int]]:
    blocks, offsets = trace.blocks.tolist(), trace.offsets.tolist()
    return [blocks[offsets[r] : offsets[r + 1]] for r in range(trace.num_requests)]


def reference_next_use(trace: BlockTrace) -> list[list[int]]:
    """For each access, the next request whose hittable prompt blocks contain the block: a forward scan."""
    all_chains, limits = chains(trace), trace.hit_limit.tolist()
    out = []
    for r, chain in enumerate(all_chains):
        row = []
        for block in chain:
            later = (u for u in range(r + 1, trace.num_requests) if block in all_chains[u][: limits[u]])
            row.append(next(later, trace.num_requests))
        out.append(row)
    return out


def reference_outcomes(trace: BlockTrace, capacity: int, policy: str) -> set[tuple[int, int]]:
    """Every ``(hits, evictions)`` the model of the module docstring allows, written as plainly as possible: a dict
    of ranks, a full scan per eviction, and no tie-break of its own.

    A victim is a block ranked worst: LRU's has the oldest last request (deepest on ties), Belady's the farthest next
    use (deepest on ties).  An offered block that ranks no better than the victim is bypassed, with the rest of its
    chain.  Where blocks tie (Belady's only: equal next use and depth, which means never used again), every choice
    is followed, bypassing the offered block included, so the result is the set of all permitted outcomes."""
    next_use = reference_next_use(trace)
    limits = trace.hit_limit.tolist()
    # Ranks order blocks from "evict first" (smallest) to "keep" (largest).
    states = {(frozenset(), 0, 0)}
    for r, chain in enumerate(chains(trace)):
        following: set[tuple[frozenset, int, int]] = set()
        for cached, hits, evictions in states:
            ranks = dict(cached)
            k = 0
            while k < len(chain) and chain[k] in ranks:
                k += 1
            pending = [(ranks, hits + min(k, limits[r]), evictions, 0)]
            while pending:
                ranks, hits, evictions, depth = pending.pop()
                if depth == len(chain):
                    following.add((frozenset(ranks.items()), hits, evictions))
                    continue
                block = chain[depth]
                rank = (r, -depth) if policy == "lru" else (-next_use[r][depth], -depth)
                if block in ranks or len(ranks) < capacity:
                    pending.append(({**ranks, block: rank}, hits, evictions, depth + 1))
                    continue
                worst = min(ranks.values())
                if rank <= worst:  # the offered block is the worst (or ties with it): bypassing it is permitted
                    following.add((frozenset(ranks.items()), hits, evictions))
                if rank >= worst:
                    for victim in [b for b, v in ranks.items() if v == worst]:
                        kept = {b: v for b, v in ranks.items() if b != victim}
                        pending.append(({**kept, block: rank}, hits, evictions + 1, depth + 1))
        states = following
    return {(hits, evictions) for _, hits, evictions in states}


def optimum_hits(trace: BlockTrace, capacity: int) -> int:
    """The most hit blocks any policy can get: after each request the cache may become any set of at most
    ``capacity`` blocks drawn from what it held and the request's blocks (an exhaustive search)."""
    all_chains, limits = chains(trace), trace.hit_limit.tolist()

    @functools.cache
    def best(r: int, cached: frozenset[int]) -> int:
        if r == len(all_chains):
            return 0
        chain = all_chains[r]
        k = 0
        while k < limits[r] and chain[k] in cached:
            k += 1
        candidates = sorted(cached | set(chain))
        size = min(capacity, len(candidates))
        return k + max(best(r + 1, frozenset(kept)) for kept in itertools.combinations(candidates, size))

    return best(0, frozenset())


tokens = st.lists(st.integers(0, 2), min_size=1, max_size=6)
request_lists = st.lists(
    st.tuples(tokens, st.lists(st.integers(0, 2), max_size=3)),
    min_size=1,
    max_size=7,
)


def test_lru_thrashes_on_a_cycle_one_longer_than_the_cache_and_belady_does_not() -> None:
    trace = build_block_trace(CYCLE, block_size=1)

    assert trace.num_blocks == 9
    assert trace.prompt_tokens == 12
    assert [simulate(trace, c, "lru").hit_blocks for c in (2, 3)] == [0, 0]
    assert [simulate(trace, c, "belady").hit_blocks for c in (2, 3)] == [2, 3]
    assert simulate(trace, 9, "lru").hit_blocks == simulate(trace, 9, "belady").hit_blocks == 3


def test_hit_rate_counts_whole_blocks_over_all_prompt_tokens() -> None:
    trace = build_block_trace(CYCLE, block_size=1)

    result = simulate(trace, 2, "belady")

    assert (result.hit_tokens, result.prompt_tokens, result.hit_rate) == (2, 12, 2 / 12)


def test_blocks_are_named_by_their_whole_prefix() -> None:
    trace = build_block_trace([([5, 5, 5, 5], []), ([6, 5, 5, 5], []), ([5, 5, 5, 5, 7, 7], [])], block_size=2)

    first, second, third = chains(trace)
    assert first[1] != second[1], "equal tokens behind a different prefix are a different block"
    assert third[:2] == first
    assert trace.depth.tolist() == [0, 1, 0, 1, 2]


def test_a_request_can_hit_only_blocks_before_its_last_prompt_token() -> None:
    trace = build_block_trace([([1, 2, 3, 4], [9, 9]), ([1, 2, 3, 4], [])], block_size=2)

    assert trace.hit_limit.tolist() == [1, 1]
    assert simulate(trace, 8, "lru").hit_blocks == 1


def test_answer_blocks_are_cached_for_the_next_turn() -> None:
    trace = build_block_trace([([1, 2], [3, 4]), ([1, 2, 3, 4, 5, 6], [])], block_size=2)

    assert simulate(trace, 3, "lru").hit_blocks == 2
    assert simulate(trace, 3, "belady").hit_blocks == 2


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_simulate_rejects_a_capacity_that_is_not_a_positive_int(bad) -> None:
    trace = build_block_trace(CYCLE, block_size=1)
    with pytest.raises(InvalidArgumentError):
        simulate(trace, bad, "lru")


def test_simulate_rejects_an_unknown_policy() -> None:
    with pytest.raises(InvalidArgumentError, match="belady"):
        simulate(build_block_trace(CYCLE, block_size=1), 2, "fifo")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=request_lists, block_size=st.sampled_from([1, 2]))
def test_next_use_is_the_next_request_whose_prompt_holds_the_block(requests, block_size) -> None:
    trace = build_block_trace(requests, block_size)

    flat = [u for row in reference_next_use(trace) for u in row]
    assert trace.next_use.tolist() == flat


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=request_lists, block_size=st.sampled_from([1, 2]))
def test_both_policies_match_their_plain_reference_at_every_capacity(requests, block_size) -> None:
    trace = build_block_trace(requests, block_size)

    for capacity in range(1, trace.num_blocks + 2):
        assert {_simulate_lru(trace, capacity)} == reference_outcomes(trace, capacity, "lru"), capacity
        permitted = reference_outcomes(trace, capacity, "belady")
        assert len({hits for hits, _ in permitted}) == 1, "ties between blocks decide evictions, never hits"
        assert _simulate_belady(trace, capacity) in permitted, (capacity, permitted)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=request_lists, block_size=st.sampled_from([1, 2]))
def test_belady_hits_at_least_as_much_as_lru_at_every_capacity(requests, block_size) -> None:
    trace = build_block_trace(requests, block_size)

    for capacity in range(1, trace.num_blocks + 2):
        assert simulate(trace, capacity, "belady").hit_blocks >= simulate(trace, capacity, "lru").hit_blocks


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(requests=request_lists, block_size=st.sampled_from([1, 2]))
def test_belady_never_beats_the_exhaustive_optimum(requests, block_size) -> None:
    # Farthest-next-use is optimal for plain paging; with prefix hits (only a leading run of cached blocks counts)
    # it can fall short of the exhaustive optimum, e.g. requests [0]+[1], [1], [1,0], [0], [0,1,0] at capacity 2
    # (2 hits against 3).  So it bounds the online policies from above in practice, not provably.
    trace = build_block_trace(requests, block_size)
    assume(trace.num_blocks <= 9)

    for capacity in range(1, trace.num_blocks + 1):
        assert simulate(trace, capacity, "belady").hit_blocks <= optimum_hits(trace, capacity), capacity


def paging(firsts: list[int]) -> list[tuple[list[int], list[int]]]:
    """Plain paging as a request list (block size 1): request ``i`` can hit only the block of its first token
    ``firsts[i]``; its second token is private, so that block is touched once and never hit."""
    return [([first, 100 + i], []) for i, first in enumerate(firsts)]


@settings(max_examples=60, deadline=None)
@given(firsts=st.lists(st.integers(0, 3), min_size=1, max_size=8))
def test_belady_equals_the_exhaustive_optimum_on_plain_paging(firsts) -> None:
    # Without prefix structure farthest-next-use is optimal (Belady 1966; Mattson et al. 1970), so here the
    # simulated policy must reach the optimum exactly, not merely stay below it.
    trace = build_block_trace(paging(firsts), 1)

    for capacity in range(1, len(set(firsts)) + 1):
        assert simulate(trace, capacity, "belady").hit_blocks == optimum_hits(trace, capacity), capacity


def hot_prompt_among_scans(repeats: int, gap: int) -> list[tuple[list[int], list[int]]]:
    """One prompt sent ``repeats`` times with ``gap`` one-off prompts after each: ``2 * gap`` blocks pass between
    two uses of the hot block."""
    firsts = [token for i in range(repeats) for token in (0, *range(10 + gap * i, 10 + gap * (i + 1)))]
    return paging(firsts)


@pytest.mark.parametrize(
    ("requests", "capacity"),
    [
        (paging([1, 2, 3] * 3), 2),
        (paging([1, 2, 3] * 3), 3),
        (paging([1, 2, 3, 4] * 3), 3),
        (paging([1, 2, 3, 4, 5] * 3), 4),
        (hot_prompt_among_scans(5, gap=1), 2),
        (hot_prompt_among_scans(4, gap=2), 3),
        (hot_prompt_among_scans(4, gap=2), 4),
    ],
    ids=["cycle3-cap2", "cycle3-cap3", "cycle4-cap3", "cycle5-cap4", "scan1-cap2", "scan2-cap3", "scan2-cap4"],
)
def test_belady_reaches_the_optimum_where_lru_gets_nothing(requests, capacity) -> None:
    # A cycle one prompt longer than the cache, and a hot prompt behind one-off scans as long as the cache: LRU
    # always evicts the block that is needed next (each request brings 2 blocks), Belady keeps it.
    trace = build_block_trace(requests, 1)

    lru, belady = simulate(trace, capacity, "lru").hit_blocks, simulate(trace, capacity, "belady").hit_blocks
    assert lru == 0
    assert belady == optimum_hits(trace, capacity) > 0


def test_belady_falls_short_of_the_optimum_on_a_prefix_dependent_trace() -> None:
    requests = [([0], [1]), ([1], []), ([1, 0], []), ([0], []), ([0, 1, 0], [])]
    trace = build_block_trace(requests, 1)

    assert (simulate(trace, 2, "belady").hit_blocks, optimum_hits(trace, 2)) == (2, 3)


@settings(max_examples=100, deadline=None)
@given(requests=request_lists, block_size=st.sampled_from([1, 2, 3]))
def test_a_cache_that_holds_every_block_takes_the_shortcut_without_changing_the_answer(requests, block_size) -> None:
    trace = build_block_trace(requests, block_size)
    assume(trace.num_blocks > 0)

    expected = _unbounded_hits(trace)
    assert _simulate_lru(trace, trace.num_blocks) == (expected, 0)
    assert _simulate_belady(trace, trace.num_blocks) == (expected, 0)


def test_policy_benchmark_on_a_shared_transcript_orders_the_policies(shared_data) -> None:
    from prefixcache.bench import policy

    path = shared_data("oasst_en100_tree_paths.jsonl")
    assert path == policy.DATA_DIR / path.name  # the benchmark reads the same folder

    result = policy.measure_file(path, limit=10)

    assert result["working_set_blocks"] > 0
    assert [row["fraction"] for row in result["capacities"]] == [0.10, 0.25, 0.50, 1.00]
    for row in result["capacities"]:
        assert row["sim_lru"] <= row["sim_belady"] <= result["infinite_sim"]
        assert max(row["radix_lru"], row["radix_lfu"]) <= result["infinite_radix"]
