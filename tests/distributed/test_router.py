"""The exact-prefix router: cached prefix lengths from a BlockIndex, the score, and the load guard."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.cache.events import BlockIndex, BlockStored, block_hashes
from prefixcache.distributed.router import ExactPrefixRouter, cached_prefix_blocks, power_of_two, too_uneven
from prefixcache.errors import InvalidArgumentError, InvalidTokensError, NamespaceError


def _indexed_cache(make_cache, put, sequences, namespace=None, num_blocks=64):
    cache = make_cache(num_blocks=num_blocks, block_size=2)
    index = BlockIndex()
    cache.subscribe(index)
    for seq in sequences:
        put(cache, seq, namespace)
    return cache, index


# make_cache and put are factories: each example builds a fresh cache.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=8),
    st.lists(st.integers(0, 3), min_size=1, max_size=14),
)
def test_cached_prefix_blocks_equals_a_linear_scan_of_the_cache(make_cache, put, sequences, query) -> None:
    cache, index = _indexed_cache(make_cache, put, sequences, num_blocks=24)
    hashes = block_hashes(query, 2)
    linear = 0
    while linear < len(hashes) and (None, hashes[linear]) in index.hashes:
        linear += 1
    assert cached_prefix_blocks(index, hashes) == linear
    # The cache itself agrees, rounded down to whole blocks.
    assert linear == cache.match(query).num_tokens // 2


def test_the_replica_holding_the_longest_prefix_wins(make_cache, put) -> None:
    _, short = _indexed_cache(make_cache, put, [[1, 2, 3, 4]])
    _, long = _indexed_cache(make_cache, put, [[1, 2, 3, 4, 5, 6, 7]])
    _, other = _indexed_cache(make_cache, put, [[9, 9, 9, 9, 9, 9]])
    router = ExactPrefixRouter(2)
    decision = router.choose([1, 2, 3, 4, 5, 6, 7, 8], [short, long, other], [0, 0, 0])
    assert decision.replica == 1
    assert decision.cached_tokens == (4, 6, 0)
    assert not decision.balanced_by_load


def test_namespaces_carry_over_a_prefix_cached_for_another_tenant_scores_zero(make_cache, put) -> None:
    _, tenant_a = _indexed_cache(make_cache, put, [[1, 2, 3, 4]], namespace="a")
    _, plain = _indexed_cache(make_cache, put, [[1, 2]])
    router = ExactPrefixRouter(2)
    assert router.cached_tokens([1, 2, 3, 4], [tenant_a, plain], "a") == [4, 0]
    assert router.cached_tokens([1, 2, 3, 4], [tenant_a, plain], None) == [0, 2]


def test_with_nothing_cached_the_least_loaded_replica_wins() -> None:
    decision = ExactPrefixRouter(2).choose([1, 2, 3, 4], [BlockIndex(), BlockIndex(), BlockIndex()], [3, 1, 2])
    assert decision.replica == 1


def test_the_load_penalty_trades_cached_tokens_for_load(make_cache, put) -> None:
    _, warm = _indexed_cache(make_cache, put, [[1, 2, 3, 4]])
    indexes = [warm, BlockIndex()]
    # Mean load 1, so each request ahead costs the full penalty: two of them against 4 cached tokens.
    assert ExactPrefixRouter(2, load_penalty_tokens=1.0).choose([1, 2, 3, 4], indexes, [2, 0]).replica == 0
    assert ExactPrefixRouter(2, load_penalty_tokens=2.5).choose([1, 2, 3, 4], indexes, [2, 0]).replica == 1


def test_a_relative_penalty_makes_the_same_load_gap_cost_less_once_the_fleet_has_served_more(make_cache, put) -> None:
    _, warm = _indexed_cache(make_cache, put, [[1, 2, 3, 4]])
    indexes = [warm, BlockIndex()]
    router = ExactPrefixRouter(2, load_penalty_tokens=3.0, relative_above=2.0, imbalance_abs=10)
    # Two requests ahead at mean load 1 (not above 2): 6 tokens of penalty outweigh the 4 cached ones.
    assert router.choose([1, 2, 3, 4], indexes, [2, 0]).replica == 1
    # Two requests ahead at mean load 5: each costs 3 * 2 / 5 tokens, 2.4 in all, so the cached prefix wins ...
    assert router.choose([1, 2, 3, 4], indexes, [6, 4]).replica == 0
    # ... where an absolute penalty still moves it.
    absolute = ExactPrefixRouter(2, load_penalty_tokens=3.0, imbalance_abs=10)
    assert absolute.choose([1, 2, 3, 4], indexes, [6, 4]).replica == 1


def test_too_uneven_loads_fall_back_to_power_of_two_choices(make_cache, put) -> None:
    _, warm = _indexed_cache(make_cache, put, [[1, 2, 3, 4]])
    router = ExactPrefixRouter(2, imbalance_abs=2, imbalance_rel=0.0, seed=1)
    decision = router.choose([1, 2, 3, 4], [warm, BlockIndex()], [10, 0])
    assert decision.balanced_by_load and decision.replica == 1


def test_free_blocks_settle_ties_before_the_load_does() -> None:
    empty = [BlockIndex(), BlockIndex(), BlockIndex()]
    router = ExactPrefixRouter(2)
    # Memory ignored (weight 0): equal scores and loads, so the replica with the most free blocks wins.
    assert router.choose([1, 2, 3, 4], empty, [0, 0, 0], free_blocks=[10, 30, 20]).replica == 1
    # The load penalty still comes first.
    penalized = ExactPrefixRouter(2, load_penalty_tokens=1.0)
    assert penalized.choose([1, 2, 3, 4], empty, [0, 1, 0], free_blocks=[10, 30, 20]).replica == 2


def test_the_memory_cost_prices_the_tokens_a_replica_must_store_by_how_full_it_is(make_cache, put) -> None:
    _, warm = _indexed_cache(make_cache, put, [[1, 2, 3, 4]])
    indexes = [warm, BlockIndex()]
    prompt = list(range(1, 21))  # 20 tokens; replica 0 holds the first 4
    router = ExactPrefixRouter(2, memory_weight=1.0)
    # Replica 0 is full (0 of 10 blocks free), replica 1 empty: storing 16 tokens on a pool 100% fuller than the
    # emptiest costs 16, more than the 4 cached tokens save; replica 1 stores 20 at no cost.
    assert router.choose(prompt, indexes, [0, 0], free_blocks=[0, 10], num_blocks=[10, 10]).replica == 1
    # Only 20% fuller: 16 * 0.2 = 3.2 tokens of cost against 4 cached, so the prefix wins.
    assert router.choose(prompt, indexes, [0, 0], free_blocks=[8, 10], num_blocks=[10, 10]).replica == 0
    # A request that is nearly all cached on the fuller replica stores little there and stays.
    long_prefix = [1, 2, 3, 4, 5]
    assert router.choose(long_prefix, indexes, [0, 0], free_blocks=[0, 10], num_blocks=[10, 10]).replica == 0
    # Without pool sizes, or with weight 0, free blocks only settle ties.
    assert router.choose(prompt, indexes, [0, 0], free_blocks=[0, 10]).replica == 0
    plain = ExactPrefixRouter(2)
    assert plain.choose(prompt, indexes, [0, 0], free_blocks=[0, 10], num_blocks=[10, 10]).replica == 0


def test_the_eviction_cost_sends_a_short_prefix_away_from_a_full_replica(make_cache, put) -> None:
    _, warm = _indexed_cache(make_cache, put, [[1, 2, 3, 4]])
    indexes = [warm, BlockIndex()]
    prompt = list(range(1, 21))  # 20 tokens; replica 0 holds the first 4
    router = ExactPrefixRouter(2, evict_weight=1.0)
    # Replica 0 has no free block: storing the 16 uncached tokens evicts 16 tokens there, against 4 cached; replica 1
    # has 10 free blocks (20 tokens) and evicts nothing.
    assert router.choose(prompt, indexes, [0, 0], free_blocks=[0, 10]).replica == 1
    # With 8 free blocks (16 tokens) replica 0 evicts nothing either, and its prefix wins.
    assert router.choose(prompt, indexes, [0, 0], free_blocks=[8, 10]).replica == 0
    # Expecting a 10-token answer, both must evict: 10 tokens on replica 0 (26 stored, 16 free), 10 on replica 1
    # (30 stored, 20 free), so the 4 cached tokens decide.
    assert router.choose(prompt, indexes, [0, 0], free_blocks=[8, 10], expected_new_tokens=10).replica == 0
    # A prompt nearly all cached on the full replica evicts 1 token there and stays.
    assert router.choose([1, 2, 3, 4, 5], indexes, [0, 0], free_blocks=[0, 10]).replica == 0
    # Without free blocks, or with weight 0, there is no eviction cost.
    assert router.choose(prompt, indexes, [0, 0]).replica == 0
    assert ExactPrefixRouter(2).choose(prompt, indexes, [0, 0], free_blocks=[0, 10]).replica == 0


def test_a_continuation_is_guarded_against_the_mean_load_and_new_work_against_the_lightest(make_cache, put) -> None:
    _, warm = _indexed_cache(make_cache, put, [[1, 2, 3, 4]])
    indexes = [warm, BlockIndex(), BlockIndex()]
    coming_back = [1, 2, 3, 4, 5, 6]  # replica 0 holds 4 of 6 tokens: a continuation at share 0.5
    new_work = list(range(1, 11))  # 4 of 10 cached: new work
    kwargs = {"imbalance_abs": 2, "imbalance_rel": 0.0, "continuation_abs": 7, "continuation_rel": 0.5, "seed": 1}
    router = ExactPrefixRouter(2, **kwargs)
    # Loads [10, 0, 2]: 10 above the lightest (> 2), but 6 above the mean of 4 (<= max(7, 2)): the continuation stays.
    decision = router.choose(coming_back, indexes, [10, 0, 2])
    assert decision.replica == 0 and not decision.balanced_by_load
    # New work at the same loads falls back to power of two choices.
    assert router.choose(new_work, indexes, [10, 0, 2]).balanced_by_load
    # 14 is 8.7 above the mean of 5.3: too far even for a continuation.
    assert router.choose(coming_back, indexes, [14, 0, 2]).balanced_by_load
    # Without continuation_rel every request gets the guard against the lightest replica.
    plain = ExactPrefixRouter(2, imbalance_abs=2, imbalance_rel=0.0, seed=1)
    assert plain.choose(coming_back, indexes, [10, 0, 2]).balanced_by_load


def test_power_of_two_picks_the_less_loaded_of_two_distinct_replicas() -> None:
    rng = random.Random(0)
    picks = [power_of_two([5, 0, 5, 5], rng) for _ in range(200)]
    # Replica 1 wins whenever drawn (probability 1/2); the others only against each other.
    assert 0.4 < picks.count(1) / 200 < 0.6
    assert power_of_two([7], rng) == 0


def test_bad_arguments_raise_the_package_error() -> None:
    with pytest.raises(InvalidArgumentError):
        ExactPrefixRouter(0)
    with pytest.raises(InvalidArgumentError):
        ExactPrefixRouter(2, relative_above=0)
    with pytest.raises(InvalidArgumentError):
        ExactPrefixRouter(2).choose([1, 2], [BlockIndex()], [0, 0])
    with pytest.raises(InvalidArgumentError):
        ExactPrefixRouter(2, memory_weight=-1.0)
    two = [BlockIndex(), BlockIndex()]
    with pytest.raises(InvalidArgumentError):
        ExactPrefixRouter(2).choose([1, 2], two, [0, 0], free_blocks=[1])
    with pytest.raises(InvalidArgumentError):
        ExactPrefixRouter(2).choose([1, 2], two, [0, 0], num_blocks=[4, 4])
    with pytest.raises(InvalidArgumentError):
        ExactPrefixRouter(2).choose([1, 2], two, [0, 0], free_blocks=[1, 1], num_blocks=[4, 0])
    for bad in ({"evict_weight": -1.0}, {"continuation_share": 0.0}, {"continuation_share": 1.5}):
        with pytest.raises(InvalidArgumentError):
            ExactPrefixRouter(2, **bad)
    with pytest.raises(InvalidArgumentError):
        ExactPrefixRouter(2, continuation_rel=-0.1)
    with pytest.raises(InvalidArgumentError):
        ExactPrefixRouter(2).choose([1, 2], two, [0, 0], free_blocks=[1, 1], expected_new_tokens=-1)
    with pytest.raises(InvalidArgumentError):
        power_of_two([], random.Random(0))


NAN, INF = float("nan"), float("inf")


def test_a_nan_load_is_refused_rather_than_sending_the_prompt_away_from_its_prefix(make_cache, put) -> None:
    _, holder = _indexed_cache(make_cache, put, [[1, 2, 3, 4]])
    router = ExactPrefixRouter(2)
    assert router.choose([1, 2, 3, 4], [BlockIndex(), holder], [0, 0]).replica == 1
    # NaN made every score NaN, and max() then kept replica 0, which holds nothing.
    with pytest.raises(InvalidArgumentError):
        router.choose([1, 2, 3, 4], [BlockIndex(), holder], [NAN, 0])


@pytest.mark.parametrize(
    "bad",
    [
        {"loads": [NAN, 0]},
        {"loads": [INF, 0]},
        {"loads": [-1, 0]},
        {"free_blocks": [NAN, 1]},
        {"free_blocks": [-1, 1]},
        {"free_blocks": [1, 1], "tiebreak": [0, NAN]},
        {"free_blocks": [1, 1], "num_blocks": [NAN, 4]},
        {"free_blocks": [1, 1], "num_blocks": [INF, 4]},
        {"free_blocks": [5, 1], "num_blocks": [4, 4]},
        {"free_blocks": [1, 1], "expected_new_tokens": INF},
    ],
)
def test_non_finite_or_out_of_range_loads_and_memory_are_refused(bad) -> None:
    args = {"loads": [0, 0], **bad}
    router = ExactPrefixRouter(2, memory_weight=1.0, evict_weight=1.0)
    state = router._rng.getstate()
    with pytest.raises(InvalidArgumentError):
        router.choose([1, 2, 3, 4], [BlockIndex(), BlockIndex()], **args)
    assert router._rng.getstate() == state


def test_prompts_and_namespaces_a_cache_would_refuse_raise_the_package_errors() -> None:
    router = ExactPrefixRouter(2)
    two = [BlockIndex(), BlockIndex()]
    for tokens in ([-1, 2], [2**40, 2], [1.5, 2], "ab"):
        with pytest.raises(InvalidTokensError):
            router.choose(tokens, two, [0, 0])
    for namespace in (5, b"t"):
        with pytest.raises(NamespaceError):
            router.choose([1, 2], two, [0, 0], namespace)


@pytest.mark.parametrize(
    "bad",
    [
        {"block_size": 2.5},
        {"block_size": True},
        {"load_penalty_tokens": NAN},
        {"imbalance_abs": NAN},
        {"load_penalty_tokens": INF},
        {"imbalance_rel": NAN},
        {"memory_weight": NAN},
        {"evict_weight": INF},
        {"continuation_abs": NAN},
        {"continuation_rel": NAN},
        {"relative_above": NAN},
        {"hash_seed": -1},
        {"hash_seed": 2**64},
    ],
)
def test_non_finite_settings_and_a_seed_no_cache_can_have_are_refused(bad) -> None:
    args = {"block_size": 2, **bad}
    with pytest.raises(InvalidArgumentError):
        ExactPrefixRouter(args.pop("block_size"), **args)


def test_an_infinite_threshold_turns_its_guard_off() -> None:
    router = ExactPrefixRouter(2, imbalance_abs=INF, imbalance_rel=INF, relative_above=INF)
    held = BlockIndex()
    held(BlockStored(None, tuple(block_hashes([1, 2], 2)), 0, 0, (1, 2), 2))
    decision = router.choose([1, 2], [BlockIndex(), held], [0, 1000])
    assert decision.replica == 1 and not decision.balanced_by_load


def test_too_uneven_without_a_replica_raises_the_package_error() -> None:
    with pytest.raises(InvalidArgumentError):
        too_uneven([], 8, 0.1)
