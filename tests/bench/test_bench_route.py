"""The route benchmark: simulated replicas, the four routers, and what each must get right."""

from __future__ import annotations

from array import array

import pytest

from prefixcache.bench import route
from prefixcache.cache.tokens import TOKEN_TYPECODE
from prefixcache.errors import InvalidArgumentError
from prefixcache.replay.replayer import ReplayRequest


def _conversations(num: int, turns: int, turn_tokens: int = 400) -> list[ReplayRequest]:
    """``num`` conversations of ``turns`` turns, interleaved; each prompt extends the previous prompt + answer."""
    history = {c: array(TOKEN_TYPECODE) for c in range(num)}
    out = []
    for t in range(turns):
        for c in range(num):
            start = 10_000 * c + 1000 * t
            prompt = history[c] + array(TOKEN_TYPECODE, range(start, start + turn_tokens))
            answer = array(TOKEN_TYPECODE, range(start + 500, start + 508))
            out.append(ReplayRequest("synthetic", f"conv{c}", t, prompt, answer))
            history[c] = prompt + answer
    return out


def test_with_room_for_everything_exact_routing_matches_one_big_replica_and_round_robin_does_not() -> None:
    # 7 conversations on 4 replicas: round-robin moves every conversation at every turn.
    requests = _conversations(num=7, turns=5)
    big = route.simulate(requests, 1, 40_000, "round-robin")["hit_rate"]
    exact = route.simulate(requests, 4, 10_000, "exact")
    round_robin = route.simulate(requests, 4, 10_000, "round-robin")
    affinity = route.simulate(requests, 4, 10_000, "affinity")
    assert exact["hit_rate"] == pytest.approx(big)
    assert affinity["hit_rate"] == pytest.approx(big)
    assert round_robin["hit_rate"] < 0.5 * big
    assert exact["imbalance"] <= 1.25
    assert round_robin["imbalance"] == pytest.approx(9 / (35 / 4))  # 9, 9, 9, 8 requests


def test_kept_counts_later_turns_sent_where_their_previous_turn_went() -> None:
    # 7 conversations on 4 replicas: round-robin never sends a turn where the conversation's last turn went; with 8,
    # each round of turns lines up with the replicas, so round-robin keeps every conversation by accident.
    assert route.simulate(_conversations(num=7, turns=3), 4, 10_000, "round-robin")["kept"] == 0
    by_accident = route.simulate(_conversations(num=8, turns=3), 4, 10_000, "round-robin")
    assert by_accident["kept"] == 1
    assert route.simulate(_conversations(num=7, turns=3), 4, 10_000, "affinity")["kept"] == 1
    # 7 conversations x 2 later turns = 14 returning requests; the exact router keeps them all with room to spare.
    assert route.simulate(_conversations(num=7, turns=3), 4, 10_000, "exact")["kept"] == 1
    assert route.simulate(_conversations(num=5, turns=1), 2, 10_000, "exact")["kept"] is None


def test_the_text_router_follows_its_routing_history() -> None:
    requests = _conversations(num=4, turns=4)
    text = route.simulate(requests, 2, 10_000, "text prefix")
    assert text["hit_rate"] == pytest.approx(route.simulate(requests, 1, 20_000, "round-robin")["hit_rate"])


def test_consistent_hashing_moves_few_keys_when_a_replica_is_added() -> None:
    keys = [f"conversation-{i}" for i in range(2000)]
    before = route.ConsistentHashRing(8)
    after = route.ConsistentHashRing(9)
    moved = sum(before.owner(k) != after.owner(k) for k in keys)
    # Ideal: 1/9 of the keys move, all of them to the new replica.
    assert moved < 0.2 * len(keys)
    assert all(after.owner(k) == 8 for k in keys if before.owner(k) != after.owner(k))


def test_quick_route_benchmark_on_the_shared_data(shared_data) -> None:
    for name, _, _ in route.WORKLOADS.values():
        assert shared_data(name) == route.DATA_DIR / name  # skips locally, fails under CI, when one is missing
    result = route.run(quick=True, replicas=(4,))
    for label, workload in result.data["workloads"].items():
        (row,) = workload["rows"]
        assert row["exact"]["hit_rate"] >= row["round-robin"]["hit_rate"], label
        assert row["exact"]["imbalance"] <= 1.5, label
        assert 0 < row["baseline"] <= 1


