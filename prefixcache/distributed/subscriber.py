"""Mirror a remote cache from its published KV events: the subscriber side of
:mod:`prefixcache.distributed.publisher` (vLLM's protocol), feeding any KV event listener, typically a
:class:`~prefixcache.cache.events.BlockIndex`.

Joining late is safe: the subscriber connects its SUB socket, then asks the replay endpoint for every batch from
sequence 0; afterwards it applies only batches it has not applied yet, in sequence order.  A gap in the live stream
(a dropped or early message) triggers a replay from the first missing batch, and so does a quiet spell of
``resync_interval_s``, so the tail is never missed for long.  Needs the ``[events]`` extra (pyzmq, msgspec).

Not detected: a publisher restarted on the *same* endpoints.  It numbers its batches from 0 again (vLLM's protocol
has no epoch), so the subscriber takes them for batches it already applied and the mirror goes stale.  Follow a
replica by its endpoints and subscribe anew when they change, as the Ray Serve router does (each replica binds
fresh ports), or close and reopen the subscriber when you restart a publisher on fixed ports.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec
import zmq

from prefixcache.cache.events import EventListener
from prefixcache.distributed.publisher import END_SEQ
from prefixcache.distributed.wire import decode

__all__ = ["ZmqEventSubscriber"]

logger = logging.getLogger(__name__)


class ZmqEventSubscriber:
    """Receive KV event batches and hand their events, in order and each once, to ``listener``.

    Events arrive with ``namespace=None`` (see :mod:`prefixcache.distributed.wire`).  ``listener`` runs on the
    subscriber's thread; an exception from it is logged and the batch counts as applied.

    Args:
        endpoint: the publisher's PUB address.
        replay_endpoint: its replay address, or ``None`` to take the live stream only.
        listener: called with each decoded event.
        topic: the topic to subscribe to.
        replay_timeout_s: how long one replay answer may take before the request is given up (and retried later).
        resync_interval_s: with no message for this long, ask the replay endpoint for anything newer.

    Raises:
        zmq.ZMQError: an endpoint cannot be connected.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        listener: EventListener,
        *,
        topic: str = "kv-events",
        replay_timeout_s: float = 2.0,
        resync_interval_s: float = 0.5,
    ) -> None:
        self.listener = listener
        self.replay_timeout_s = replay_timeout_s
        self.resync_interval_s = resync_interval_s
        self.last_seq = -1
        """The sequence number of the last batch applied (-1 before the first)."""
        self.num_gaps = 0
        """How many times batches were missing and not available for replay (the mirror may be incomplete)."""
        self.num_bad_messages = 0
        self._replay_failures = 0
        self._applied = threading.Condition()
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._sub.connect(endpoint)
        self._replay: zmq.Socket | None = None
        if replay_endpoint is not None:
            self._replay = self._context.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="prefixcache-kv-subscriber", daemon=True)
        self._thread.start()

    def wait_for(self, seq: int, timeout_s: float = 5.0) -> bool:
        """Block until batch ``seq`` has been applied; False if ``timeout_s`` passed first."""
        with self._applied:
            return self._applied.wait_for(lambda: self.last_seq >= seq, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and close the sockets.  Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._sub.close()
            if self._replay is not None:
                self._replay.close()
            self._context.term()

    def __enter__(self) -> ZmqEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        self._request_replay()
        quiet_since = time.monotonic()
        while not self._stop.is_set():
            if not self._sub.poll(50):
                if time.monotonic() - quiet_since >= self.resync_interval_s:
                    self._request_replay()
                    quiet_since = time.monotonic()
                continue
            frames = self._sub.recv_multipart()
            quiet_since = time.monotonic()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.num_bad_messages += 1
                continue
            seq = int.from_bytes(frames[1], "big")
            if seq > self.last_seq + 1:
                self._request_replay()
            if seq == self.last_seq + 1:
                self._apply(seq, frames[2])
            elif seq > self.last_seq + 1:
                # Still missing after the replay: those batches are gone for good.
                self.num_gaps += 1
                logger.warning("KV events %d..%d are lost; the mirror may be incomplete", self.last_seq + 1, seq - 1)
                self._apply(seq, frames[2])

    def _request_replay(self) -> None:
        if self._replay is None:
            return
        start = self.last_seq + 1
        self._replay.send_multipart((b"", start.to_bytes(8, "big")))
        deadline = time.monotonic() + self.replay_timeout_s
        while not self._stop.is_set():
            remaining_ms = int(1000 * (deadline - time.monotonic()))
            if remaining_ms <= 0:
                # Once per outage: a publisher that has gone away would otherwise log at every resync.
                self._replay_failures += 1
                level = logging.WARNING if self._replay_failures == 1 else logging.DEBUG
                logger.log(level, "replay from %d got no complete answer within %.1f s", start, self.replay_timeout_s)
                return
            # Short polls, so close() is not kept waiting (nor logged at) while the publisher is gone.
            if not self._replay.poll(min(remaining_ms, 50)):
                continue
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or frames[0] != b"" or len(frames[1]) != 8:
                self.num_bad_messages += 1
                continue
            if frames[1] == END_SEQ:
                self._replay_failures = 0
                return
            seq = int.from_bytes(frames[1], "big")
            if seq <= self.last_seq:
                continue  # already applied, or an answer to an earlier request that timed out
            if seq > self.last_seq + 1:
                self.num_gaps += 1
                logger.warning("replay starts at %d, after %d: older KV events are no longer buffered", seq, start)
            self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            _, events = decode(payload)
        except msgspec.MsgspecError:
            self.num_bad_messages += 1
            events = []
        for event in events:
            try:
                self.listener(event)
            except Exception:
                logger.exception("KV event listener %r failed on %s", self.listener, type(event).__name__)
        with self._applied:
            self.last_seq = seq
            self._applied.notify_all()
