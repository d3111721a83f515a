"""``prefixcache bench snapshot``: saves of a filled cache beside a streaming request, on the engine thread and on the
writer thread, each saving the whole cache."""

from __future__ import annotations

import pytest

from prefixcache.bench import snapshot

pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")


def test_each_way_saves_the_whole_filled_cache_beside_the_stream() -> None:
    result = snapshot.run(quick=True)

    saves = result.data["saves"]
    assert [save["way"] for save in saves] == list(snapshot.WAYS)
    # The filled cache plus the streaming request's prompt (inserted when prefilled) and, once one has finished,
    # its answer; nothing of the filled cache was evicted.
    assert all(save["num_tokens"] >= snapshot.QUICK_TOKENS + len(snapshot.STREAM_PROMPT) for save in saves)
    assert all(save["num_tokens"] < snapshot.QUICK_TOKENS + 2 * snapshot.STREAM_TOKENS for save in saves)
    assert all(save["kv_bytes"] == save["num_blocks"] * 16 * 512 for save in saves)
    assert all(0 < save["engine_thread_s"] <= save["save_s"] for save in saves)
    assert len(result.tables[0].rows) == 2


def test_the_longest_gap_counts_a_stall_that_begins_with_the_window() -> None:
    assert snapshot.longest_gap_s([1.0, 1.5, 4.0], 0.5, 4.5) == 2.5
    assert snapshot.longest_gap_s([], 2.0, 3.0) == 1.0
