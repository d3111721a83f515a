"""The ZMQ publisher and subscriber over real sockets on 127.0.0.1, and a subscriber written from vLLM's documented
protocol (raw pyzmq + plain msgpack) to check what goes on the wire.  Every wait is bounded."""

from __future__ import annotations

import logging
import threading
import time

import pytest

zmq = pytest.importorskip("zmq", reason="needs the [events] extra")
pytest.importorskip("msgspec", reason="needs the [events] extra")
msgpack = pytest.importorskip("msgpack", reason="the independent subscriber needs msgpack")

from prefixcache.cache.events import BlockIndex, BlockStored, block_hashes  # noqa: E402
from prefixcache.distributed.publisher import ZmqEventPublisher  # noqa: E402
from prefixcache.distributed.subscriber import ZmqEventSubscriber  # noqa: E402
from prefixcache.errors import ClosedError, InvalidArgumentError  # noqa: E402

TIMEOUT_MS = 5000


def _wire_blocks(cache, namespaces) -> set[tuple[None, int]]:
    """What a wire-fed index must hold: every full block of every cached sequence, keyed under None."""
    out = set()
    for ns in namespaces:
        for seq in cache.cached_sequences(ns):
            out.update((None, h) for h in block_hashes(seq, cache.block_size, ns, cache.hash_seed))
    return out


@pytest.fixture
def publisher():
    with ZmqEventPublisher() as pub:
        yield pub


def _raw_sub(endpoint: str):
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.connect(endpoint)
    return sub


