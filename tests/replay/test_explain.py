"""Miss explanations: where a prompt leaves the cache, the text around it, and the chat message it falls in."""

from __future__ import annotations

from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.cli import main
from prefixcache.errors import TemplateError
from prefixcache.replay.explain import (
    DivergenceTally,
    Explanation,
    MessageSpan,
    explain,
    format_divergences,
    locate_message,
    message_spans,
)
from prefixcache.replay.replayer import Replayer, replay_paths

TOK = ByteTokenizer()
SYSTEM = {"role": "system", "content": "You are terse."}
A = [SYSTEM, {"role": "user", "content": "Hi"}]
B = [SYSTEM, {"role": "user", "content": "Ho"}]
TIMESTAMP = "scenarios/timestamp_system_prompt.jsonl"


def test_message_spans_cover_each_rendered_message() -> None:
    # <|im_start|> "system\nYou are terse." <|im_end|> "\n" = 1 + 21 + 1 + 1 tokens; then 1 + 7 + 1 + 1 for "Hi".
    assert message_spans(TOK, A) == [MessageSpan(0, "system", 0, 24), MessageSpan(1, "user", 24, 34)]


def test_a_tools_preamble_before_the_first_message_is_in_no_span() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    spans = message_spans(TOK, [{"role": "user", "content": "x"}], tools)
    assert spans[0].start > 0
    assert locate_message(spans, 0) is None
    assert locate_message(spans, spans[0].start) == spans[0]
    assert locate_message(spans, spans[0].end) is None


def test_two_prompts_differing_in_one_character_diverge_there_with_message_and_text(make_cache, put) -> None:
    cache = make_cache(num_blocks=32, block_size=4)
    cached = TOK.render_chat(A)
    put(cache, cached)
    prompt = TOK.render_chat(B)
    spans = message_spans(TOK, B)

    e = explain(cache, prompt, tokenizer=TOK, messages_spans=spans, before_tokens=6, after_tokens=4)

    assert e == Explanation(
        kind="diverged",
        num_tokens=45,
        diverge_at=31,  # "H" is token 30 (after 24 of message 0 and <|im_start|> "user\n"); "i" != "o" at 31
        closest_length=45,
        closest_ids=(ord("i"), 258, 10, 257),
        request_ids=(ord("o"), 258, 10, 257),
        text_before="user\nH",
        cached_text="i<|im_end|>\n<|im_start|>",
        request_text="o<|im_end|>\n<|im_start|>",
        message_index=1,
        message_role="user",
    )
    assert e.summary() == (
        "diverges from a cached sequence of 45 tokens at token 31, message 1 (user): "
        "`...user\\nH` then cached `i<|im_end|>\\n<|im_start|>...` vs request `o<|im_end|>\\n<|im_start|>...`"
    )


def test_explain_is_read_only(make_cache, put) -> None:
    cache = make_cache(num_blocks=32, block_size=4)
    put(cache, [1, 2, 3, 4, 5])
    put(cache, [9, 9, 9])
    before = cache.stats()
    explain(cache, [1, 2, 3, 4, 5, 6])
    assert cache.stats() == before
    cache.evict(1)  # still the least recently used: explain did not refresh it, so its tail block goes
    assert sorted(cache.cached_sequences()) == [[1, 2, 3, 4], [9, 9, 9]]


def test_kinds_cold_hit_extends_and_diverged_at_the_first_token(make_cache, put) -> None:
    cache = make_cache(num_blocks=32, block_size=4)
    assert explain(cache, [1, 2]).kind == "cold"
    put(cache, [1, 2, 3, 4, 5])
    hit = explain(cache, [1, 2, 3])
    assert (hit.kind, hit.diverge_at, hit.closest_length, hit.closest_ids, hit.request_ids) == ("hit", 3, 5, (4, 5), ())
    assert explain(cache, [1, 2, 3, 4, 5]).closest_length == 5
    extends = explain(cache, [1, 2, 3, 4, 5, 6, 7])
    assert (extends.kind, extends.diverge_at, extends.closest_length, extends.request_ids) == ("extends", 5, 5, (6, 7))
    other = explain(cache, [8, 1])
    assert (other.kind, other.diverge_at, other.closest_length, other.closest_ids) == (
        "diverged",
        0,
        5,
        (1, 2, 3, 4, 5),
    )


