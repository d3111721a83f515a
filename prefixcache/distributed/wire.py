"""KV events as bytes: vLLM's ``EventBatch`` layout (``vllm/distributed/kv_events.py``), encoded with msgspec.

A batch is a msgpack array ``[ts, [event, ...]]`` (``ts`` in seconds since the epoch; vLLM's optional trailing
``data_parallel_rank`` is not sent).  Each event is an array whose first element names its kind:

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``
- ``["BlockRemoved", block_hashes, medium]``
- ``["AllBlocksCleared"]``

Older and newer vLLM layouts decode too: a ``BlockStored`` or ``BlockRemoved`` without its trailing ``medium`` (vLLM
before it had a CPU tier) gets ``medium=None``, and fields a later vLLM appends after ``medium`` are ignored.

Hashes are our chained 64-bit xxh64 values (:func:`prefixcache.cache.events.block_hashes`), sent as unsigned
integers; ``parent_block_hash`` is ``nil`` for a chain's first block, as vLLM sends it.  ``lora_id`` is always
``nil``.  The namespace (cache salt) travels only inside the hashes, since every chain starts from the namespace's
root hash, the way vLLM folds its cache salt into the first block's hash: :func:`from_wire` therefore gives events
with ``namespace=None``, and a consumer looks a prompt up by ``(None, hash)`` with hashes computed for the prompt's
namespace.  The block position is not sent either: decoded :class:`BlockStored` events carry ``first_block=0``
for a root block and ``-1`` (unknown) otherwise.  An event's own ``medium`` (set by a cache with a host tier,
:mod:`prefixcache.cache.host`) is sent in place of the publisher's, and decoded back onto the event.

Needs the ``[events]`` extra (msgspec).
"""

from __future__ import annotations

import msgspec

from prefixcache.cache.events import AllCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["WireAllBlocksCleared", "WireBatch", "WireBlockRemoved", "WireBlockStored", "decode", "encode", "from_wire"]


class WireBlockStored(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None  # absent in vLLM before 0.10 (five fields)


class WireBlockRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[int]
    medium: str | None = None


class WireAllBlocksCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


WireEvent = WireBlockStored | WireBlockRemoved | WireAllBlocksCleared


class WireBatch(msgspec.Struct, array_like=True, gc=False):
    """One published message: when it was encoded (``ts``, seconds) and its events in cache order.  A trailing
    ``data_parallel_rank`` from a vLLM publisher is ignored when decoding."""

    ts: float
    events: list[WireEvent]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(WireBatch)


def to_wire(event: KVEvent, medium: str | None = None) -> WireEvent:
    """The wire record of one cache event.

    Raises:
        TypeError: ``event`` is not a KV event.
    """
    if isinstance(event, BlockStored):
        parent = None if event.first_block == 0 else event.parent_block_hash
        medium = event.medium or medium
        return WireBlockStored(list(event.block_hashes), parent, list(event.token_ids), event.block_size, None, medium)
    if isinstance(event, BlockRemoved):
        return WireBlockRemoved(list(event.block_hashes), event.medium or medium)
    if isinstance(event, AllCleared):
        return WireAllBlocksCleared()
    raise TypeError(f"not a KV event: {type(event).__name__}")


def from_wire(event: WireEvent) -> KVEvent:
    """The cache event a wire record stands for (``namespace=None``; see the module docstring)."""
    if isinstance(event, WireBlockStored):
        root = event.parent_block_hash is None
        parent = 0 if root else event.parent_block_hash
        return BlockStored(
            None,
            tuple(event.block_hashes),
            parent,
            0 if root else -1,
            tuple(event.token_ids),
            event.block_size,
            event.medium,
        )
    if isinstance(event, WireBlockRemoved):
        return BlockRemoved(None, tuple(event.block_hashes), event.medium)
    return AllCleared()


def encode(events: list[KVEvent], ts: float, medium: str | None = None) -> bytes:
    """One ``EventBatch`` payload.  O(tokens and hashes in the events)."""
    return _encoder.encode(WireBatch(ts, [to_wire(e, medium) for e in events]))


def decode(payload: bytes) -> tuple[float, list[KVEvent]]:
    """``(ts, events)`` of one payload.

    Raises:
        msgspec.DecodeError: the bytes are not an ``EventBatch`` (a ``ValidationError`` for a wrong shape).
    """
    batch = _decoder.decode(payload)
    return batch.ts, [from_wire(e) for e in batch.events]
