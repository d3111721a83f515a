"""ChatDecoder: whatever the tokens, the streamed text is the final content, and the completion is what parsing the
whole decoded text (cut at the first stop string) gives, so streaming and non-streaming answers agree."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.chat.tool_calls import parse_tool_calls
from prefixcache.engine.chat_decoder import ChatDecoder
from prefixcache.engine.runner import GenerationResult, Usage
from prefixcache.engine.sampling import SamplingParams

TOKENIZER = ByteTokenizer()
USAGE = Usage(
    prompt_tokens=1, cached_tokens=0, prefilled_tokens=1, copied_tokens=0, generated_tokens=0, ttft_s=0.0, decode_s=0.0
)
PIECES = [
    "<tool_call>",
    "</tool_call>",
    "\n",
    " ",
    '{"name": "f", "arguments": {"a": "}"}}',
    '{"name": "g"}',
    "{",
    "}",
    '{"name": "f", "arguments": {"a": "\\ud800"}}',
    '{"name": "f", "arguments": {"a": NaN}}',
    b"\xff" * 7,  # a run of stray bytes, then maybe a character
    b"\xe2\x82",  # the first two bytes of "€"
    "Obs",
    "ervation:",
    "é",
    "€",
    "```",
    "<tool",
    "_call>",
    "text",
    '"\\ud800"',
    "NaN",
]


def first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            return min(starts)
    return None


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(PIECES), max_size=12),
    stops=st.lists(st.sampled_from(["Observation:", "}", "</tool_call>", "€", "ca"]), max_size=3),
    cut_bytes=st.integers(0, 3),
    tools=st.booleans(),
)
def test_streamed_text_and_completion_match_the_whole_text(
    pieces: list[str | bytes], stops: list[str], cut_bytes: int, tools: bool
) -> None:
    ids = [i for p in pieces for i in (list(p) if isinstance(p, bytes) else TOKENIZER.encode(p))]
    ids = ids[: len(ids) - cut_bytes] if cut_bytes < len(ids) else ids  # max_tokens may cut a character
    params = SamplingParams(stop_token_ids=TOKENIZER.eos_token_ids, vocab_limit=TOKENIZER.vocab_size)
    decoder = ChatDecoder(TOKENIZER, tuple(stops), params, parse_calls=tools, request_id="r")
    streamed = []
    fed = 0
    for token in ids:
        streamed.append(decoder.feed(token))
        fed += 1
        if decoder.stopped:
            break
    rest, done = decoder.finish(GenerationResult(tuple(ids[:fed]), "length", USAGE))
    streamed.append(rest)

    whole = TOKENIZER.decode(ids)
    cut = first_stop(whole, tuple(stops))
    text = whole if cut is None else whole[:cut]
    expected = parse_tool_calls(text, id_salt="r") if tools else None
    if expected is not None and expected.tool_calls:
        assert (done.content, done.tool_calls, done.finish_reason) == (
            expected.content,
            expected.tool_calls,
            "tool_calls",
        )
    else:
        assert (done.content, done.tool_calls) == (text, ())
        assert done.finish_reason == ("stop" if cut is not None else "length")
    assert "".join(streamed) == (done.content or "")
