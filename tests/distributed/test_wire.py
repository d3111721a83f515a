"""KV events in vLLM's EventBatch layout, checked by decoding with plain msgpack (no msgspec types)."""

from __future__ import annotations

import pytest

msgspec = pytest.importorskip("msgspec", reason="needs the [events] extra")
msgpack = pytest.importorskip("msgpack", reason="the independent decoder needs msgpack")

from prefixcache.cache.events import AllCleared, BlockIndex, BlockRemoved, BlockStored, block_hashes  # noqa: E402
from prefixcache.distributed.wire import decode, encode  # noqa: E402


def test_a_batch_is_ts_then_events_as_tagged_arrays_in_vllm_field_order() -> None:
    stored = BlockStored(None, (11, 12), 99, 0, (1, 2, 3, 4), 2)
    later = BlockStored(None, (13,), 12, 2, (5, 6), 2)
    raw = msgpack.unpackb(encode([stored, later, BlockRemoved(None, (13,)), AllCleared()], 1.5, "cpu"))
    assert raw == [
        1.5,
        [
            # block_hashes, parent_block_hash (nil for a chain's first block), token_ids, block_size, lora_id, medium
            ["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None, "cpu"],
            ["BlockStored", [13], 12, [5, 6], 2, None, "cpu"],
            ["BlockRemoved", [13], "cpu"],
            ["AllBlocksCleared"],
        ],
    ]


def test_full_64_bit_hashes_survive_as_unsigned_integers() -> None:
    big = 2**64 - 1
    raw = msgpack.unpackb(encode([BlockRemoved(None, (big, 2**63))], 0.0))
    assert raw[1][0][1] == [big, 2**63]
    assert decode(encode([BlockRemoved(None, (big,))], 0.0))[1] == [BlockRemoved(None, (big,))]


def test_decoding_keeps_hashes_and_tokens_and_drops_the_namespace(make_cache, put) -> None:
    cache = make_cache(num_blocks=32, block_size=2)
    events = []
    cache.subscribe(events.append)
    put(cache, [1, 2, 3, 4, 5], "tenant")
    put(cache, [1, 2, 3, 4, 9, 9])
    put(cache, [1, 2, 3, 4, 9, 9, 7, 7], "tenant")
    cache.evict_all()
    ts, decoded = decode(encode(events, 3.25))
    assert ts == 3.25
    assert [type(e) for e in decoded] == [type(e) for e in events]
    for mine, theirs in zip(events, decoded, strict=True):
        if isinstance(mine, BlockStored):
            assert (theirs.block_hashes, theirs.token_ids, theirs.block_size) == (
                mine.block_hashes,
                mine.token_ids,
                mine.block_size,
            )
            assert theirs.namespace is None
            if mine.first_block > 0:
                assert theirs.parent_block_hash == mine.parent_block_hash
        elif isinstance(mine, BlockRemoved):
            assert theirs.block_hashes == mine.block_hashes


def test_a_wire_fed_index_finds_a_prompt_by_hashes_of_its_own_namespace(make_cache, put) -> None:
    cache = make_cache(num_blocks=32, block_size=2)
    events = []
    cache.subscribe(events.append)
    put(cache, [1, 2, 3, 4], "a")
    index = BlockIndex()
    for event in decode(encode(events, 0.0))[1]:
        index(event)
    assert {(None, h) for h in block_hashes([1, 2, 3, 4], 2, "a")} == index.hashes
    assert not {(None, h) for h in block_hashes([1, 2, 3, 4], 2, "b")} & index.hashes


def test_bytes_that_are_not_a_batch_raise_a_decode_error() -> None:
    with pytest.raises(msgspec.DecodeError):
        decode(b"\xc1not msgpack")
    with pytest.raises(msgspec.ValidationError):
        decode(msgpack.packb([1.0, [["BlockMoved", [1]]]]))
