"""The Responses API's store: the responses ``previous_response_id`` and ``GET /v1/responses/{id}`` read, kept per
namespace (the API key's) and bounded in count and bytes.

Each namespace has a store of its own: its last ``max_responses`` responses (1,000) within ``max_bytes`` (64 MiB),
least recently used evicted first.  One key storing, reading or deleting never evicts, reveals or counts another's
responses: a namespace's bounds are fixed when the store is made (its byte bound is its share of ``max_total_bytes``,
1 GiB, over the server's namespaces), never moved by what others store.  A response whose own bytes are over
``max_response_bytes`` (1 MiB) is not stored at all: it is answered as usual, with ``store: false`` in the response
object (OpenAI's field for whether a response can be retrieved later), and a later ``previous_response_id`` naming it
is a 404, as for an evicted one.  Clients send ``store`` true by default without needing the store, so refusing the
request (a 400) would fail answers nobody meant to keep.

A response's bytes are what the store holds for it, and the store holds it serialized: its ``response`` object
(output items, ``metadata``, ``user``, ``instructions``, ``tools``...) as UTF-8 JSON bytes, and each chat message of
its conversation likewise, decoded again when it is read.  So its count is the memory it keeps, whatever its
characters (a Python string holding one emoji keeps every character in 4 bytes: counting its UTF-8 let 64 MiB of
counted bytes hold 266 MiB).  A message kept costs its JSON's bytes plus :data:`MESSAGE_OVERHEAD_BYTES` (the Python
objects that keep it), and each message a response's conversation holds :data:`REFERENCE_BYTES` (its place in that
response's list): a message can be 30 bytes of JSON, and a conversation continued turn after turn holds every earlier
message again.  (What each response costs beside, a few hundred bytes, the count bound bounds.) A conversation
continued by ``previous_response_id`` shares the earlier turns' messages: each message (by its JSON) is kept and
counted once per namespace however many stored turns hold it, and stops counting when the last of them goes.
Evictions are logged (logger ``prefixcache.serve.response_store``): at DEBUG those of the count bound, at INFO those
of the byte bound, a response too large to store at WARNING.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from prefixcache.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_MAX_RESPONSE_BYTES",
    "DEFAULT_MAX_STORED_BYTES",
    "DEFAULT_MAX_STORED_RESPONSES",
    "DEFAULT_MAX_TOTAL_STORED_BYTES",
    "MESSAGE_OVERHEAD_BYTES",
    "REFERENCE_BYTES",
    "ResponseStore",
    "StoredResponse",
    "json_bytes",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_STORED_RESPONSES = 1000
"""Responses kept per namespace (least recently used go first)."""

DEFAULT_MAX_STORED_BYTES = 64 << 20
"""Bytes of responses kept per namespace: 1,000 responses of 64 KiB each (a long agent turn's own items)."""

DEFAULT_MAX_TOTAL_STORED_BYTES = 1 << 30
"""Bytes of responses kept over all namespaces: each namespace's byte bound is at most this over their number."""

DEFAULT_MAX_RESPONSE_BYTES = 1 << 20
"""A response's own bytes (what it adds to its namespace's store) above which it is answered but not stored."""


MESSAGE_OVERHEAD_BYTES = 160
"""What keeping a message costs beside its JSON's bytes: the bytes object's header, its entry in its namespace's
table of messages and the record of its holders (measured: about 130 bytes on CPython 3.11)."""

REFERENCE_BYTES = 8
"""What each message of a stored response's conversation costs that response: one pointer."""


def to_json(value: Any) -> bytes:
    """``value`` as UTF-8 JSON, as the server writes it (a lone surrogate as its escape, which reads back as the same
    surrogate).  O(size of ``value``)."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "backslashreplace")


def json_bytes(value: Any) -> int:
    """The size in bytes of ``value`` as UTF-8 JSON (:func:`to_json`).  O(size of ``value``)."""
    return len(to_json(value))


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A finished response kept for ``previous_response_id`` and ``GET``: its ``namespace`` (API key's; another
    cannot see it), the ``response`` object, and the chat ``messages`` of its conversation through its answer
    (instructions excluded).  What :meth:`ResponseStore.put` takes and :meth:`ResponseStore.get` gives back (a fresh
    copy, decoded from what the store keeps: JSON's types, a tuple read back as a list)."""

    namespace: str | None
    body: dict[str, Any]
    messages: tuple[dict[str, Any], ...]


@dataclass(slots=True)
class _Held:
    """A message a namespace keeps (its JSON) and how many of its stored responses hold it."""

    data: bytes
    holders: int


@dataclass(slots=True)
class _Entry:
    """A stored response as kept: its body's JSON and its conversation's messages (each its namespace's one copy)."""

    namespace: str | None
    body: bytes
    messages: tuple[bytes, ...]

    @property
    def own_bytes(self) -> int:
        """What it counts beside its messages: its body's JSON and its references to its messages."""
        return len(self.body) + REFERENCE_BYTES * len(self.messages)


@dataclass(slots=True)
class _Shelf:
    """One namespace's responses, most recently used last, and the bytes they keep: each response's own
    (:attr:`_Entry.own_bytes`) and, once each, the messages they hold (``messages``: JSON -> its one copy)."""

    responses: OrderedDict[str, _Entry] = field(default_factory=OrderedDict)
    num_bytes: int = 0
    messages: dict[bytes, _Held] = field(default_factory=dict)


class ResponseStore:
    """Stored responses per namespace (see the module docstring), each namespace within ``max_responses`` responses
    and ``max_bytes`` bytes.  ``namespaces`` are those the server can authenticate (``None`` for an open server);
    each namespace's byte bound is ``min(max_bytes, max_total_bytes // len(namespaces))``, so all together stay
    within ``max_total_bytes``, and a response of another namespace is not stored.  ``max_responses`` 0 stores
    nothing.  Used from the event loop only (not thread-safe).

    Costs: :meth:`get` O(bytes of the response and its conversation), to decode them; :meth:`delete` O(length of the
    conversation); :meth:`put` O(bytes of the response and its conversation), to encode them, plus O(length of the
    conversation) for each response it evicts.

    Raises:
        InvalidArgumentError: a negative ``max_responses``, a byte bound below 1, or no ``namespaces``.
    """

    __slots__ = ("_shelves", "max_bytes", "max_response_bytes", "max_responses", "max_total_bytes", "namespaces")

    def __init__(
        self,
        max_responses: int = DEFAULT_MAX_STORED_RESPONSES,
        *,
        max_bytes: int = DEFAULT_MAX_STORED_BYTES,
        max_total_bytes: int = DEFAULT_MAX_TOTAL_STORED_BYTES,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        namespaces: Collection[str | None] = (None,),
    ) -> None:
        if isinstance(max_responses, bool) or not isinstance(max_responses, int) or max_responses < 0:
            raise InvalidArgumentError(f"max_responses must be an int >= 0, got {max_responses!r}")
        for name, value in (
            ("max_bytes", max_bytes),
            ("max_total_bytes", max_total_bytes),
            ("max_response_bytes", max_response_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
        if not namespaces:
            raise InvalidArgumentError("namespaces must name at least one namespace (None for an open server)")
        self.namespaces = frozenset(namespaces)
        self.max_responses = max_responses
        self.max_total_bytes = max_total_bytes
        self.max_bytes = min(max_bytes, max_total_bytes // len(self.namespaces))
        self.max_response_bytes = min(max_response_bytes, self.max_bytes)
        self._shelves: dict[str | None, _Shelf] = {}

    def __len__(self) -> int:
        """Responses stored, all namespaces together."""
        return sum(len(shelf.responses) for shelf in self._shelves.values())

    @property
    def num_bytes(self) -> int:
        """Bytes kept, all namespaces together."""
        return sum(shelf.num_bytes for shelf in self._shelves.values())

    def namespace_bytes(self, namespace: str | None) -> int:
        """Bytes ``namespace``'s responses keep."""
        shelf = self._shelves.get(namespace)
        return 0 if shelf is None else shelf.num_bytes

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """Keep ``stored`` under ``response_id`` in its namespace, evicting that namespace's least recently used
        responses until it is within its bounds again (a response of the same id is replaced); True if kept.  False
        when ``max_responses`` is 0, the namespace is not one of :attr:`namespaces`, the response's own bytes (its
        body, its references to its messages and the messages its namespace does not hold yet) are over
        :attr:`max_response_bytes`, or its whole conversation is over :attr:`max_bytes`."""
        namespace = stored.namespace
        if self.max_responses == 0 or namespace not in self.namespaces:
            return False
        shelf = self._shelves.get(namespace) or _Shelf()
        if response_id in shelf.responses:
            self._drop(shelf, response_id)
        new: dict[bytes, bytes] = {}  # the messages its namespace does not hold yet, each once, in order
        messages = []
        for message in stored.messages:
            data = to_json(message)
            kept = shelf.messages.get(data)
            messages.append(kept.data if kept is not None else new.setdefault(data, data))  # one copy of each
        entry = _Entry(namespace, to_json(stored.body), tuple(messages))
        own_bytes = entry.own_bytes + sum(len(data) + MESSAGE_OVERHEAD_BYTES for data in new)
        if own_bytes > self.max_response_bytes:
            logger.warning(
                "response %s of namespace %s not stored: its %s bytes are over the store's limit of %s a response",
                response_id,
                namespace,
                f"{own_bytes:,}",
                f"{self.max_response_bytes:,}",
            )
            return False
        self._shelves[namespace] = shelf
        for data in entry.messages:
            kept = shelf.messages.get(data)
            if kept is None:
                shelf.messages[data] = _Held(data, 1)
                shelf.num_bytes += len(data) + MESSAGE_OVERHEAD_BYTES
            else:
                kept.holders += 1
        shelf.responses[response_id] = entry
        shelf.num_bytes += entry.own_bytes
        self._evict(shelf, namespace)
        return response_id in shelf.responses  # not when its whole conversation is over the namespace's bound

    def get(self, response_id: str, namespace: str | None) -> StoredResponse | None:
        """The stored response, decoded afresh, if ``namespace`` stored it (and marks it recently used), else None."""
        shelf = self._shelves.get(namespace)
        entry = None if shelf is None else shelf.responses.get(response_id)
        if entry is None:
            return None
        shelf.responses.move_to_end(response_id)
        return StoredResponse(namespace, json.loads(entry.body), tuple(json.loads(data) for data in entry.messages))

    def delete(self, response_id: str, namespace: str | None) -> bool:
        """Forget the response; False when ``namespace`` has none by that id."""
        shelf = self._shelves.get(namespace)
        if shelf is None or response_id not in shelf.responses:
            return False
        self._drop(shelf, response_id)
        return True

    def check_invariants(self) -> None:
        """Assert every namespace is within its bounds and its byte count is what its responses keep: their own bytes
        and, once each, their messages' (each message's count of holders exact, each kept once).  O(everything
        stored)."""
        total = 0
        for namespace, shelf in self._shelves.items():
            assert namespace in self.namespaces, namespace
            assert len(shelf.responses) <= self.max_responses, (namespace, len(shelf.responses))
            holders: dict[bytes, int] = {}
            counted = 0
            for entry in shelf.responses.values():
                assert entry.namespace == namespace
                counted += entry.own_bytes
                for data in entry.messages:
                    assert shelf.messages[data].data is data, "a message kept twice"
                    if data not in holders:
                        counted += len(data) + MESSAGE_OVERHEAD_BYTES
                    holders[data] = holders.get(data, 0) + 1
            assert holders == {data: held.holders for data, held in shelf.messages.items()}, namespace
            assert counted == shelf.num_bytes <= self.max_bytes, (namespace, counted, shelf.num_bytes)
            total += shelf.num_bytes
        assert total <= self.max_total_bytes, total

    def _evict(self, shelf: _Shelf, namespace: str | None) -> None:
        """Drop ``shelf``'s least recently used responses until it is within both bounds, and log what went."""
        by_count = by_bytes = freed = 0
        while len(shelf.responses) > self.max_responses or shelf.num_bytes > self.max_bytes:
            over_count = len(shelf.responses) > self.max_responses
            before = shelf.num_bytes
            self._drop(shelf, next(iter(shelf.responses)))
            freed += before - shelf.num_bytes
            by_count, by_bytes = by_count + over_count, by_bytes + (not over_count)
        if by_bytes:
            logger.info(
                "responses store: namespace %s evicted %d response(s), %s bytes, to stay within %s bytes",
                namespace,
                by_count + by_bytes,
                f"{freed:,}",
                f"{self.max_bytes:,}",
            )
        elif by_count:
            logger.debug(
                "responses store: namespace %s evicted %d response(s), %s bytes, to stay within %d responses",
                namespace,
                by_count,
                f"{freed:,}",
                self.max_responses,
            )

    @staticmethod
    def _drop(shelf: _Shelf, response_id: str) -> None:
        entry = shelf.responses.pop(response_id)
        shelf.num_bytes -= entry.own_bytes
        for data in entry.messages:
            kept = shelf.messages[data]
            kept.holders -= 1
            if kept.holders == 0:
                del shelf.messages[data]
                shelf.num_bytes -= len(data) + MESSAGE_OVERHEAD_BYTES
