"""Mirror a remote cache from its published KV events: the subscriber side of
:mod:`prefixcache.distributed.publisher` (vLLM's protocol), feeding any KV event listener, typically a
:class:`~prefixcache.cache.events.BlockIndex`.

Joining late is safe: the subscriber connects its SUB socket, then asks the replay endpoint for every batch from
sequence 0; afterwards it applies only batches it has not applied yet, in sequence order.  A gap in the live stream
(a dropped or early message) triggers a replay, and so does every ``resync_interval_s``, so the tail is never missed
for long.  Needs the ``[events]`` extra (pyzmq, msgspec).

A publisher restarted on the *same* endpoints numbers its batches from 0 again (vLLM's protocol has no epoch, so a
sequence number going back is the portable signal).  The subscriber takes it for a restart when

- a live batch's sequence number is not above the previous live one (one publisher's stream only goes up), or
- a replay, which always asks from the last batch applied, does not give that batch back byte for byte: the
  publisher holds nothing that far (it restarted and sent fewer batches), or another batch under that number (it
  restarted and sent more).

It then clears the mirror (``reset``, by default the listener's own ``clear()``, else an ``AllCleared`` event) and
replays the new publisher from 0; :attr:`ZmqEventSubscriber.num_restarts` counts them.

No message stops the thread: one it cannot read (wrong frames, a sequence number outside ``[0, 2**63)``, a payload
that is not an ``EventBatch``) is counted in :attr:`ZmqEventSubscriber.num_bad_messages` and skipped, the first
logged at WARNING and the rest at DEBUG.  Should the thread end on an error all the same (a listener raising a
``BaseException``), :attr:`ZmqEventSubscriber.healthy` turns False, :attr:`ZmqEventSubscriber.error` holds the
error, and :meth:`~ZmqEventSubscriber.wait_for` raises :class:`~prefixcache.errors.SubscriberDeadError`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from prefixcache.cache.events import AllCleared, EventListener
from prefixcache.distributed.publisher import END_SEQ
from prefixcache.distributed.wire import decode
from prefixcache.errors import SubscriberDeadError

__all__ = ["MAX_SEQ", "ZmqEventSubscriber"]

logger = logging.getLogger(__name__)

MAX_SEQ = 2**63 - 1
"""The largest sequence number taken: the end marker is ``-1`` as a signed 8-byte number, so a sequence number
from ``2**63`` on (as unsigned) cannot be a publisher's count."""


