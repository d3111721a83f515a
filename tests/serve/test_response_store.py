"""The Responses store: a store per API key's namespace, bounded in responses and in bytes, a per-response limit."""

from __future__ import annotations

import gc
import logging
import tracemalloc

import pytest

from prefixcache.errors import InvalidArgumentError
from prefixcache.serve.response_store import (
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_MAX_STORED_BYTES,
    DEFAULT_MAX_STORED_RESPONSES,
    MESSAGE_OVERHEAD_BYTES,
    REFERENCE_BYTES,
    ResponseStore,
    StoredResponse,
    json_bytes,
)


def response(namespace: str | None, name: str, *messages: dict, pad: int = 0) -> StoredResponse:
    return StoredResponse(namespace, {"id": name, "metadata": {"pad": "x" * pad}}, tuple(messages))


def put_all(store: ResponseStore, namespace: str | None, names: list[str], pad: int = 0) -> None:
    for name in names:
        assert store.put(name, response(namespace, name, pad=pad))
        store.check_invariants()


def test_one_key_filling_its_store_evicts_none_of_another_keys_responses() -> None:
    store = ResponseStore(max_responses=3, namespaces={"a", "b"})
    put_all(store, "b", ["b0", "b1"])
    put_all(store, "a", [f"a{i}" for i in range(10)])
    assert store.get("b0", "b") is not None and store.get("b1", "b") is not None
    assert [name for name in (f"a{i}" for i in range(10)) if store.get(name, "a")] == ["a7", "a8", "a9"]
    assert len(store) == 5


def test_what_one_key_keeps_does_not_depend_on_how_many_another_stored() -> None:
    kept = []
    for theirs in (0, 1, 37):
        store = ResponseStore(max_responses=20, max_bytes=5_000, max_total_bytes=10_000, namespaces={"a", "b"})
        put_all(store, "b", [f"b{i}" for i in range(theirs)], pad=400)
        put_all(store, "a", [f"a{i}" for i in range(40)], pad=400)
        kept.append([f"a{i}" for i in range(40) if store.get(f"a{i}", "a") is not None])
    assert json_bytes({"id": "a10", "metadata": {"pad": "x" * 400}}) == 438  # 11 fit in 5,000 bytes
    assert kept[0] == kept[1] == kept[2] == [f"a{i}" for i in range(29, 40)]


def test_another_keys_id_is_not_found_read_or_deleted() -> None:
    store = ResponseStore(namespaces={"a", "b"})
    store.put("r", response("a", "r"))
    assert store.get("r", "b") is None and not store.delete("r", "b")
    assert store.get("r", "a").body["id"] == "r" and store.delete("r", "a") and store.get("r", "a") is None


def test_the_byte_bound_evicts_the_least_recently_used_first() -> None:
    one = json_bytes({"id": "r0", "metadata": {"pad": "x" * 1000}})  # 1,037 bytes
    store = ResponseStore(max_bytes=3 * one + 10)
    put_all(store, None, ["r0", "r1", "r2"], pad=1000)
    assert store.get("r0", None) is not None  # r1 becomes the least recently used
    put_all(store, None, ["r3"], pad=1000)
    assert [name for name in ("r0", "r1", "r2", "r3") if store.get(name, None)] == ["r0", "r2", "r3"]
    assert store.num_bytes == store.namespace_bytes(None) == 3 * one


def test_a_response_over_the_per_response_limit_is_not_stored_and_evicts_nothing(caplog) -> None:
    store = ResponseStore(max_bytes=10_000, max_response_bytes=2_000)
    put_all(store, None, ["small"], pad=100)
    with caplog.at_level(logging.WARNING, logger="prefixcache.serve.response_store"):
        assert not store.put("big", response(None, "big", pad=2_000))
    assert store.get("big", None) is None and store.get("small", None) is not None and len(store) == 1
    assert "response big of namespace None not stored: its 2,038 bytes are over" in caplog.text
    store.check_invariants()