def _raw_replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """vLLM's replay request from a DEALER: ``[b"", start]``; answers until the signed -1 end marker."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(TIMEOUT_MS), "replay answer timed out"
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close()


def test_an_independent_subscriber_reads_topic_seq_and_an_event_batch(make_cache, put, publisher) -> None:
    sub = _raw_sub(publisher.endpoint)
    try:
        cache = make_cache(num_blocks=32, block_size=2)
        cache.subscribe(publisher)
        # PUB drops messages until the subscription reaches it: send probes until one arrives.
        put(cache, [7, 7])
        for _ in range(50):
            if sub.poll(100):
                break
            cache.evict_all()
            put(cache, [7, 7])
        while sub.poll(200):
            sub.recv_multipart()
        put(cache, [1, 2, 3, 4, 5])
        assert publisher.flush()
        assert sub.poll(TIMEOUT_MS)
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv-events"
        assert len(seq) == 8 and int.from_bytes(seq, "big") == publisher.last_seq
        ts, events = msgpack.unpackb(payload)
        assert isinstance(ts, float)
        assert events == [["BlockStored", block_hashes([1, 2, 3, 4], 2), None, [1, 2, 3, 4], 2, None, None]]
    finally:
        sub.close()


def test_the_replay_endpoint_answers_every_buffered_batch_from_the_asked_sequence(make_cache, put, publisher) -> None:
    cache = make_cache(num_blocks=32, block_size=2)
    cache.subscribe(publisher)
    for tokens in ([1, 2], [3, 4], [5, 6]):
        put(cache, tokens)
        assert publisher.flush()
    assert publisher.last_seq == 2
    answered = _raw_replay(publisher.replay_endpoint, 1)
    assert [seq for seq, _ in answered] == [1, 2]
    assert [msgpack.unpackb(p)[1][0][3] for _, p in answered] == [[3, 4], [5, 6]]
    assert _raw_replay(publisher.replay_endpoint, 3) == []


def test_a_late_subscriber_mirrors_the_cache_exactly(make_cache, put, publisher) -> None:
    cache = make_cache(num_blocks=12, block_size=2)
    cache.subscribe(publisher)
    for i in range(8):  # more than fits: the early sequences are evicted again
        put(cache, [1, 2, 3, 4, 10 + i, 10 + i], "a" if i % 2 else None)
    assert publisher.flush()
    index = BlockIndex()
    with ZmqEventSubscriber(publisher.endpoint, publisher.replay_endpoint, index) as subscriber:
        assert subscriber.wait_for(publisher.last_seq)
        assert index.hashes == _wire_blocks(cache, [None, "a"])
        put(cache, [1, 2, 3, 4, 99, 99, 98, 98])
        cache.evict(2)
        assert publisher.flush()
        assert subscriber.wait_for(publisher.last_seq)
        assert index.hashes == _wire_blocks(cache, [None, "a"])
        cache.evict_all()
        assert publisher.flush()
        assert subscriber.wait_for(publisher.last_seq)
        assert index.hashes == set()
        assert subscriber.num_gaps == 0


def test_a_subscriber_joining_after_the_replay_buffer_wrapped_reports_a_gap(make_cache, put) -> None:
    with ZmqEventPublisher(buffer_batches=2) as publisher:
        cache = make_cache(num_blocks=32, block_size=2)
        cache.subscribe(publisher)
        for i in range(4):
            put(cache, [i, i])
            assert publisher.flush()
        index = BlockIndex(strict=False)
        with ZmqEventSubscriber(publisher.endpoint, publisher.replay_endpoint, index) as subscriber:
            assert subscriber.wait_for(publisher.last_seq)
            assert subscriber.num_gaps == 1
            assert index.hashes == {(None, h) for i in (2, 3) for h in block_hashes([i, i], 2)}


def test_publishing_only_enqueues_so_a_stalled_sender_never_blocks_the_cache(make_cache, put, publisher) -> None:
    release = threading.Event()
    real_send = publisher._send

    def stalled_send(events):
        release.wait(10)
        real_send(events)

    publisher._send = stalled_send
    cache = make_cache(num_blocks=64, block_size=2)
    cache.subscribe(publisher)
    worker = threading.Thread(target=lambda: [put(cache, [i, i, i, i]) for i in range(20)])
    worker.start()
    worker.join(5)
    stalled = worker.is_alive()
    release.set()
    assert not stalled, "cache inserts waited for the sender"
    assert publisher.flush()
    assert publisher.last_seq >= 0


def test_bad_sizes_are_rejected_before_any_socket_is_bound() -> None:
    with pytest.raises(InvalidArgumentError):
        ZmqEventPublisher(buffer_batches=0)


def test_an_endpoint_already_in_use_raises_and_closes_what_was_opened(publisher) -> None:
    with pytest.raises(zmq.ZMQError):
        ZmqEventPublisher(publisher.endpoint)


def test_closing_a_subscriber_after_its_publisher_is_quiet_and_prompt(caplog) -> None:
    publisher = ZmqEventPublisher()
    subscriber = ZmqEventSubscriber(
        publisher.endpoint, publisher.replay_endpoint, BlockIndex(), replay_timeout_s=5.0, resync_interval_s=0.1
    )
    assert subscriber.wait_for(-1)
    publisher.close()
    time.sleep(0.3)  # a resync's replay request is now waiting on the closed publisher
    with caplog.at_level(logging.DEBUG, logger="prefixcache.distributed.subscriber"):
        subscriber.close(timeout_s=5.0)
    assert not subscriber._thread.is_alive()
    assert not [r for r in caplog.records if "no complete answer" in r.getMessage()]


def test_a_gone_publisher_is_warned_about_once_per_outage(caplog) -> None:
    publisher = ZmqEventPublisher()
    endpoints = publisher.endpoint, publisher.replay_endpoint
    publisher.close()
    with caplog.at_level(logging.WARNING, logger="prefixcache.distributed.subscriber"):
        with ZmqEventSubscriber(*endpoints, BlockIndex(), replay_timeout_s=0.1, resync_interval_s=0.05) as sub:
            time.sleep(0.8)  # several resyncs, each timing out
            assert sub._replay_failures >= 3
    assert len([r for r in caplog.records if "no complete answer" in r.getMessage()]) == 1


def test_a_closed_publisher_refuses_events_and_its_flush_does_not_wait(make_cache, put) -> None:
    publisher = ZmqEventPublisher()
    cache = make_cache(num_blocks=16, block_size=2)
    cache.subscribe(publisher)
    put(cache, [1, 2])
    publisher.close()
    publisher.close()  # idempotent
    last = publisher.last_seq
    assert last == 0
    with pytest.raises(ClosedError):
        publisher(BlockStored(None, (1,), 0, 0, (1, 2), 2))
    assert publisher._queue.empty()  # nothing left queued forever
    # Everything queued before close was sent, so there is nothing to wait for (it waited out its timeout before).
    assert publisher.flush(timeout_s=30.0) is True
    assert publisher.last_seq == last


def test_two_threads_publishing_at_once_lose_nothing(publisher) -> None:
    index = BlockIndex()
    with ZmqEventSubscriber(publisher.endpoint, publisher.replay_endpoint, index) as subscriber:

        def publish(base: int) -> None:
            for i in range(500):
                publisher(BlockStored(None, (base + i,), 0, 0, (1, 2), 2))

        threads = [threading.Thread(target=publish, args=(base,)) for base in (0, 10**6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert publisher.flush()
        assert subscriber.wait_for(publisher.last_seq)
        assert index.hashes == {(None, base + i) for base in (0, 10**6) for i in range(500)}
        assert subscriber.num_gaps == 0
