"""Many threads on one runner and one cache: outputs equal a serial run, invariants hold after every request,
cancelled requests release what they held, and a full eviction afterwards frees every block."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from prefixcache import KVBlockPool, Lease, PrefixCachingRunner, RadixCache, SamplingParams
from prefixcache.errors import OutOfBlocksError
from prefixcache.testing import assert_quiescent

NUM_THREADS = 8
BLOCK_SIZE = 4
SEED = 20240607
# The runner test runs once per block size: block-aligned and not, one token to a whole 16-token block.  Together
# they serve about as many requests as one run of 50 requests per thread did.
RUNNER_BLOCK_SIZES = [1, 5, 16]
REQUESTS_PER_THREAD = 17
POOL_TOKENS = 320


class Cancelled(Exception):
    """Raised by a stream callback to abandon a request."""


@pytest.fixture
def frequent_thread_switches() -> Iterator[None]:
    # Switch between Python threads every microsecond rather than every 5 ms, so bookkeeping interleaves finely.
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@dataclass(frozen=True, slots=True)
class Spec:
    """One request of the workload and how a worker treats it the first time (``"cancel"``: close the stream
    after the first token; ``"raise"``: raise from ``on_token``; both are retried in full afterwards)."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    namespace: str | None
    first_try: str


def workload(seed: int) -> list[list[Spec]]:
    """Per thread, requests over three shared system prompts (lengths 9, 13, 14: block-aligned and not) with
    user turns drawn from a small set, so that prefixes are shared, split inside blocks, and repeated."""
    rng = random.Random(seed)
    systems = [list(range(1, 10)), list(range(100, 113)), list(range(100, 110)) + [200, 201, 202, 203]]
    turns = [[rng.randrange(300, 500) for _ in range(rng.randrange(1, 9))] for _ in range(12)]
    per_thread = []
    for _ in range(NUM_THREADS):
        specs = []
        for _ in range(REQUESTS_PER_THREAD):
            prompt = rng.choice(systems) + rng.choice(turns)
            if rng.random() < 0.3:
                prompt += rng.choice(turns)
            first_try = rng.choices(["plain", "stream", "cancel", "raise"], weights=[6, 2, 1, 1])[0]
            namespace = rng.choice([None, None, "tenant-b"])
            specs.append(Spec(tuple(prompt), rng.randrange(1, 5), namespace, first_try))
        per_thread.append(specs)
    return per_thread


def run(runner: PrefixCachingRunner, spec: Spec) -> tuple[int, ...]:
    sampling = SamplingParams(max_new_tokens=spec.max_new_tokens)
    return runner.generate(list(spec.prompt), sampling, namespace=spec.namespace).token_ids


