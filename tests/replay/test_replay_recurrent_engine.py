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
