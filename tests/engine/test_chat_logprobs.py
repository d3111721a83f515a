"""Specification of logprobs through the chat layer: a chat or completion's ``logprobs`` has one entry per generated
token that is not a stop token (the tokens a stop string cut and a tool call's included), serial and batched alike,
and ``submit_chat`` hands each entry over before the text delta its token is part of."""

from __future__ import annotations

import math

from prefixcache import PrefixCachingRunner
from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.chat import complete_chat, prepare_chat, submit_chat
from prefixcache.engine.results import TokenLogprob
from prefixcache.models.llama import LlamaModel
from prefixcache.testing import ScriptedModel, assert_quiescent

ASK = [{"role": "system", "content": "Be brief. " * 6}, {"role": "user", "content": "Say hello."}]
TOKENIZER = ByteTokenizer()
END = TOKENIZER.special_token_id("<|im_end|>")


def scripted(*texts: str) -> PrefixCachingRunner:
    return PrefixCachingRunner(ScriptedModel.from_texts(texts), cache_tokens=4096, block_size=4)


def test_a_chat_has_an_entry_per_generated_token_but_the_stop_token() -> None:
    result = scripted("hello").chat(ASK, max_new_tokens=20, logprobs=2)
    assert result.token_ids == (*TOKENIZER.encode("hello"), END)
    assert [r.token_id for r in result.logprobs] == TOKENIZER.encode("hello")
    assert all(math.isclose(r.logprob, 0.0, abs_tol=1e-6) and len(r.top) == 2 for r in result.logprobs)


def test_without_logprobs_a_chat_has_none() -> None:
    assert scripted("hello").chat(ASK, max_new_tokens=20).logprobs is None


def test_the_tokens_a_stop_string_cut_keep_their_entries() -> None:
    result = scripted("hello there").chat(ASK, max_new_tokens=20, stop=["llo"], logprobs=0)
    assert result.text == "he" and result.finish_reason == "stop"
    assert [r.token_id for r in result.logprobs] == list(result.token_ids) == TOKENIZER.encode("hello")


def test_with_ignore_eos_the_stop_tokens_inside_the_answer_have_no_entry(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=4)
    params = {"max_new_tokens": 24, "logprobs": 1, "ignore_eos": True, "stop_token_ids": frozenset(range(0, 259, 2))}
    done = complete_chat(runner, ASK, **params)
    assert any(t % 2 == 0 for t in done.token_ids) and any(t % 2 for t in done.token_ids)
    assert [r.token_id for r in done.logprobs] == [t for t in done.token_ids if t % 2]


def test_submit_chat_hands_each_entry_over_before_its_text_and_as_the_completion_has_them() -> None:
    runner = scripted("hi there")
    engine = BatchEngine(runner)
    events: list[tuple[str, object]] = []
    prepared = prepare_chat(runner.tokenizer, ASK, max_new_tokens=20, logprobs=3)
    _, future = submit_chat(
        engine,
        prepared,
        on_delta=lambda text: events.append(("delta", text)),
        on_logprob=lambda record: events.append(("logprob", record)),
    )
    engine.run_until_idle()
    done = future.result()
    records = [value for kind, value in events if kind == "logprob"]
    assert tuple(records) == done.logprobs and len(records) == len("hi there")
    expected = []
    for record in records:  # byte tokens, no stop string: every token's text is a delta of its own
        expected += [("logprob", record), ("delta", TOKENIZER.decode([record.token_id]))]
    assert events == expected
    assert_quiescent(runner.cache)


def test_a_batched_chat_has_the_entries_of_the_serial_one(tiny: LlamaModel) -> None:
    serial = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=4).chat(ASK, max_new_tokens=10, logprobs=4)
    runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=4)
    engine = BatchEngine(runner, max_batch_tokens=16)
    seen: list[TokenLogprob] = []
    asked = prepare_chat(runner.tokenizer, ASK, max_new_tokens=10, logprobs=4)
    beside = prepare_chat(runner.tokenizer, [{"role": "user", "content": "Something else."}], max_new_tokens=10)
    _, future = submit_chat(engine, asked, on_logprob=seen.append)
    _, other = submit_chat(engine, beside, on_logprob=seen.append)
    engine.run_until_idle()
    done = future.result()
    assert other.result().logprobs is None
    assert done.token_ids == serial.token_ids and tuple(seen) == done.logprobs
    for a, b in zip(done.logprobs, serial.logprobs, strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= 1e-5
        assert [i for i, _ in a.top] == [i for i, _ in b.top]
    assert_quiescent(runner.cache)
