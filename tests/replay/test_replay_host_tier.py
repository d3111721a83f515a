"""Replay with a host-memory tier: the report splits the cached tokens by tier, a small device pool with the tier hits
more than alone and never more than the ideal, and ``--host-cache-memory`` needs a model."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.cli import main
from prefixcache.errors import InvalidArgumentError
from prefixcache.replay.replayer import Replayer, load_requests, replay_paths
from prefixcache.replay.report import format_replay

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "scenarios" / "multi_turn_chat.jsonl"


def test_a_host_tier_turns_capacity_misses_into_host_hits() -> None:
    requests, _ = load_requests(CHAT, ByteTokenizer())
    cache_tokens = max(len(r.prompt) + len(r.answer) for r in requests) + 16
    alone = replay_paths([CHAT], Replayer(None, cache_tokens=cache_tokens)).scenarios[0]
    report = replay_paths([CHAT], Replayer(None, cache_tokens=cache_tokens, host_cache_tokens=16 * cache_tokens))
    tiered = report.scenarios[0]
    assert alone.evictions > 0 and tiered.host_cached_tokens > 0
    assert alone.cached_tokens < tiered.cached_tokens <= tiered.ideal_cached_tokens
    assert tiered.device_hit_rate + tiered.host_hit_rate == pytest.approx(tiered.hit_rate)
    assert report.to_json()["host_hit_rate"] == pytest.approx(tiered.host_hit_rate)
    table = format_replay(report)
    assert "host rate" in table and f"{100 * tiered.host_hit_rate:.1f}%" in table


def test_without_a_host_tier_the_table_has_no_tier_columns() -> None:
    report = replay_paths([CHAT], Replayer(None))
    assert report.scenarios[0].host_cached_tokens == 0 and "host rate" not in format_replay(report)


def test_host_cache_memory_needs_a_model() -> None:
    with pytest.raises(InvalidArgumentError, match="--host-cache-memory needs a model"):
        Replayer(None, host_cache_memory=1 << 20)


def test_replay_command_takes_host_cache_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(CHAT), "--no-model", "--cache-tokens", "3100", "--host-cache-tokens", "12000"]) == 0
    assert "host rate" in capsys.readouterr().out