def test_the_closest_of_several_continuations_is_the_most_recently_used(make_cache, put) -> None:
    cache = make_cache(num_blocks=32, block_size=4)
    put(cache, [1, 2, 3, 4, 5, 6, 7])
    put(cache, [1, 2, 3, 9])
    cache.match([1, 2, 3, 4])  # makes the longer one the most recent again
    e = explain(cache, [1, 2, 3, 8, 8])
    assert (e.diverge_at, e.closest_length, e.closest_ids, e.request_ids) == (3, 7, (4, 5, 6, 7), (8, 8))


def test_the_tally_groups_divergences_by_token_and_message() -> None:
    def diverged(at: int, message: int | None) -> Explanation:
        return Explanation("diverged", 10, at, 10, (), (), message_index=message, message_role="user")

    tally = DivergenceTally()
    for e in [diverged(4, 0), diverged(4, 0), diverged(7, 1), diverged(4, 0), Explanation("cold", 3, 0, 0, (), ())]:
        tally.add(e)
    top = tally.top(3)
    assert [(p.token_index, p.message_index, p.count, p.requests) for p in top] == [(4, 0, 3, 5), (7, 1, 1, 5)]
    assert top[0].summary() == "60% of requests (3/5) diverge at token 4, message 0 (user)"
    assert tally.kinds == {"hit": 0, "diverged": 4, "extends": 0, "cold": 1}


def test_the_timestamp_scenario_is_explained_by_its_timestamp() -> None:
    report = replay_paths([TIMESTAMP], Replayer(None, explain=True))
    scenario = report.scenarios[0]
    assert scenario.explain_kinds == {"hit": 0, "diverged": 9, "extends": 2, "cold": 1}
    top = scenario.divergences[0]
    assert (top.token_index, top.message_index, top.message_role, top.count, top.requests) == (46, 0, "system", 9, 12)
    assert "2024-05-15" in top.example.text_before
    assert top.summary().startswith("75% of requests (9/12) diverge at token 46, message 0 (system): `...")
    assert "2024-05-15 15:0" in top.summary()
    assert report.to_json()["scenarios"][TIMESTAMP]["divergences"][0]["token_index"] == 46


def test_format_divergences_says_when_nothing_diverged() -> None:
    text = format_divergences("s.jsonl", {"hit": 0, "diverged": 0, "extends": 2, "cold": 1}, [])
    assert text == (
        "s.jsonl: 3 requests, each compared with the cache just before it ran: 0 diverged from a cached sequence, "
        "2 extended one, 0 fully cached, 1 met an empty cache\n  no request diverged from a cached sequence"
    )


def test_replay_explain_prints_the_timestamp(capsys) -> None:
    assert main(["replay", TIMESTAMP, "--no-model", "--no-progress", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "75% of requests (9/12) diverge at token 46, message 0 (system)" in out
    assert "2024-05-15" in out


def test_ids_the_tokenizer_cannot_decode_give_positions_without_text(make_cache, put) -> None:
    cache = make_cache(num_blocks=32, block_size=4)
    put(cache, [1000, 1001, 1002])
    e = explain(cache, [1000, 1005], tokenizer=TOK)
    assert (e.kind, e.diverge_at, e.text_before, e.request_text) == ("diverged", 1, None, None)
    assert e.summary() == "diverges from a cached sequence of 3 tokens at token 1"


def test_replay_explain_of_a_mooncake_trace_reports_token_positions(tmp_path, capsys) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [7, 8]}',
        '{"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [7, 9]}',
    ]
    trace.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(trace), "--no-model", "--no-progress", "--explain"]) == 0
    assert "50% of requests (1/2) diverge at token 512\n" in capsys.readouterr().out


def test_message_spans_start_at_zero_when_the_template_refuses_an_empty_conversation() -> None:
    class RefusesEmpty(ByteTokenizer):
        def render_chat(self, messages, tools=None, add_generation_prompt=True):
            if not messages:
                raise TemplateError("Cannot apply chat template to an empty conversation")
            return super().render_chat(messages, tools, add_generation_prompt)

    messages = [{"role": "system", "content": "hi"}, {"role": "user", "content": "yo"}]

    spans = message_spans(RefusesEmpty(), messages)

    # <|im_start|> "system\nhi" <|im_end|> "\n" = 1 + 9 + 1 + 1 tokens, then 1 + 7 + 1 + 1 for the user turn.
    assert [(s.start, s.end) for s in spans] == [(0, 12), (12, 22)]
