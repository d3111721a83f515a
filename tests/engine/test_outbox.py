"""Specification of :class:`~prefixcache.engine.outbox.Outbox`, the engine process's sending end: a put never waits
for the reader, requests are refused once the unread bytes would pass the bound (cancels never are), messages arrive
whole and in order once the reader reads, and a connection that fails refuses every later put."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest

from prefixcache.engine.outbox import Outbox
from prefixcache.errors import EngineDeadError

MIB = 1 << 20


@pytest.fixture
def ends() -> Iterator[tuple[Connection, Connection]]:
    """``(the outbox's end, the reader's end)`` of a socket pair."""
    writer, reader = socket.socketpair()
    ends = Connection(writer.detach()), Connection(reader.detach())
    yield ends
    for end in ends:
        end.close()


def test_puts_never_wait_for_a_reader_and_requests_stop_at_the_bound(ends) -> None:
    writer, reader = ends
    outbox = Outbox(writer, "test-sender", max_unsent_bytes=4 * MIB)
    began = time.monotonic()
    outbox.put(b"a" * (3 * MIB), bounded=True)  # far more than the socket's buffer: the sender thread blocks on it
    with pytest.raises(EngineDeadError, match="not reading: 3 MiB sent to it are still unread"):
        outbox.put(b"b" * (2 * MIB), bounded=True)
    outbox.put(b"cancel")  # never refused: it frees the reader's work
    assert time.monotonic() - began < 1.0  # a bound on a hang, not a timing
    assert outbox.unsent_bytes == 3 * MIB + len(b"cancel")
    assert reader.recv_bytes() == b"a" * (3 * MIB)
    assert reader.recv_bytes() == b"cancel"
    outbox.close()
    outbox.join(10)
    assert outbox.unsent_bytes == 0


def test_a_failed_write_refuses_every_later_put(ends) -> None:
    writer, reader = ends
    outbox = Outbox(writer, "test-sender")
    reader.close()
    outbox.put(b"x" * MIB)
    outbox.join(10)
    assert outbox.failure is not None
    with pytest.raises(EngineDeadError, match="the engine process is gone"):
        outbox.put(b"cancel")


def test_a_closed_outbox_refuses_puts_and_its_thread_ends(ends) -> None:
    writer, _ = ends
    outbox = Outbox(writer, "test-sender")
    outbox.close()
    outbox.close()  # idempotent
    outbox.join(10)
    with pytest.raises(EngineDeadError, match="closed"):
        outbox.put(b"late")


def test_discarded_messages_are_never_written_and_free_their_bytes_at_once(ends) -> None:
    writer, reader = ends
    outbox = Outbox(writer, "test-sender", max_unsent_bytes=8 * MIB)
    outbox.put(b"a" * (3 * MIB), job=1, bounded=True)  # being written: the stopped reader holds the sender on it
    assert wait_for(lambda: outbox.writing == 1)
    outbox.put(b"b" * (2 * MIB), job=2, bounded=True)
    outbox.put(b"c" * (2 * MIB), job=3, bounded=True)
    outbox.put(b"cancel")
    assert outbox.discard([1, 2, 7]) == {2}  # not the one being written, nor one never put
    assert outbox.unsent_bytes == 5 * MIB + len(b"cancel")
    outbox.put(b"d" * (2 * MIB), job=4, bounded=True)  # the freed bytes count at once
    assert reader.recv_bytes() == b"a" * (3 * MIB)
    assert reader.recv_bytes() == b"c" * (2 * MIB)
    assert reader.recv_bytes() == b"cancel"
    assert reader.recv_bytes() == b"d" * (2 * MIB)
    assert outbox.discard([3, 4]) == set()  # written already
    outbox.close()
    outbox.join(10)
    assert outbox.unsent_bytes == 0


def wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
