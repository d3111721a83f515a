"""The ``--no-model --state-bytes`` replay models what a hybrid model's engine does: the same requests, replayed
without a model and through a tiny Qwen3-Next, find the same cached (resumed) tokens request by request — behind a
shared system prompt (the second conversation marks where it parts, the third resumes there), at a chat's next turn,
and at an edited message."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs: pip install 'prefixcache[hf]'")

from prefixcache.models.hf_tiny import tiny_random_model  # noqa: E402
from prefixcache.replay.replayer import Replayer, ReplayRequest  # noqa: E402

BS = 16


def tokens(start: int, n: int) -> list[int]:
    return [1 + (start + i) % 290 for i in range(n)]


SYSTEM = tokens(0, 70)
A1, B1, C1 = SYSTEM + tokens(100, 12), SYSTEM + tokens(130, 9), SYSTEM + tokens(160, 15)
ANSWERS = {name: tokens(200 + 7 * i, 5) for i, name in enumerate("abcdefg")}
REQUESTS = [
    ReplayRequest("chat", "a", 1, A1, ANSWERS["a"]),
    ReplayRequest("chat", "b", 1, B1, ANSWERS["b"]),
    ReplayRequest("chat", "c", 1, C1, ANSWERS["c"]),
    ReplayRequest("chat", "a", 2, A1 + ANSWERS["a"] + tokens(40, 20), ANSWERS["d"]),
    # The user of a edits the second message after its 8th token, twice.
    ReplayRequest("chat", "e", 2, A1 + ANSWERS["a"] + tokens(40, 8) + tokens(250, 6), ANSWERS["e"]),
    ReplayRequest("chat", "f", 2, A1 + ANSWERS["a"] + tokens(40, 8) + tokens(270, 6), ANSWERS["f"]),
    ReplayRequest("chat", "g", 1, SYSTEM + tokens(180, 30), ANSWERS["g"]),
]


def cached_per_request(replayer: Replayer) -> list[int]:
    log: list[dict] = []
    replayer.replay("chat", REQUESTS, log=log)
    return [record["usage"]["prompt_tokens_details"]["cached_tokens"] for record in log]


def test_the_no_model_replay_resumes_where_the_engine_does() -> None:
    model = tiny_random_model("qwen3_next", max_positions=1024)
    engine = cached_per_request(Replayer(model, block_size=BS, cache_tokens=4096, measure_uncached=False))
    modelled = cached_per_request(Replayer(None, block_size=BS, cache_tokens=4096, state_bytes=model.state_bytes))
    assert modelled == engine
    a_turn = len(A1) + len(ANSWERS["a"])
    # b finds no state inside the system prompt; c and g resume all of it (b marked 70); a's next turn resumes its
    # answer; the first edit resumes there too and marks the edit, the second resumes at the edit.
    assert engine == [0, 0, 70, a_turn, a_turn, a_turn + 8, 70]


@pytest.fixture(scope="module")
def qwen3_next():
    return tiny_random_model("qwen3_next", max_positions=1024)


@pytest.mark.parametrize(("block_size", "state_every", "budget_states"), [(16, 0, 4), (16, 2, 4), (4, 1, 6)])
def test_under_a_tight_state_budget_the_no_model_replay_evicts_the_states_the_engine_does(
    qwen3_next, block_size: int, state_every: int, budget_states: int
) -> None:
    # The budget evicts by value as states are put: the replay must put them in the engine's order (the states its
    # prefill passes, then the prompt's end, then before its last token), or it keeps others.
    from prefixcache.engine.runner import PrefixCachingRunner

    model = qwen3_next
    budget = budget_states * model.state_bytes
    runner = PrefixCachingRunner(
        model, cache_tokens=4096, block_size=block_size, state_interval_blocks=state_every, state_cache_memory=budget
    )
    engine = [runner.generate(r.prompt, forced_tokens=r.answer).usage.cached_tokens for r in REQUESTS]
    modelled = cached_per_request(
        Replayer(
            None,
            block_size=block_size,
            cache_tokens=4096,
            state_bytes=model.state_bytes,
            state_every=state_every,
            max_state_bytes=budget,
        )
    )
    assert modelled == engine
    assert any(engine)  # the budget keeps some: the order is what is tested
