"""The subscriber under abuse, over real ZMQ sockets on 127.0.0.1: messages it cannot read, a listener that kills
its thread, a publisher restarted on the same endpoints, and vLLM's older five-field ``BlockStored``.  Every wait is
bounded."""

from __future__ import annotations

import logging
import time

import pytest

zmq = pytest.importorskip("zmq", reason="needs the [events] extra")
pytest.importorskip("msgspec", reason="needs the [events] extra")
msgpack = pytest.importorskip("msgpack", reason="raw payloads are written with msgpack")

from prefixcache.cache.events import BlockIndex, BlockStored, block_hashes  # noqa: E402
from prefixcache.distributed.publisher import ZmqEventPublisher  # noqa: E402
from prefixcache.distributed.subscriber import ZmqEventSubscriber  # noqa: E402
from prefixcache.distributed.wire import encode  # noqa: E402
from prefixcache.errors import SubscriberDeadError  # noqa: E402


class Raw:
    """An item for an injecting publisher: sent as these frames (``payload`` under the next sequence number, kept for
    replay, when ``frames`` is None)."""

    def __init__(self, frames: tuple[bytes, ...] | None = None, payload: bytes = b"") -> None:
        self.frames, self.payload = frames, payload


def injecting(publisher: ZmqEventPublisher) -> ZmqEventPublisher:
    """Let ``publisher(Raw(...))`` put raw messages on the wire, in order with the events, from its own thread."""
    real = publisher._send

    def send(events: list) -> None:
        normal = []
        for event in [*events, None]:
            if isinstance(event, Raw) or event is None:
                if normal:
                    real(normal)
                    normal = []
                if event is None:
                    return
                if event.frames is not None:
                    publisher._pub.send_multipart(event.frames)
                else:
                    seq = publisher._next_seq
                    publisher._pub.send_multipart((publisher.topic, seq.to_bytes(8, "big"), event.payload))
                    publisher._buffer.append((seq, event.payload))
                    publisher._next_seq += 1
            else:
                normal.append(event)

    publisher._send = send
    return publisher


def wire_blocks(cache) -> set[tuple[None, int]]:
    return {(None, h) for seq in cache.cached_sequences() for h in block_hashes(seq, cache.block_size)}


def eventually(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def until_live(publisher, subscriber, cache, put) -> None:
    """Return once the subscriber has read a batch off the live stream.  ``wait_for`` alone does not show that: the
    first batches may come through the joining replay while the subscription is still on its way to the publisher
    (ZMQ's slow joiner), and live messages sent then are dropped, so injected frames would never be seen."""
    for block in range(100, 120, 2):
        put(cache, [block, block + 1])
        assert publisher.flush()
        if eventually(lambda: subscriber._live_seq == publisher.last_seq, timeout_s=0.25):
            assert subscriber.wait_for(publisher.last_seq)
            return
    raise AssertionError("no batch reached the subscriber on the live stream")


def test_a_sequence_number_of_2_64_minus_1_is_counted_and_the_mirror_goes_on(make_cache, put, caplog) -> None:
    with injecting(ZmqEventPublisher()) as publisher:
        cache = make_cache(num_blocks=32, block_size=2)
        cache.subscribe(publisher)
        index = BlockIndex()
        with ZmqEventSubscriber(publisher.endpoint, publisher.replay_endpoint, index) as subscriber:
            until_live(publisher, subscriber, cache, put)
            payload = encode([BlockStored(None, (77,), 0, 0, (9, 9), 2)], 0.0)
            with caplog.at_level(logging.DEBUG, logger="prefixcache.distributed.subscriber"):
                publisher(Raw((publisher.topic, (2**64 - 1).to_bytes(8, "big"), payload)))
                publisher(Raw((publisher.topic, (2**63).to_bytes(8, "big"), payload)))
                put(cache, [3, 4, 5, 6])
                assert publisher.flush() and subscriber.wait_for(publisher.last_seq)
                time.sleep(0.6)  # a resync after the bad messages
            assert subscriber.healthy
            assert subscriber.num_bad_messages == 2
            assert index.hashes == wire_blocks(cache)  # the bogus batch was not applied
            warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "skipping" in r.getMessage()]
            assert len(warnings) == 1