@pytest.mark.parametrize("block_size", RUNNER_BLOCK_SIZES)
def test_eight_threads_of_requests_match_a_serial_run(model, frequent_thread_switches, block_size) -> None:
    specs = workload(SEED + block_size)
    num_blocks = POOL_TOKENS // block_size
    serial_runner = PrefixCachingRunner(model, num_blocks=num_blocks, block_size=block_size)
    expected = [[run(serial_runner, spec) for spec in thread_specs] for thread_specs in specs]
    assert_quiescent(serial_runner.cache)

    # 320 tokens, far fewer than the workload's distinct prefixes, so eviction never stops.
    runner = PrefixCachingRunner(model, num_blocks=num_blocks, block_size=block_size)
    results: list[list[tuple[int, ...] | None]] = [[None] * REQUESTS_PER_THREAD for _ in range(NUM_THREADS)]
    errors: list[BaseException] = []
    counts = {"checks": 0, "cancelled": 0, "raised": 0, "out_of_blocks": 0}
    counts_lock = threading.Lock()
    start = threading.Barrier(NUM_THREADS)

    def count(name: str) -> None:
        with counts_lock:
            counts[name] += 1

    def cancel_after_first_token(spec: Spec) -> None:
        steps = runner.stream(
            list(spec.prompt), SamplingParams(max_new_tokens=spec.max_new_tokens), namespace=spec.namespace
        )
        next(steps)
        steps.close()
        count("cancelled")

    def raise_from_callback(spec: Spec) -> None:
        def on_token(token: int) -> None:
            raise Cancelled

        steps = runner.stream(
            list(spec.prompt),
            SamplingParams(max_new_tokens=spec.max_new_tokens),
            namespace=spec.namespace,
            on_token=on_token,
        )
        with pytest.raises(Cancelled):
            next(steps)
        count("raised")

    def streamed(spec: Spec) -> tuple[int, ...]:
        seen: list[int] = []
        steps = runner.stream(
            list(spec.prompt),
            SamplingParams(max_new_tokens=spec.max_new_tokens),
            namespace=spec.namespace,
            on_token=seen.append,
        )
        yielded = list(steps)
        assert yielded == seen
        return tuple(yielded)

    def worker(index: int) -> None:
        rng = random.Random(SEED + index)
        try:
            start.wait()
            for j, spec in enumerate(specs[index]):
                time.sleep(rng.random() * 1e-3)
                if spec.first_try == "cancel":
                    cancel_after_first_token(spec)
                    runner.cache.check_invariants()
                elif spec.first_try == "raise":
                    raise_from_callback(spec)
                    runner.cache.check_invariants()
                while True:
                    try:
                        tokens = streamed(spec) if spec.first_try == "stream" else run(runner, spec)
                        break
                    except OutOfBlocksError:
                        # Other threads hold the pool; the request released everything, so try again.
                        count("out_of_blocks")
                        time.sleep(1e-3)
                results[index][j] = tokens
                runner.cache.check_invariants()
                count("checks")
        except BaseException as error:  # noqa: BLE001 - reported below, in the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(NUM_THREADS)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    elapsed = time.perf_counter() - began

    assert not any(thread.is_alive() for thread in threads), "a worker hung"
    assert not errors, errors[0]
    assert results == expected
    assert counts["checks"] == NUM_THREADS * REQUESTS_PER_THREAD
    assert counts["cancelled"] > 0 and counts["raised"] > 0
    stats = runner.cache.stats()
    assert stats.evictions > 0 and stats.hit_tokens > 0
    assert_quiescent(runner.cache)
    runner.cache.evict_all()
    assert runner.cache.stats().cached_tokens == 0
    assert runner.pool.num_free_blocks == runner.pool.num_blocks
    assert sorted(runner.pool.free_block_ids().tolist()) == list(range(runner.pool.num_blocks))
    print(
        f"\nblock size {block_size}: {NUM_THREADS} threads x {REQUESTS_PER_THREAD} requests in {elapsed:.2f} s: "
        f"{counts}, "
        f"hit {stats.hit_tokens}/{stats.query_tokens} tokens, {stats.evictions} evictions"
    )


def test_a_stream_closed_midway_releases_what_it_held_and_caches_nothing(model) -> None:
    runner = PrefixCachingRunner(model, num_blocks=32, block_size=BLOCK_SIZE)
    runner.generate(list(range(1, 11)), SamplingParams(max_new_tokens=2))
    before = runner.cache.cached_sequences(runner.namespace_key(None))

    steps = runner.stream(list(range(1, 7)) + [50, 51], SamplingParams(max_new_tokens=6))
    next(steps)
    next(steps)
    assert runner.cache.stats().locked_tokens > 0
    steps.close()

    assert_quiescent(runner.cache)
    assert runner.cache.cached_sequences(runner.namespace_key(None)) == before


def test_an_exception_in_the_stream_callback_releases_what_it_held_and_caches_nothing(model) -> None:
    runner = PrefixCachingRunner(model, num_blocks=32, block_size=BLOCK_SIZE)
    runner.generate(list(range(1, 11)), SamplingParams(max_new_tokens=2))
    before = runner.cache.cached_sequences(runner.namespace_key(None))
    seen: list[int] = []

    def on_token(token: int) -> None:
        seen.append(token)
        if len(seen) == 3:
            raise Cancelled

    with pytest.raises(Cancelled):
        list(runner.stream(list(range(1, 7)) + [50, 51], SamplingParams(max_new_tokens=6), on_token=on_token))

    assert len(seen) == 3
    assert_quiescent(runner.cache)
    assert runner.cache.cached_sequences(runner.namespace_key(None)) == before