def test_evictions_are_logged_with_the_bytes_they_free(caplog) -> None:
    one = json_bytes({"id": "r0", "metadata": {"pad": "x" * 1000}})
    store = ResponseStore(max_bytes=2 * one, namespaces={"team"})
    with caplog.at_level(logging.INFO, logger="prefixcache.serve.response_store"):
        put_all(store, "team", ["r0", "r1", "r2"], pad=1000)
    assert f"namespace team evicted 1 response(s), {one:,} bytes, to stay within {2 * one:,} bytes" in caplog.text


def kept(message: dict) -> int:
    """What a namespace counts for keeping ``message``: its JSON and the objects that keep it."""
    return json_bytes(message) + MESSAGE_OVERHEAD_BYTES


def test_a_conversations_shared_messages_count_once_and_until_their_last_holder_goes() -> None:
    system = {"role": "user", "content": "u" * 500}
    answer = {"role": "assistant", "content": "a" * 300}
    follow = {"role": "user", "content": "f" * 200}
    store = ResponseStore(max_responses=2)
    store.put("t1", response(None, "t1", system, answer))
    store.put("t2", response(None, "t2", system, answer, follow))
    bodies = json_bytes({"id": "t1", "metadata": {"pad": ""}}) * 2
    assert store.num_bytes == bodies + kept(system) + kept(answer) + kept(follow) + 5 * REFERENCE_BYTES
    store.check_invariants()
    store.put("t3", response(None, "t3", {"role": "user", "content": "new"}))  # t1 goes; t2 still holds its messages
    assert store.get("t1", None) is None
    new = {"role": "user", "content": "new"}
    assert store.num_bytes == bodies + sum(map(kept, (system, answer, follow, new))) + 4 * REFERENCE_BYTES
    store.check_invariants()
    assert store.delete("t2", None)
    assert store.num_bytes == json_bytes({"id": "t3", "metadata": {"pad": ""}}) + kept(new) + REFERENCE_BYTES
    store.check_invariants()


def test_a_message_is_kept_once_however_often_its_namespace_holds_it() -> None:
    # Shared by its JSON, not by its object: a next turn's conversation is decoded afresh from the store.
    ok = {"role": "user", "content": "ok"}
    store = ResponseStore()
    store.put("a", response(None, "a", ok, dict(ok), {"role": "assistant", "content": "fine"}))
    store.put("b", response(None, "b", *store.get("a", None).messages, dict(ok)))
    store.check_invariants()  # one copy of each
    assert (
        store.num_bytes
        == 2 * json_bytes({"id": "a", "metadata": {"pad": ""}})
        + kept(ok)
        + kept({"role": "assistant", "content": "fine"})
        + 7 * REFERENCE_BYTES
    )


def test_the_total_bound_is_each_namespaces_fixed_share() -> None:
    store = ResponseStore(max_bytes=1_000, max_total_bytes=1_500, namespaces={"a", "b", "c"})
    assert store.max_bytes == 500 and store.max_response_bytes == 500
    assert ResponseStore(max_bytes=1_000, max_total_bytes=10_000, namespaces={"a", "b"}).max_bytes == 1_000
    assert not store.put("r", response("d", "r"))  # a namespace the server cannot authenticate


