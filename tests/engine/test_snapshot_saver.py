"""``BatchEngine.save_snapshot``: the copy is taken between two steps, the files are written on a writer thread while
the engine streams on, and the saved snapshot is what was cached at the copy, whatever the engine did after it."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.cache.snapshot import writer as snapshot_write
from prefixcache.engine.batching import BatchEngine
from prefixcache.errors import InvalidArgumentError, SnapshotWriteError
from prefixcache.models.llama import LlamaModel
from prefixcache.testing import assert_quiescent

pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")

WAIT_S = 60  # only so that a broken engine fails the test instead of hanging it; nothing is timed
GREEDY = SamplingParams(max_new_tokens=4)
PROMPTS = [list(range(1, 90)), list(range(1, 40)) + list(range(200, 250)), list(range(300, 380))]


class BlockedWriter:
    """Makes the snapshot writer wait on :attr:`release` when it starts its first file (:attr:`writing` is set then)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.writing = threading.Event()
        self.release = threading.Event()
        real = snapshot_write._write_file

        def write_file(path: Path, data) -> None:
            self.writing.set()
            assert self.release.wait(WAIT_S), "the test never released the writer"
            real(path, data)

        monkeypatch.setattr(snapshot_write, "_write_file", write_file)


@pytest.fixture
def engine(tiny: LlamaModel) -> Iterator[BatchEngine]:
    engine = BatchEngine(PrefixCachingRunner(tiny, cache_tokens=512))  # 32 blocks of 16 tokens
    engine.start()
    yield engine
    engine.close()


def cache_prompts(engine: BatchEngine, prompts: list[list[int]]) -> None:
    for handle in [engine.submit(prompt, GREEDY) for prompt in prompts]:
        handle.result(timeout=WAIT_S)


def cached(runner: PrefixCachingRunner) -> list[list[int]]:
    return sorted(runner.cache.cached_sequences(runner.namespace_key(None)))