class ZmqEventSubscriber:
    """Receive KV event batches and hand their events, in order and each once, to ``listener``.

    Events arrive with ``namespace=None`` (see :mod:`prefixcache.distributed.wire`).  ``listener`` runs on the
    subscriber's thread; an exception from it is logged and the batch counts as applied.

    Args:
        endpoint: the publisher's PUB address.
        replay_endpoint: its replay address, or ``None`` to take the live stream only (a restart is then detected
            from the live stream alone, and what was sent before the subscription reached the publisher is missed).
        listener: called with each decoded event.
        topic: the topic to subscribe to.
        replay_timeout_s: how long one replay answer may take before the request is given up (and retried later).
        resync_interval_s: ask the replay endpoint for anything newer at least this often (and check that the
            publisher still holds the last batch applied, which is how a quiet restart is found).
        reset: called on the subscriber's thread when the publisher restarted, to drop everything mirrored;
            ``None``: ``listener.clear()`` if the listener has it (a :class:`~prefixcache.cache.events.BlockIndex`
            does), else ``listener(AllCleared())``.

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
        reset: Callable[[], None] | None = None,
    ) -> None:
        self.listener = listener
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s
        self.resync_interval_s = resync_interval_s
        self._reset = reset
        self.last_seq = -1
        """The sequence number of the last batch applied (-1 before the first, and again after a restart)."""
        self.num_gaps = 0
        """How many times batches were missing and not available for replay (the mirror may be incomplete)."""
        self.num_bad_messages = 0
        """Messages that could not be read (wrong frames, sequence number or payload), skipped."""
        self.num_restarts = 0
        """Publisher restarts detected; each cleared the mirror and replayed the new publisher."""
        self.error: BaseException | None = None
        """What stopped the thread, if anything did (see :attr:`healthy`)."""
        self._last_payload = b""
        self._live_seq = -1
        self._replay_failures = 0
        self._applied = threading.Condition()
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._sub.connect(endpoint)
        self._replay: zmq.Socket | None = None
        self._open_replay()
        self._thread = threading.Thread(target=self._run, name="prefixcache-kv-subscriber", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        """Whether the thread still mirrors the publisher: False once it stopped on an error (:attr:`error`) or was
        closed.  A router should stop trusting (and re-create) a mirror that is not healthy."""
        return self._thread.is_alive() and not self._stop.is_set()

    def wait_for(self, seq: int, timeout_s: float = 5.0) -> bool:
        """Block until batch ``seq`` has been applied; False if ``timeout_s`` passed first.

        Raises:
            SubscriberDeadError: the thread stopped on an error (its ``__cause__``) before that batch came.
        """
        deadline = time.monotonic() + timeout_s
        with self._applied:
            while self.last_seq < seq:
                if self.error is not None:
                    raise SubscriberDeadError(f"the KV event subscriber stopped: {self.error!r}") from self.error
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._applied.wait(min(remaining, 0.1))
            return True

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

    def _open_replay(self) -> None:
        # A fresh socket after a timed-out request, so that its late answer can never be read as the next one's.
        if self._replay is not None:
            self._replay.close()
            self._replay = None
        if self.replay_endpoint is not None:
            self._replay = self._context.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(self.replay_endpoint)

    def _run(self) -> None:
        try:
            self._resync()
            last_resync = time.monotonic()
            while not self._stop.is_set():
                if time.monotonic() - last_resync >= self.resync_interval_s:
                    self._resync()
                    last_resync = time.monotonic()
                if not self._sub.poll(50):
                    continue
                frames = self._sub.recv_multipart()
                try:
                    self._on_live(frames)
                except Exception as error:  # noqa: BLE001 - no message may stop the mirror
                    self._bad(f"live message could not be handled: {error!r}")
        except BaseException as error:  # noqa: BLE001 - recorded for healthy / wait_for, not lost in a thread
            if not self._stop.is_set():
                self.error = error
                logger.exception("the KV event subscriber stopped; its mirror no longer follows the publisher")
            with self._applied:
                self._applied.notify_all()

    def _bad(self, what: str) -> None:
        self.num_bad_messages += 1
        level = logging.WARNING if self.num_bad_messages == 1 else logging.DEBUG
        logger.log(level, "skipping a KV event message (%s); later ones are counted in num_bad_messages", what)

    def _seq_of(self, frame: bytes) -> int | None:
        seq = int.from_bytes(frame, "big")
        if len(frame) != 8 or seq > MAX_SEQ:
            self._bad(f"sequence number frame {frame[:16]!r}")
            return None
        return seq

    def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._bad(f"{len(frames)} frames, not 3")
            return
        seq = self._seq_of(frames[1])
        if seq is None:
            return
        if self._live_seq >= 0 and seq <= self._live_seq:
            logger.warning("KV event %d after %d on the live stream: the publisher restarted", seq, self._live_seq)
            self._restart()
            self._resync()
        self._live_seq = seq
        if seq > self.last_seq + 1:
            self._resync()
        if seq == self.last_seq + 1:
            self._apply(seq, frames[2])
        elif seq > self.last_seq + 1:
            # Still missing after the replay: those batches are gone for good.
            self.num_gaps += 1
            logger.warning("KV events %d..%d are lost; the mirror may be incomplete", self.last_seq + 1, seq - 1)
            self._apply(seq, frames[2])

    def _restart(self) -> None:
        """Forget the old publisher: clear the mirror, expect batches from 0 again."""
        self.num_restarts += 1
        try:
            if self._reset is not None:
                self._reset()
            elif callable(getattr(self.listener, "clear", None)):
                self.listener.clear()  # type: ignore[attr-defined]
            else:
                self.listener(AllCleared())
        except Exception:
            logger.exception("clearing the mirror of a restarted KV event publisher failed")
        with self._applied:
            self.last_seq = -1
            self._last_payload = b""
            self._live_seq = -1

    def _resync(self) -> None:
        """Replay what the publisher holds from the last batch applied; after a restart found there, from 0."""
        if self._replay is None:
            return
        if self._replay_once():
            self._restart()
            self._replay_once()

    def _replay_once(self) -> bool:
        """One replay request and its answer; True when the answer shows the publisher restarted (nothing applied
        from it then)."""
        assert self._replay is not None
        check = self.last_seq >= 0  # the batch already applied comes back first, byte for byte, or it restarted
        start = max(self.last_seq, 0)
        self._replay.send_multipart((b"", start.to_bytes(8, "big")))
        deadline = time.monotonic() + self.replay_timeout_s
        restarted = False
        while not self._stop.is_set():
            remaining_ms = int(1000 * (deadline - time.monotonic()))
            if remaining_ms <= 0:
                # Once per outage: a publisher that has gone away would otherwise log at every resync.
                self._replay_failures += 1
                level = logging.WARNING if self._replay_failures == 1 else logging.DEBUG
                logger.log(level, "replay from %d got no complete answer within %.1f s", start, self.replay_timeout_s)
                self._open_replay()
                return False
            # Short polls, so close() is not kept waiting (nor logged at) while the publisher is gone.
            if not self._replay.poll(min(remaining_ms, 50)):
                continue
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or frames[0] != b"":
                self._bad(f"replay answer of {len(frames)} frames")
                continue
            if frames[1] == END_SEQ:
                self._replay_failures = 0
                if check:
                    logger.warning("the KV event publisher no longer has batch %d: it restarted", start)
                return restarted or check
            seq = self._seq_of(frames[1])
            if seq is None or restarted:
                continue  # the rest of an answer from a restarted publisher is read and dropped
            if check:
                check = False
                if seq == start and frames[2] != self._last_payload:
                    logger.warning("the KV event publisher sent another batch %d: it restarted", seq)
                    restarted = True
                    continue
            if seq <= self.last_seq:
                continue
            if seq > self.last_seq + 1:
                self.num_gaps += 1
                logger.warning("replay starts at %d, after %d: older KV events are no longer buffered", seq, start)
            self._apply(seq, frames[2])
        return False

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            _, events = decode(payload)
        except Exception as error:  # noqa: BLE001 - msgspec's errors, or anything a hostile payload provokes
            self._bad(f"batch {seq} is not an EventBatch: {error!r}")
            events = []
        for event in events:
            try:
                self.listener(event)
            except Exception:
                logger.exception("KV event listener %r failed on %s", self.listener, type(event).__name__)
        with self._applied:
            self.last_seq = seq
            self._last_payload = payload
            self._applied.notify_all()
