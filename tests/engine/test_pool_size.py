"""The default pool of `prefixcache serve`: a share of the free memory, at most max_running full-context sessions."""

from __future__ import annotations

import pytest

from prefixcache.cache.pool import kv_bytes_per_token
from prefixcache.engine.pool_size import MIN_POOL_BLOCKS, available_memory, check_default_pool, default_pool_size
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
    assert main(["serve", "--no-engine-process", "--max-running", "2"]) == 0
    assert seen["tokens"] == 2 * build_model("tiny").max_position
    out = capsys.readouterr().out
    assert f"{seen['tokens']:,} tokens of KV" in out and "2 sessions of" in out
    assert "2 x the model's context" in out

    monkeypatch.setattr(pool_size, "available_memory", lambda device: 64 * _per_token(build_model("tiny")) * 4)
    assert main(["serve", "--no-engine-process", "--memory-fraction", "0.5"]) == 0
    assert seen["tokens"] == 128 and "0.5 of the free memory" in capsys.readouterr().out
    assert main(["serve", "--no-engine-process", "--memory-fraction", "2"]) == 2


def test_a_default_pool_under_two_blocks_is_refused_naming_its_size(tiny) -> None:
    one_block = default_pool_size(tiny, 16, available_bytes=0)

    with pytest.raises(InvalidArgumentError) as refused:
        check_default_pool(one_block, 16)

    assert MIN_POOL_BLOCKS == 2
    assert "the default pool would be 1 block of 16 tokens (16 tokens of KV" in str(refused.value)
    assert "needs at least 2" in str(refused.value) and "--cache-tokens" in str(refused.value)


def test_a_default_pool_shorter_than_the_context_gets_a_warning_and_a_full_one_none(tiny) -> None:
    two_blocks = default_pool_size(tiny, 16, available_bytes=32 * _per_token(tiny) * 4)
    full = default_pool_size(tiny, 16, sessions=1, available_bytes=1 << 40)

    warning = check_default_pool(two_blocks, 16)

    assert two_blocks.num_tokens == 32 and full.num_tokens == tiny.max_position
    assert warning is not None
    assert "(32 tokens of KV, sized by memory) cannot hold one request of the model's full context" in warning
    assert f"({tiny.max_position:,} tokens)" in warning
    assert check_default_pool(full, 16) is None


def test_serve_refuses_a_default_pool_under_two_blocks_and_warns_of_a_short_one(monkeypatch, capsys, caplog) -> None:
    pytest.importorskip("fastapi", reason="needs: pip install 'prefixcache[server]'")
    import prefixcache.engine.pool_size as pool_size
    import prefixcache.serve
    from prefixcache.cli import main

    served = []

    def serve_forever(app, host, port, *, log_level, announce) -> None:
        served.append(app.state.runner.pool.capacity_tokens)
        app.state.engine.close()

    monkeypatch.setattr(prefixcache.serve, "serve_forever", serve_forever)
    per_token = _per_token(build_model("tiny"))
    monkeypatch.setattr(pool_size, "available_memory", lambda device: 31 * per_token * 4)  # a quarter: 1 block
    assert main(["serve", "--no-engine-process"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the default pool would be 1 block of 16 tokens")
    assert served == []

    monkeypatch.setattr(pool_size, "available_memory", lambda device: 64 * per_token * 4)
    with caplog.at_level("WARNING", logger="prefixcache.cli.serve"):
        assert main(["serve", "--no-engine-process"]) == 0
    assert served == [64]
    warnings = [r.getMessage() for r in caplog.records if r.name == "prefixcache.cli.serve"]
    assert len(warnings) == 1 and "cannot hold one request of the model's full context" in warnings[0]