def test_the_engine_streams_while_the_snapshot_files_are_written(
    engine: BatchEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_prompts(engine, PROMPTS[:1])
    writer = BlockedWriter(monkeypatch)
    saving = engine.save_snapshot(tmp_path / "snap")
    assert writer.writing.wait(WAIT_S)

    streamed: list[int] = []
    stream = SamplingParams(max_new_tokens=12)
    result = engine.submit(PROMPTS[1], stream, on_token=lambda token: streamed.append(token)).result(timeout=WAIT_S)

    # Every token streamed and the request finished while the writer was still held on its first file.
    assert len(streamed) == len(result.token_ids) == 12
    assert not saving.done() and not writer.release.is_set()
    writer.release.set()
    summary = saving.result(timeout=WAIT_S)
    assert summary.num_tokens == len(PROMPTS[0]) + GREEDY.max_new_tokens - 1
    assert_quiescent(engine.runner.cache)


def test_the_snapshot_is_the_cache_at_the_copy_though_its_blocks_are_reused_after(
    engine: BatchEngine, tiny: LlamaModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = engine.runner
    cache_prompts(engine, PROMPTS)
    at_copy = cached(runner)
    writer = BlockedWriter(monkeypatch)
    saving = engine.save_snapshot(tmp_path / "snap")
    assert writer.writing.wait(WAIT_S)

    # While the files wait: everything is evicted and other prompts compute their K/V into the freed blocks.
    engine.call_soon(runner.cache.evict_all).result(timeout=WAIT_S)
    cache_prompts(engine, [list(range(400, 490)), list(range(100, 190)), list(range(20, 110))])
    assert not set(map(tuple, cached(runner))) & set(map(tuple, at_copy))
    used_after = runner.cache.stats().used_blocks
    writer.release.set()
    summary = saving.result(timeout=WAIT_S)
    # The freed pool hands out its lowest ids first: the blocks the copy was taken from were all written again.
    assert used_after >= summary.num_blocks

    restored = PrefixCachingRunner(tiny, cache_tokens=4096)
    restored.load_snapshot(tmp_path / "snap")
    assert cached(restored) == at_copy
    for sequence in at_copy:
        prompt = [*sequence, 7]
        result = restored.generate(prompt, GREEDY, return_logits=True)
        assert result.usage.cached_tokens == len(sequence)
        reference = tiny.forward_reference(torch.tensor(prompt), return_logits=True).float()
        assert float((result.prompt_logits - reference[len(sequence) :]).abs().max()) < 1e-4
    assert_quiescent(restored.cache)
    assert_quiescent(runner.cache)


def test_a_write_failure_on_the_writer_thread_reaches_the_caller_and_keeps_the_previous_version(
    engine: BatchEngine, tiny: LlamaModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "snap"
    cache_prompts(engine, PROMPTS[:1])
    first = engine.save_snapshot(folder).result(timeout=WAIT_S)
    at_first = cached(engine.runner)
    cache_prompts(engine, PROMPTS[1:])

    def failing_sync(path: Path) -> None:
        raise OSError(errno.EIO, "injected I/O error")

    with monkeypatch.context() as patch:
        patch.setattr(snapshot_write, "_fsync_dir", failing_sync)
        with pytest.raises(SnapshotWriteError, match="injected I/O error") as raised:
            engine.save_snapshot(folder).result(timeout=WAIT_S)
    assert raised.value.errno == errno.EIO

    assert sorted(os.listdir(folder)) == ["CURRENT", Path(first.path).name]
    restored = PrefixCachingRunner(tiny, cache_tokens=4096)
    assert restored.load_snapshot(folder).num_tokens == first.num_tokens
    assert cached(restored) == at_first
    assert engine.submit(PROMPTS[2], GREEDY).result(timeout=WAIT_S).usage.cached_tokens == len(PROMPTS[2]) - 1
    assert_quiescent(engine.runner.cache)


def test_a_save_asked_for_during_another_waits_for_it_and_a_third_into_the_folder_joins_the_second(
    engine: BatchEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "snap"
    cache_prompts(engine, PROMPTS[:1])
    writer = BlockedWriter(monkeypatch)
    first = engine.save_snapshot(folder)
    assert writer.writing.wait(WAIT_S)
    second = engine.save_snapshot(folder)
    cache_prompts(engine, PROMPTS[1:2])  # cached after the first copy, before the second
    third = engine.save_snapshot(folder)
    assert second is not third and not (first.done() or second.done() or third.done())

    writer.release.set()
    one, two, three = (future.result(timeout=WAIT_S) for future in (first, second, third))
    assert one.path != two.path and two == three  # one save answered both calls
    assert two.num_tokens > one.num_tokens
    assert sorted(os.listdir(folder)) == ["CURRENT", Path(two.path).name]


def test_close_fails_the_saves_not_started_and_waits_for_the_one_being_written(
    engine: BatchEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_prompts(engine, PROMPTS[:1])
    writer = BlockedWriter(monkeypatch)
    written = engine.save_snapshot(tmp_path / "a")
    assert writer.writing.wait(WAIT_S)
    queued = engine.save_snapshot(tmp_path / "b")
    closing = threading.Thread(target=engine.close)
    closing.start()

    assert isinstance(queued.exception(timeout=WAIT_S), RuntimeError)
    assert closing.is_alive() and not written.done()  # close() waits for the save being written
    writer.release.set()
    closing.join(WAIT_S)
    assert not closing.is_alive()
    assert written.result(timeout=0).num_tokens > 0
    assert not (tmp_path / "b").exists()
    with pytest.raises(InvalidArgumentError, match="closed"):
        engine.save_snapshot(tmp_path / "a")


def test_a_save_needs_a_path(engine: BatchEngine) -> None:
    with pytest.raises(InvalidArgumentError, match="must be a path"):
        engine.save_snapshot(42)


def test_a_host_tier_is_copied_and_written_beside_the_device_tree(tiny: LlamaModel, tmp_path: Path) -> None:
    document, other = list(range(60, 156)), list(range(300, 427))  # 6 blocks; then the whole 8-block device pool
    engine = BatchEngine(PrefixCachingRunner(tiny, num_blocks=8, block_size=16, host_cache_tokens=512))
    engine.start()
    try:
        for prompt in (document, other):
            engine.submit(prompt, SamplingParams(max_new_tokens=1)).result(timeout=WAIT_S)
        saved = engine.save_snapshot(tmp_path / "snap").result(timeout=WAIT_S)
    finally:
        engine.close()
    assert (saved.num_tokens, saved.host_runs, saved.host_tokens, saved.host_blocks) == (127, 1, 96, 6)

    restored = PrefixCachingRunner(tiny, num_blocks=8, block_size=16, host_cache_tokens=512)
    restored.load_snapshot(tmp_path / "snap")
    prompt = [*document, 1, 2, 3, 4]
    result = restored.generate(prompt, SamplingParams(max_new_tokens=1), return_logits=True)
    assert (result.usage.cached_tokens, result.usage.host_cached_tokens) == (96, 96)
    reference = tiny.forward_reference(torch.tensor(prompt), return_logits=True).float()
    assert float((result.prompt_logits - reference[96:]).abs().max()) < 1e-4
    assert_quiescent(restored.cache)