def test_the_defaults_keep_the_last_1000_ordinary_responses() -> None:
    # An ordinary response: 4 KiB of instructions, OpenAI's most metadata (16 pairs of 64 + 512 characters), two tool
    # definitions, a 2 KiB answer, and a turn of 8 KiB of new messages.
    store = ResponseStore()
    metadata = {f"{k:064d}": "m" * 512 for k in range(16)}
    tools = [{"type": "function", "name": f"tool_{i}", "parameters": {"type": "object"}} for i in range(2)]
    for i in range(DEFAULT_MAX_STORED_RESPONSES + 5):
        body = {"id": f"r{i}", "instructions": "i" * 4096, "metadata": metadata, "tools": tools, "output": "o" * 2048}
        turn = ({"role": "user", "content": "q" * 6144}, {"role": "assistant", "content": "o" * 2048})
        assert store.put(f"r{i}", StoredResponse(None, body, turn))
    assert len(store) == DEFAULT_MAX_STORED_RESPONSES and store.get("r5", None) is not None
    assert store.num_bytes < DEFAULT_MAX_STORED_BYTES
    assert DEFAULT_MAX_RESPONSE_BYTES == 1 << 20 and DEFAULT_MAX_STORED_BYTES == 64 << 20


@pytest.mark.parametrize(
    "kwargs",
    [{"max_responses": -1}, {"max_bytes": 0}, {"max_total_bytes": 0}, {"max_response_bytes": 0}, {"namespaces": ()}],
)
def test_bad_bounds_are_refused(kwargs) -> None:
    with pytest.raises(InvalidArgumentError):
        ResponseStore(**kwargs)


def held_bytes(fill) -> int:
    """The bytes of memory still allocated after ``fill()`` returns (what it left behind: what the store keeps)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        fill()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_a_namespace_holds_no_more_memory_than_its_byte_bound_whatever_its_characters() -> None:
    # One character past Latin-1 makes Python keep a whole string at 4 bytes a character: 150 responses whose `user`
    # was an emoji and 1,040,000 ASCII characters kept 64 of them, 64 MiB of UTF-8 JSON, in 266 MiB of memory.
    store = ResponseStore(max_bytes=2 << 20, max_response_bytes=1 << 20)

    def fill() -> None:
        for i in range(12):
            body = {"id": f"r{i}", "user": "\N{SMILING FACE WITH SMILING EYES}" + "x" * 200_000}
            assert store.put(f"r{i}", StoredResponse(None, body, ()))

    held = held_bytes(fill)
    assert len(store) == 10  # 200,008 bytes of UTF-8 JSON each
    assert held <= store.max_bytes, f"{held:,} bytes held for a bound of {store.max_bytes:,}"
    store.check_invariants()
    assert store.get("r11", None).body["user"] == "\N{SMILING FACE WITH SMILING EYES}" + "x" * 200_000


def test_a_namespace_of_many_small_messages_holds_no_more_memory_than_its_byte_bound() -> None:
    # A message's JSON can be 30 bytes and a conversation's earlier turns are shared, not copied: what Python keeps
    # for each message and each reference to it counts too, or a chain of turns of short messages passes the bound.
    store = ResponseStore(max_bytes=1 << 20)

    def fill() -> None:
        prior: tuple[dict, ...] = ()
        for turn in range(60):
            new = tuple({"role": "user", "content": f"{turn}.{k}"} for k in range(200))
            store.put(f"t{turn}", StoredResponse(None, {"id": f"t{turn}"}, prior + new))  # False once over the bound
            kept = store.get(f"t{turn}", None)
            prior = () if kept is None else kept.messages

    held = held_bytes(fill)
    assert held <= store.max_bytes, f"{held:,} bytes held for a bound of {store.max_bytes:,}"
    assert 0 < len(store) < 60
    store.check_invariants()


def test_a_stored_response_reads_back_as_it_was_put() -> None:
    body = {"id": "r", "user": "Zürich \N{SMILING FACE WITH SMILING EYES} \udc80 \\u00e9", "n": [1, 2.5, None, True]}
    messages = ({"role": "user", "content": "naïve \udcff"}, {"role": "assistant", "content": None, "tool_calls": []})
    store = ResponseStore()
    assert store.put("r", StoredResponse("k", body, messages)) is False  # "k" is not one of its namespaces
    store = ResponseStore(namespaces={"k"})
    assert store.put("r", StoredResponse("k", body, messages))
    assert store.get("r", "k") == StoredResponse("k", body, messages)
