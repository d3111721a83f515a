"""Structured outputs in the engine: with the random-weight tiny model every constrained answer is JSON valid against
its schema, batched equals serial (constrained and free requests mixed), a preempted request's tokens are its
unpreempted ones, and a cached rerun answers the same."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.testing import require_extra  # noqa: E402

require_extra("llguidance", "structured")
if os.environ.get("CI") != "true":
    pytest.importorskip("jsonschema", reason="needs: pip install 'prefixcache[test]'")
import jsonschema  # noqa: E402

from prefixcache import PrefixCachingRunner, SamplingParams  # noqa: E402
from prefixcache.chat.tokenizer import ByteTokenizer  # noqa: E402
from prefixcache.engine.batching import BatchEngine  # noqa: E402
from prefixcache.engine.grammar import Grammar  # noqa: E402
from prefixcache.errors import InvalidArgumentError  # noqa: E402
from prefixcache.models.llama import LlamaModel  # noqa: E402
from prefixcache.testing import assert_quiescent  # noqa: E402

TOKENIZER = ByteTokenizer()
SCHEMAS = [
    {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "yy"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3},
        },
        "required": ["ok", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "number", "maximum": 10}},
        "required": ["name"],
        "additionalProperties": False,
    },
]
PROMPTS = [TOKENIZER.encode(text) for text in ("Give me JSON: ", "A record, please. ", "{", "Answer: ")]


def sampling(schema: dict | None, **options) -> SamplingParams:
    grammar = None if schema is None else Grammar.json_schema(schema, TOKENIZER)
    options.setdefault("max_new_tokens", 80)
    return SamplingParams(grammar=grammar, stop_token_ids=TOKENIZER.eos_token_ids, vocab_limit=259, **options)


def answer(token_ids: tuple[int, ...]) -> object:
    """The JSON of a constrained answer: its text before the stop token that ends it."""
    assert token_ids[-1] in TOKENIZER.eos_token_ids
    return json.loads(TOKENIZER.decode(token_ids[:-1]))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_constrained_answer_is_json_valid_against_its_schema(
    tiny: LlamaModel, index: int, temperature: float
) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=4096)
    result = runner.generate(PROMPTS[index], sampling(SCHEMAS[index], temperature=temperature, seed=5))
    assert result.finish_reason == "stop"
    jsonschema.validate(answer(result.token_ids), SCHEMAS[index])
    assert_quiescent(runner.cache)


def test_a_cached_rerun_answers_the_same(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=4096)
    params = sampling(SCHEMAS[0], temperature=0.8, seed=3)
    first = runner.generate(PROMPTS[0], params)
    second = runner.generate(PROMPTS[0], params)
    assert second.usage.cached_tokens > 0
    assert second.token_ids == first.token_ids


def test_batched_constrained_and_free_requests_equal_their_serial_answers(tiny: LlamaModel) -> None:
    requests = [(PROMPTS[i], sampling(SCHEMAS[i], temperature=0.7, seed=i)) for i in range(3)]
    requests.append((PROMPTS[3], sampling(None, max_new_tokens=20)))
    serial = [PrefixCachingRunner(tiny, cache_tokens=4096).generate(p, s).token_ids for p, s in requests]
    runner = PrefixCachingRunner(tiny, cache_tokens=4096)
    engine = BatchEngine(runner)
    try:
        handles = [engine.submit(p, s) for p, s in requests]
        engine.run_until_idle()
        assert [h.result().token_ids for h in handles] == serial
    finally:
        engine.close()
    for index, token_ids in enumerate(serial[:3]):
        jsonschema.validate(answer(token_ids), SCHEMAS[index])
    assert_quiescent(runner.cache)


def test_a_preempted_constrained_request_gives_its_unpreempted_tokens(tiny: LlamaModel) -> None:
    block = 4
    requests = [(PROMPTS[i][:7], sampling(SCHEMAS[i], temperature=0.9, seed=i, max_new_tokens=40)) for i in range(3)]
    alone = [PrefixCachingRunner(tiny, cache_tokens=4096, block_size=block).generate(p, s) for p, s in requests]
    # 7 prompt + up to 40 answer tokens each on 14 blocks of 4: all three are admitted, not all can finish together.
    runner = PrefixCachingRunner(tiny, cache_tokens=14 * block, block_size=block)
    engine = BatchEngine(runner)
    try:
        handles = [engine.submit(p, s) for p, s in requests]
        engine.run_until_idle()
        results = [h.result() for h in handles]
        assert engine.preempted_requests > 0
    finally:
        engine.close()
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]
    assert [r.finish_reason for r in results] == ["stop"] * 3
    assert_quiescent(runner.cache)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    index=st.integers(0, len(SCHEMAS) - 1),
    seed=st.integers(0, 2**16),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.5]),
    top_k=st.sampled_from([0, 5]),
)
def test_any_seed_and_temperature_give_valid_json(
    tiny: LlamaModel, index: int, seed: int, temperature: float, top_k: int
) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=4096)
    params = sampling(SCHEMAS[index], temperature=temperature, seed=seed, top_k=top_k, max_new_tokens=120)
    result = runner.generate(PROMPTS[seed % len(PROMPTS)], params)
    assert result.finish_reason == "stop"
    jsonschema.validate(answer(result.token_ids), SCHEMAS[index])


def test_json_object_gives_an_object_or_runs_out_of_tokens_inside_one(tiny: LlamaModel) -> None:
    params = SamplingParams(
        max_new_tokens=200,
        grammar=Grammar.json_object(TOKENIZER),
        stop_token_ids=TOKENIZER.eos_token_ids,
        vocab_limit=259,
    )
    result = PrefixCachingRunner(tiny, cache_tokens=4096).generate(PROMPTS[0], params)
    if result.finish_reason == "stop":
        assert isinstance(answer(result.token_ids), dict)
    else:
        assert TOKENIZER.decode(result.token_ids).startswith("{")


def test_without_stop_tokens_a_complete_grammar_ends_the_request(tiny: LlamaModel) -> None:
    params = SamplingParams(max_new_tokens=50, grammar=Grammar.json_schema({"enum": ["yes", "no"]}, TOKENIZER))
    result = PrefixCachingRunner(tiny, cache_tokens=4096).generate(PROMPTS[0], params)
    assert result.finish_reason == "stop"
    assert json.loads(TOKENIZER.decode(result.token_ids)) in ("yes", "no")


@pytest.mark.parametrize(
    ("schema", "message"),
    [({"type": "frob"}, "frob"), ([1, 2], "JSON Schema object"), ({"$ref": "#/nowhere"}, "json_schema")],
)
def test_a_bad_schema_is_an_invalid_argument(schema: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        Grammar.json_schema(schema, TOKENIZER)


def test_grammar_must_be_a_grammar() -> None:
    with pytest.raises(InvalidArgumentError, match="grammar"):
        SamplingParams(grammar='{"type": "object"}')
    assert sampling(SCHEMAS[0]) == sampling(SCHEMAS[0]) and hash(sampling(SCHEMAS[0])) == hash(sampling(SCHEMAS[0]))
