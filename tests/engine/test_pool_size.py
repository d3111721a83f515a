"""The default pool of `prefixcache serve`: a share of the free memory, at most max_running full-context sessions."""

from __future__ import annotations

import pytest

from prefixcache.cache.pool import kv_bytes_per_token
from prefixcache.engine.pool_size import available_memory, default_pool_size
from prefixcache.errors import InvalidArgumentError
from prefixcache.models import build_model


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny")


def _per_token(model) -> int:
    return kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, model.dtype)


def test_plenty_of_memory_gives_max_running_sessions_of_the_full_context(tiny) -> None:
    size = default_pool_size(tiny, 16, sessions=4, available_bytes=1 << 40)

    assert size.num_tokens == 4 * tiny.max_position and size.bound == "sessions"
    assert size.sessions == 4 and size.num_bytes == size.num_tokens * _per_token(tiny)


def test_scarce_memory_gives_the_fraction_in_whole_blocks(tiny) -> None:
    per_token = _per_token(tiny)
    size = default_pool_size(tiny, 16, memory_fraction=0.5, available_bytes=1000 * per_token + 7)

    assert size.bound == "memory"
    assert size.num_tokens == 496  # 500 tokens fit in half, rounded down to 31 blocks of 16
    assert size.sessions == 0 and "496 tokens of KV" in size.describe()


def test_too_little_memory_still_gives_one_block_and_bad_arguments_are_refused(tiny) -> None:
    assert default_pool_size(tiny, 16, available_bytes=0).num_tokens == 16
    for kwargs in ({"memory_fraction": 0.0}, {"memory_fraction": 1.5}, {"sessions": 0}):
        with pytest.raises(InvalidArgumentError):
            default_pool_size(tiny, 16, available_bytes=1 << 30, **kwargs)


def test_the_cpus_available_memory_is_read() -> None:
    assert available_memory("cpu") > 0


def test_serve_without_a_size_announces_the_pool_it_sized(monkeypatch, capsys) -> None:
    pytest.importorskip("fastapi", reason="needs: pip install 'prefixcache[server]'")
    import prefixcache.engine.pool_size as pool_size
    import prefixcache.serve
    from prefixcache.cli import main

    seen = {}

    def serve_forever(app, host, port, *, log_level, announce) -> None:
        announce("http://127.0.0.1:1")
        seen["tokens"] = app.state.runner.pool.capacity_tokens
        app.state.engine.close()

    monkeypatch.setattr(prefixcache.serve, "serve_forever", serve_forever)
    monkeypatch.setattr(pool_size, "available_memory", lambda device: 1 << 40)
    assert main(["serve", "--max-running", "2"]) == 0
    assert seen["tokens"] == 2 * build_model("tiny").max_position
    out = capsys.readouterr().out
    assert f"{seen['tokens']:,} tokens of KV" in out and "2 sessions of" in out
    assert "2 x the model's context" in out

    monkeypatch.setattr(pool_size, "available_memory", lambda device: 64 * _per_token(build_model("tiny")) * 4)
    assert main(["serve", "--memory-fraction", "0.5"]) == 0
    assert seen["tokens"] == 128 and "0.5 of the free memory" in capsys.readouterr().out
    assert main(["serve", "--memory-fraction", "2"]) == 2
