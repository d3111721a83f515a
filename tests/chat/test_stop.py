"""String stop sequences on decoded text, and incremental detokenization."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.chat.stop import StopMatcher, TextStream, check_stop
from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.errors import InvalidArgumentError


def feed_all(matcher: StopMatcher, chunks: list[str]) -> list[str]:
    out = [matcher.feed(chunk) for chunk in chunks]
    out.append(matcher.flush())
    return out


def test_a_stop_split_across_chunks_is_found_and_trimmed() -> None:
    matcher = StopMatcher(("Observation:",))
    out = feed_all(matcher, ["Thought: look it up\nObs", "erva", "tion: 42", " more"])
    assert "".join(out) == "Thought: look it up\n"
    assert matcher.stopped
    # Nothing that later turned out to be the stop string was ever emitted.
    assert out[0] == "Thought: look it up\n"


def test_a_partial_match_that_does_not_complete_is_released() -> None:
    matcher = StopMatcher(("END",))
    assert matcher.feed("the EN") == "the "
    assert matcher.feed("D? no, ENDURE") == ""
    assert matcher.stopped


def test_held_tail_is_flushed_at_the_end() -> None:
    matcher = StopMatcher(("###",))
    assert matcher.feed("a ##") == "a "
    assert matcher.flush() == "##"
    assert not matcher.stopped


def test_the_earliest_of_several_stops_wins() -> None:
    matcher = StopMatcher(("cd", "b"))
    assert feed_all(matcher, ["abcd"]) == ["a", ""]


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abcO:\n", max_size=40),
    stops=st.lists(st.text(alphabet="abcO:", min_size=1, max_size=4), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_matches_a_search_on_the_whole_text_whatever_the_chunking(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    matcher = StopMatcher(tuple(stops))
    emitted = ""
    for chunk in chunks:
        emitted += matcher.feed(chunk)
        # The emitted text never contains, or ends inside, a stop string.
        assert not any(s in emitted for s in stops)
    emitted += matcher.flush()
    cut = first_stop(text, stops)
    assert emitted == (text if cut is None else text[:cut])
    assert matcher.stopped == (cut is not None)


def first_stop(text: str, stops: list[str]) -> int | None:
    """Where the answer ends: generation stops as soon as a stop string is complete, so the stop that ends first
    wins (of two ending together, the longer); ``None`` when no stop string occurs."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            return min(starts)
    return None


def test_the_stop_that_completes_first_wins_however_the_text_is_chunked() -> None:
    # "bc" is complete at "abc", before the overlapping "abcd" is: the answer is "a" whether "abcd" comes as one
    # token or four (it used to be "" in one chunk, as the earliest-starting stop won).
    for chunks in (["abcd"], ["a", "b", "c", "d"], ["ab", "cd"]):
        matcher = StopMatcher(("abcd", "bc"))
        assert "".join(feed_all(matcher, chunks)) == "a", chunks


@pytest.mark.parametrize(("stop", "expected"), [(None, ()), ("x", ("x",)), (["a", "b"], ("a", "b")), ((), ())])
def test_check_stop_normalizes(stop: object, expected: tuple[str, ...]) -> None:
    assert check_stop(stop) == expected  # type: ignore[arg-type]


def test_check_stop_takes_more_than_openais_four_strings() -> None:
    # vLLM has no limit, and lm-eval sends its whole ``until`` list; this used to be refused past 4.
    stops = [f"stop{i}" for i in range(12)]
    assert check_stop(stops) == tuple(stops)
    matcher = StopMatcher(check_stop(stops))
    assert matcher.feed("text stop1") == "text " and matcher.stopped


@pytest.mark.parametrize("stop", [[""], ["a", ""], 3, [1], [None]])
def test_check_stop_rejects(stop: object) -> None:
    with pytest.raises(InvalidArgumentError):
        check_stop(stop)  # type: ignore[arg-type]


def test_text_stream_never_emits_half_a_character() -> None:
    tok = ByteTokenizer()
    text = "naïve 🙂 日本"
    stream = TextStream(tok, skip={258})
    pieces = [stream.push(t) for t in [*tok.encode(text), 258]]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) + stream.flush() == text
    assert pieces[-1] == ""  # the end-of-turn token makes no text


def test_text_stream_after_a_run_of_invalid_bytes_still_decodes_the_next_character() -> None:
    # Seven stray bytes then "€" (3 bytes): the stream used to give up holding at 8 ids and emit "€"'s first byte
    # as U+FFFD, so the text (and any stop string in it) differed from the tokenizer's decode of the same ids.
    tok = ByteTokenizer()
    ids = [0xFF] * 7 + list("€ ok".encode())
    stream = TextStream(tok)
    assert "".join(stream.push(t) for t in ids) + stream.flush() == tok.decode(ids) == "\ufffd" * 7 + "€ ok"


@settings(max_examples=400, deadline=None)
@given(
    ids=st.lists(st.sampled_from([0x61, 0x20, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80, 0xFF]), max_size=40)
)
def test_text_stream_equals_decoding_all_the_ids_at_once(ids: list[int]) -> None:
    tok = ByteTokenizer()
    stream = TextStream(tok)
    assert "".join(stream.push(t) for t in ids) + stream.flush() == tok.decode(ids)