def _shared_first_turn(num: int, turns: int) -> list[ReplayRequest]:
    """``num`` conversations that all open with the same 160-token question, then go their own ways."""
    question = array(TOKEN_TYPECODE, range(90_000, 90_160))
    out = []
    history = {c: question for c in range(num)}
    for t in range(turns):
        for c in range(num):
            start = 10_000 * c + 1000 * t
            prompt = history[c] if t == 0 else history[c] + array(TOKEN_TYPECODE, range(start, start + 32))
            answer = array(TOKEN_TYPECODE, range(start + 500, start + 800))
            out.append(ReplayRequest("synthetic", f"conv{c}", t, prompt, answer))
            history[c] = prompt + answer
    return out


def test_the_oracle_piles_a_shared_first_turn_on_one_replica_and_the_exact_router_does_not() -> None:
    requests = _shared_first_turn(num=16, turns=3)
    big = route.simulate(requests, 1, 40_000, "round-robin")
    oracle = route.simulate(requests, 4, 10_000, "oracle", big["hits"])
    exact = route.simulate(requests, 4, 10_000, "exact", big["hits"])
    assert oracle["hit_rate"] == pytest.approx(big["hit_rate"])
    assert oracle["imbalance"] == pytest.approx(4.0)  # every conversation follows the question to replica 0
    assert exact["imbalance"] <= 1.25
    # With room for everything, whatever the exact router misses it missed by steering away from the prefix.
    assert exact["missed"]["absent"] == 0
    # (up to the last prompt token, which is always computed, so a fully cached prompt hits one token short)
    assert abs(exact["missed"]["other"]) < 0.005
    # It steers away at most from the question and a few conversations moved for balance.
    assert 0 < exact["missed"]["steered"] < 0.25 * big["hit_rate"]


def test_misses_of_prefixes_no_replica_still_holds_count_as_absent() -> None:
    requests = _conversations(num=8, turns=3)
    big = route.simulate(requests, 1, 40_000, "round-robin")
    # Each replica fits about one conversation's history (<= 1,300 tokens): the interleaving evicts the rest.
    oracle = route.simulate(requests, 2, 90, "oracle", big["hits"])
    assert oracle["missed"]["steered"] == 0
    assert oracle["missed"]["absent"] > 0.3
    assert oracle["hit_rate"] < big["hit_rate"] - 0.3


def _uneven_answers(num: int) -> list[ReplayRequest]:
    """``num`` two-turn conversations opening with an 800-token document; answers run long, short, short, long ..."""
    out = []
    history = {c: array(TOKEN_TYPECODE) for c in range(num)}
    for t in range(2):
        for c in range(num):
            start = 100_000 * c + 10_000 * t
            prompt = history[c] + array(TOKEN_TYPECODE, range(start, start + (800 if t == 0 else 32)))
            answer_tokens = 1600 if c % 4 in (0, 3) else 16
            answer = array(TOKEN_TYPECODE, range(start + 5000, start + 5000 + answer_tokens))
            out.append(ReplayRequest("synthetic", f"conv{c}", t, prompt, answer))
            history[c] = prompt + answer
    return out


def test_the_exact_router_fills_replicas_memory_evenly_when_together_they_barely_hold_the_working_set(
    monkeypatch,
) -> None:
    requests = _uneven_answers(8)
    per_replica = route.working_set_blocks(requests) // 2 + 4
    big = route.simulate(requests, 1, 2 * per_replica, "round-robin")
    exact = route.simulate(requests, 2, per_replica, "exact", big["hits"])
    # New conversations go where memory is free, so both replicas end up holding their conversations whole.
    assert exact["hit_rate"] == pytest.approx(big["hit_rate"])
    assert exact["missed"]["absent"] == 0
    assert exact["imbalance"] <= 1.25
    # Balancing request counts alone puts both long conversations of each four on one replica, which overflows and
    # evicts the first turns that come back next.
    monkeypatch.setattr(route, "MEMORY_WEIGHT", 0.0)
    counts_only = route.simulate(requests, 2, per_replica, "exact", big["hits"])
    assert counts_only["missed"]["absent"] > 0.05
    assert counts_only["hit_rate"] < big["hit_rate"] - 0.05