def test_truncated_and_mistyped_messages_are_skipped_and_counted(make_cache, put) -> None:
    with injecting(ZmqEventPublisher()) as publisher:
        cache = make_cache(num_blocks=32, block_size=2)
        cache.subscribe(publisher)
        index = BlockIndex()
        # No periodic resync: one after everything was sent replays every batch to the last (bad payloads counted),
        # so wait_for returned while the two live framing errors were still unread (seen once under load: 4 >= 6).
        endpoints = (publisher.endpoint, publisher.replay_endpoint)
        with ZmqEventSubscriber(*endpoints, index, resync_interval_s=3600.0) as subscriber:
            until_live(publisher, subscriber, cache, put)
            good = encode([BlockStored(None, (5,), 0, 0, (1, 1), 2)], 0.0)
            publisher(Raw((publisher.topic,)))  # one frame
            publisher(Raw((publisher.topic, b"\x00\x01", good)))  # a 2-byte sequence number
            publisher(Raw(payload=good[:-3]))  # a truncated payload under a real sequence number
            publisher(Raw(payload=msgpack.packb([1.0, [["BlockStored", "not a list", None, [], 2, None]]])))
            publisher(Raw(payload=msgpack.packb([1.0, [["BlockStored", [1.5], None, [1], 2, None, None]]])))
            publisher(Raw(payload=msgpack.packb(["ts", 7])))
            put(cache, [3, 4, 5, 6])
            assert publisher.flush() and subscriber.wait_for(publisher.last_seq)
            assert subscriber.healthy
            assert subscriber.num_bad_messages >= 6
            assert index.hashes == wire_blocks(cache)


def test_a_dead_subscriber_thread_is_reported_and_wait_for_raises(make_cache, put) -> None:
    class Fatal(BaseException):
        pass

    def listener(event) -> None:
        raise Fatal("listener gave up")

    with ZmqEventPublisher() as publisher:
        cache = make_cache(num_blocks=32, block_size=2)
        cache.subscribe(publisher)
        put(cache, [1, 2])
        assert publisher.flush()
        with ZmqEventSubscriber(publisher.endpoint, publisher.replay_endpoint, listener) as subscriber:
            assert eventually(lambda: not subscriber.healthy)
            assert isinstance(subscriber.error, Fatal)
            with pytest.raises(SubscriberDeadError) as raised:
                subscriber.wait_for(publisher.last_seq, timeout_s=5.0)
            assert raised.value.__cause__ is subscriber.error


def test_a_five_field_block_stored_from_an_older_vllm_is_applied(make_cache) -> None:
    with injecting(ZmqEventPublisher()) as publisher:
        index = BlockIndex()
        with ZmqEventSubscriber(publisher.endpoint, publisher.replay_endpoint, index) as subscriber:
            publisher(Raw(payload=msgpack.packb([1.0, [["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None]]])))
            publisher(Raw(payload=msgpack.packb([2.0, [["BlockRemoved", [12]]], 0])))
            assert publisher.flush() and subscriber.wait_for(publisher.last_seq)
            assert index.hashes == {(None, 11)}
            assert subscriber.num_bad_messages == 0


@pytest.mark.parametrize("new_batches", [2, 9], ids=["fewer-batches", "more-batches"])
def test_a_publisher_restarted_on_the_same_endpoints_is_detected_and_replayed(make_cache, put, new_batches) -> None:
    old_cache = make_cache(num_blocks=64, block_size=2)
    old = ZmqEventPublisher()
    old_cache.subscribe(old)
    for i in range(5):
        put(old_cache, [100 + i] * 4)
    assert old.flush()
    index = BlockIndex()
    with ZmqEventSubscriber(old.endpoint, old.replay_endpoint, index, resync_interval_s=0.2) as subscriber:
        assert subscriber.wait_for(old.last_seq)
        assert index.hashes == wire_blocks(old_cache)
        old_cache.unsubscribe(old)
        old.close()
        with ZmqEventPublisher(old.endpoint, old.replay_endpoint) as new:
            cache = make_cache(num_blocks=64, block_size=2)
            cache.subscribe(new)
            for i in range(new_batches):
                put(cache, [i + 1] * 4)
            assert new.flush()
            assert eventually(lambda: index.hashes == wire_blocks(cache), timeout_s=8.0), "the mirror went stale"
            assert subscriber.num_restarts == 1
            assert subscriber.last_seq == new.last_seq
            put(cache, [50, 50, 51, 51])  # and it follows the new publisher from there
            assert new.flush() and subscriber.wait_for(new.last_seq)
            assert index.hashes == wire_blocks(cache)
            assert subscriber.healthy
