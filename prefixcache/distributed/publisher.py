"""Publish a cache's KV events on a ZMQ PUB socket, with a replay endpoint for subscribers that join late.

The wire protocol is vLLM's (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``):

- PUB socket, one multipart message per batch: ``[topic, seq, payload]``; ``seq`` is an 8-byte big-endian
  counter starting at 0, ``payload`` an ``EventBatch`` (:mod:`prefixcache.distributed.wire`).
- ROUTER replay socket: a request ``[b"", start_seq]`` (8 bytes, big-endian; what a REQ or DEALER socket sends)
  is answered by one ``[b"", seq, payload]`` message per buffered batch with ``seq >= start_seq``, then the end
  marker ``[b"", (-1).to_bytes(8, "big", signed=True), b""]``.  Only the last ``buffer_batches`` batches are
  kept; a subscriber that asks for older ones sees the first replayed ``seq`` above what it asked for.
- No epoch: a publisher restarted on the same endpoints counts from 0 again, and
  :class:`~prefixcache.distributed.subscriber.ZmqEventSubscriber` detects the restart from that (the sequence going
  back, or its last batch not given back by a replay), clears its mirror and replays the new publisher.

Publishing never blocks the cache: the cache calls listeners inside its mutex, so :meth:`ZmqEventPublisher.__call__`
only appends to an unbounded queue, and a background thread, which owns both sockets, batches, encodes, sends and
answers replay requests.  Needs the ``[events]`` extra (pyzmq, msgspec).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from prefixcache.cache.events import KVEvent
from prefixcache.distributed.wire import encode
from prefixcache.errors import ClosedError, InvalidArgumentError

__all__ = ["END_SEQ", "ZmqEventPublisher"]

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The ``seq`` frame that ends a replay answer (its payload frame is empty)."""
_STOP = object()


def _bind(socket: zmq.Socket, endpoint: str) -> str:
    socket.bind(endpoint)
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)


class ZmqEventPublisher:
    """A KV event listener that sends what it hears as msgpack ``EventBatch`` messages (vLLM's layout).

    Use: ``publisher = ZmqEventPublisher(); cache.subscribe(publisher)`` (the cache first announces every block it
    already holds, so subscribers see a complete view); ``publisher.endpoint`` and ``publisher.replay_endpoint``
    are the bound addresses (``tcp://127.0.0.1:*`` picks free ports).  Close it with :meth:`close` or a ``with``
    block, after unsubscribing it from the cache.

    Args:
        endpoint: where the PUB socket binds.
        replay_endpoint: where the ROUTER replay socket binds, or ``None`` for no replay.
        topic: the first frame of every published message (subscribers filter on it).
        buffer_batches: how many recent batches are kept for replay.
        max_batch_events: at most this many events per batch; events queued together are sent together.
        medium: the ``medium`` field of every event (vLLM sends ``"GPU"``; ``None`` leaves it unset).

    Raises:
        InvalidArgumentError: ``buffer_batches`` or ``max_batch_events`` < 1.
        zmq.ZMQError: an endpoint cannot be bound.
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:*",
        replay_endpoint: str | None = "tcp://127.0.0.1:*",
        *,
        topic: str = "kv-events",
        buffer_batches: int = 100_000,
        max_batch_events: int = 1024,
        medium: str | None = None,
    ) -> None:
        if buffer_batches < 1 or max_batch_events < 1:
            raise InvalidArgumentError(
                f"buffer_batches and max_batch_events must be >= 1, got {buffer_batches}, {max_batch_events}"
            )
        self.topic = topic.encode("utf-8")
        self.max_batch_events = max_batch_events
        self.medium = medium
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._next_seq = 0
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            self.endpoint = _bind(self._pub, endpoint)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(self._replay, replay_endpoint)
        except BaseException:
            self._close_sockets()
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="prefixcache-kv-events", daemon=True)
        self._thread.start()

    @property
    def last_seq(self) -> int:
        """The sequence number of the last batch sent, -1 before the first."""
        return self._next_seq - 1

    def __call__(self, event: KVEvent) -> None:
        """Queue one event for the sender thread.  O(1), never blocks; safe inside the cache's mutex.

        Raises:
            ClosedError: the publisher is closed (nothing would send the event; unsubscribe before closing).
        """
        if self._closed:
            raise ClosedError("KV event publisher used after close(); unsubscribe it from the cache first")
        self._queue.put(event)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every event queued so far has been sent; False if ``timeout_s`` passed first.  Once closed,
        this waits (at most ``timeout_s``) for the sender to finish what was queued before :meth:`close`."""
        if self._closed:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, stop the thread and close the sockets.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("KV event sender did not stop within %.1f s; its sockets stay open", timeout_s)
            return
        self._close_sockets()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _close_sockets(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._context.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            events: list[KVEvent] = []
            stop = False
            waiters: list[threading.Event] = []
            try:
                item = self._queue.get(timeout=0.005)
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    stop = True
                elif isinstance(item, threading.Event):
                    waiters.append(item)
                else:
                    events.append(item)
                    if len(events) >= self.max_batch_events:
                        self._send(events)
                        events = []
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            if events:
                self._send(events)
            for waiter in waiters:
                waiter.set()
            if stop:
                return
            if self._replay is not None and poller.poll(0):
                self._answer_replays()

    def _send(self, events: list[KVEvent]) -> None:
        try:
            payload = encode(events, time.time(), self.medium)
        except Exception:  # an event the wire cannot carry must not kill the sender
            logger.exception("cannot encode %d KV events; they are dropped", len(events))
            return
        seq = self._next_seq.to_bytes(8, "big")
        self._pub.send_multipart((self.topic, seq, payload))
        self._buffer.append((self._next_seq, payload))
        self._next_seq += 1

    def _answer_replays(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                logger.warning("ignoring a malformed replay request of %d frames", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in tuple(self._buffer):
                if seq >= start:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))