def test_at_eight_replicas_the_exact_router_is_also_measured_at_other_memory_sizes() -> None:
    requests = _conversations(num=16, turns=3)

    result = route.measure(requests, (route.REPLICA_SHARE,), show_progress=False)

    by_memory = result["exact_by_memory"]
    assert tuple(by_memory) == route.MEMORY_SHARES
    # 16 conversations, no shared prefix: with room to spare (1/6 of the working set each) the exact router keeps
    # every conversation where it is cached, as one big replica does.
    assert by_memory[6] == pytest.approx(1.0)
    assert all(0 < ratio <= 1.0 + 1e-9 for ratio in by_memory.values())
    assert route.measure(requests, (2,), show_progress=False)["exact_by_memory"] == {}


@pytest.mark.parametrize("order", route.ORDERS)
def test_other_orders_keep_every_request_and_each_conversations_turn_order(order: str) -> None:
    requests = _conversations(num=9, turns=4)

    other = route.reordered(requests, order, seed=1)

    assert other is not None
    assert sorted(map(id, other)) == sorted(map(id, requests))
    assert other != requests  # 36 requests: a seeded reorder that changed nothing would be a broken shuffle
    for c in range(9):
        assert [r.turn for r in other if r.conversation_id == f"conv{c}"] == [0, 1, 2, 3]
    assert route.reordered(requests, order, seed=1) == other  # seeded


def test_a_trace_keeps_its_order_and_an_unknown_order_is_refused() -> None:
    single = _conversations(num=6, turns=1)
    assert route.reordered(single, "random", seed=0) is None
    with pytest.raises(InvalidArgumentError, match="unknown order"):
        route.reordered(_conversations(num=3, turns=2), "sorted", seed=0)


def test_at_eight_replicas_the_exact_router_is_also_measured_in_other_orders() -> None:
    requests = _conversations(num=16, turns=3)

    by_order = route.measure(requests, (route.REPLICA_SHARE,), show_progress=False)["exact_by_order"]

    assert tuple(by_order) == route.ORDERS
    for runs in by_order.values():
        assert [x["seed"] for x in runs] == list(route.ORDER_SEEDS)
        assert all(x["exact_load"] <= 1.25 for x in runs)
    # No shared prefix, two conversations a replica: in round-robin orders each stays where it is cached, as good as
    # one big replica; in random orders a conversation that runs ahead of the others is sometimes moved by the load
    # guard (at most a few of its 16 x 2 later turns).
    assert all(x["exact"] == pytest.approx(1.0) for x in by_order["shuffled"])
    assert all(0.9 <= x["exact"] <= 1.0 for x in by_order["random"])
    # Round-robin over 16 conversations lines up with 8 replicas in round-robin orders (each turn lands where the
    # previous one did); in random orders it does not.
    assert all(x["round_robin"] == pytest.approx(1.0) for x in by_order["shuffled"])
    assert all(x["round_robin"] < 0.5 for x in by_order["random"])
    single_turns = _conversations(num=16, turns=1)
    assert route.measure(single_turns, (route.REPLICA_SHARE,), show_progress=False)["exact_by_order"] == {}


def test_an_unknown_order_is_refused_for_a_trace_too() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown order"):
        route.reordered(_conversations(num=6, turns=1), "sorted", seed=0)


def test_an_unknown_router_is_refused_rather_than_run_as_the_oracle() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown router"):
        route.simulate(_conversations(num=2, turns=2), 2, 64, "exactt")


@pytest.mark.parametrize("router", route.ROUTERS)
def test_simulating_no_requests_or_no_replica_raises_the_package_error(router: str) -> None:
    with pytest.raises(InvalidArgumentError):
        route.simulate([], 2, 64, router)
    with pytest.raises(InvalidArgumentError):
        route.simulate(_conversations(num=2, turns=1), 0, 64, router)


def test_measuring_no_requests_raises_the_package_error() -> None:
    with pytest.raises(InvalidArgumentError):
        route.measure([], (2,), show_progress=False)