def test_an_abandoned_stream_releases_when_collected_and_an_unstarted_one_holds_nothing(model) -> None:
    runner = PrefixCachingRunner(model, num_blocks=32, block_size=BLOCK_SIZE)
    unstarted = runner.stream(list(range(1, 9)), SamplingParams(max_new_tokens=3))
    assert runner.cache.stats().used_blocks == 0
    unstarted.close()

    abandoned = runner.stream(list(range(1, 9)), SamplingParams(max_new_tokens=3))
    next(abandoned)
    assert runner.cache.stats().used_blocks > 0
    del abandoned  # CPython finalizes the generator now, which closes it

    assert_quiescent(runner.cache)
    assert runner.cache.stats().used_blocks == 0


def test_threads_hammering_the_cache_directly_keep_every_invariant(frequent_thread_switches) -> None:
    """acquire / reserve / commit or release, raw allocate + insert or free, match and evict, from 8 threads
    on a 24-block pool: running out of blocks is expected and must leave nothing behind."""
    cache = RadixCache(KVBlockPool(24, BLOCK_SIZE))
    prefixes = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9], [7, 7, 7, 7, 7, 7, 7, 7, 7], [8]]
    errors: list[BaseException] = []
    outcomes = {"committed": 0, "released": 0, "inserted": 0, "freed": 0, "out_of_blocks": 0, "checks": 0}
    outcomes_lock = threading.Lock()
    start = threading.Barrier(NUM_THREADS)

    def note(name: str) -> None:
        with outcomes_lock:
            outcomes[name] += 1

    def step(rng: random.Random, open_leases: list[tuple[Lease, list[int]]]) -> None:
        action = rng.random()
        tokens = rng.choice(prefixes) + [rng.randrange(10, 14) for _ in range(rng.randrange(0, 10))]
        namespace = rng.choice([None, "x"])
        if len(open_leases) < 2 and (action < 0.45 or not open_leases):
            lease = cache.acquire(tokens, namespace)
            extra = [rng.randrange(10, 14) for _ in range(rng.randrange(0, 6))]
            try:
                cache.reserve(lease, len(tokens) + len(extra))
            except OutOfBlocksError:
                cache.release(lease)
                raise
            open_leases.append((lease, tokens + extra))
        elif action < 0.75 or open_leases and len(open_leases) == 2:
            lease, full = open_leases.pop(rng.randrange(len(open_leases)))
            if rng.random() < 0.7:
                cache.commit(lease, full)
                note("committed")
            else:
                cache.release(lease)
                note("released")
        elif action < 0.85:
            blocks = cache.allocate(cache.pool.blocks_for_tokens(len(tokens)))
            if rng.random() < 0.8:
                cache.insert(tokens, blocks, namespace)
                note("inserted")
            else:
                cache.free(blocks)
                note("freed")
        elif action < 0.95:
            cache.match(tokens, namespace, for_prefill=rng.random() < 0.5)
        else:
            cache.evict(rng.randrange(1, 4))

    def worker(index: int) -> None:
        rng = random.Random(SEED * 7 + index)
        open_leases: list[tuple[Lease, list[int]]] = []
        try:
            start.wait()
            for _ in range(250):
                try:
                    step(rng, open_leases)
                except OutOfBlocksError:
                    note("out_of_blocks")
                cache.check_invariants()
                note("checks")
            for lease, full in open_leases:
                cache.commit(lease, full)
                note("committed")
        except BaseException as error:  # noqa: BLE001 - reported below, in the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(NUM_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert not any(thread.is_alive() for thread in threads), "a worker hung"
    assert not errors, errors[0]
    assert outcomes["committed"] > 100 and outcomes["out_of_blocks"] > 0
    assert_quiescent(cache)
    cache.evict_all()
    assert cache.stats().cached_tokens == 0 and cache.stats().num_nodes == 0
    assert cache.pool.num_free_blocks == cache.pool.num_blocks
