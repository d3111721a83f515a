"""Constrained and penalised decoding in the batch engine, as a property: requests arriving at drawn steps, sharing
prefixes (the cache hits) on a pool too small for all of them at once (preemption and eviction), each with drawn
sampling parameters (greedy or seeded temperature, top-k, top-p, min-p, the penalties, logit bias, min_tokens,
ignore_eos, stop tokens, a stop sequence, logprobs) and, for some, a JSON-schema grammar or the lazy grammar of strict
tool calls, give token for token what each gives served alone, serially, on an empty cache.
``PREFIXCACHE_PROPERTY_EXAMPLES`` sets the examples drawn (40; a bug hunt runs thousands)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
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
from prefixcache.engine.results import GenerationResult  # noqa: E402
from prefixcache.models.llama import LlamaModel  # noqa: E402
from prefixcache.testing import assert_quiescent  # noqa: E402

BLOCK = 4
VOCAB = 259  # the byte tokenizer's bytes and specials; the tiny model's table is wider
TOKENIZER = ByteTokenizer()
EOS = TOKENIZER.eos_token_ids
SCHEMAS = [
    {"enum": ["yes", "no"]},
    {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "yy"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}, "required": ["s"]},
]
TOOLS = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": SCHEMAS[1]}}]
# The JSON schemas, then strict tool calls under "auto": free text (valid UTF-8) with calls that follow the schema.
GRAMMARS = [*(Grammar.json_schema(schema, TOKENIZER) for schema in SCHEMAS), Grammar.tool_calls(TOOLS, TOKENIZER)]
TOOL_CALLS = len(SCHEMAS)
PREFIXES = [TOKENIZER.encode("System: answer in JSON. "), TOKENIZER.encode("You are terse; reply: ")]
STOP_SEQUENCES = [(), (ord('"'),), (ord(","), ord(" ")), (ord("e"),), (ord("}"),), (ord("a"), ord("b"))]


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _stopper(stop: Sequence[int], generated: list[int]) -> Callable[[int], bool]:
    """An ``on_token`` that records each token and asks to stop once the answer ends with ``stop`` (a stop string of
    the chat layer, on the byte tokenizer's ids)."""
    width = len(stop)

    def on_token(token: int) -> bool:
        generated.append(token)
        return bool(width) and tuple(generated[-width:]) == tuple(stop)

    return on_token


def alone(tiny: LlamaModel, prompt: list[int], params: SamplingParams, stop: Sequence[int]) -> GenerationResult:
    """The request served by itself on a fresh runner (an empty cache with room to spare): the reference.  The stop
    sequence ends it as a stop string does a serial stream, by sending ``"stop"`` after the token that completes it."""
    steps = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK).stream(prompt, params)
    generated: list[int] = []
    stops = _stopper(stop, generated)
    try:
        token = next(steps)
        while True:
            token = steps.send("stop") if stops(token) else next(steps)
    except StopIteration as done:
        return done.value


@st.composite
def samplings(draw: st.DrawFn) -> tuple[SamplingParams, int | None, tuple[int, ...]]:
    """Drawn sampling parameters, the index of the schema constraining the answer (None: free text) and a stop
    sequence (empty: none; a token the bias favours among the choices, so that free text meets one too)."""
    schema = draw(st.none() | st.integers(0, len(GRAMMARS) - 1), label="schema")
    temperature = draw(st.sampled_from([0.0, 0.0, 0.6, 1.0, 1.7]), label="temperature")
    max_new_tokens = draw(st.integers(1, 16) if schema is None else st.integers(8, 36), label="max_new_tokens")
    # A stop id inside a grammar's alphabet would be refused there but where the text may end: free text only.
    extra_stop = frozenset() if schema is not None else draw(st.sets(st.integers(0, VOCAB - 1), max_size=1))
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=None if temperature == 0 else draw(st.integers(0, 2**63 - 1), label="seed"),
        top_k=draw(st.sampled_from([0, -1, 1, 3, 40]), label="top_k"),
        top_p=draw(st.sampled_from([1.0, 0.9, 0.4]), label="top_p"),
        min_p=draw(st.sampled_from([0.0, 0.05, 0.5]), label="min_p"),
        presence_penalty=draw(st.sampled_from([0.0, 0.0, 1.0, -1.5, 2.0]), label="presence_penalty"),
        frequency_penalty=draw(st.sampled_from([0.0, 0.0, 0.5, -0.7, 2.0]), label="frequency_penalty"),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3, 0.7, 3.0]), label="repetition_penalty"),
        logit_bias=draw(
            st.dictionaries(st.integers(0, VOCAB - 1), st.sampled_from([-100.0, -4.0, 3.0, 100.0]), max_size=3),
            label="logit_bias",
        ),
        min_tokens=draw(st.integers(0, max_new_tokens // 2), label="min_tokens"),
        ignore_eos=draw(st.booleans(), label="ignore_eos"),
        stop_token_ids=EOS | extra_stop,
        vocab_limit=VOCAB,
        logprobs=draw(st.sampled_from([None, None, 0, 3]), label="logprobs"),
        grammar=None if schema is None else GRAMMARS[schema],
    )
    favoured = [(token,) for token, bias in params.logit_bias if bias > 0]
    return params, schema, draw(st.sampled_from(STOP_SEQUENCES + favoured), label="stop sequence")


def _check_answer(result: GenerationResult, params: SamplingParams, schema: int | None, stopped: bool) -> None:
    """What the parameters promise of any answer: its length bounds, its stop token's place, its grammar."""
    tokens = result.token_ids
    assert len(tokens) <= params.max_new_tokens and all(0 <= t < VOCAB for t in tokens)
    stops = [i for i, t in enumerate(tokens) if t in params.stop_token_ids]
    if not params.ignore_eos and not stopped:
        assert all(i >= params.min_tokens for i in stops)  # masked before min_tokens, and a stop token ends it
        assert stops in ([], [len(tokens) - 1])
    if schema is None:
        return
    text = bytes(tokens[:-1] if stops and stops[-1] == len(tokens) - 1 else tokens)
    if schema == TOOL_CALLS and result.finish_reason == "stop" and not stopped:
        text.decode()  # a complete answer of text is valid UTF-8
    elif result.finish_reason == "stop" and not stopped:
        jsonschema.validate(json.loads(text), SCHEMAS[schema])


@settings(
    max_examples=int(os.environ.get("PREFIXCACHE_PROPERTY_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data(), num_requests=st.integers(2, 6))
def test_batched_constrained_and_penalised_requests_equal_each_served_alone(
    tiny: LlamaModel, data: st.DataObject, num_requests: int
) -> None:
    requests, wants = [], []
    for index in range(num_requests):
        # A prompt under a shared prefix, or an earlier request's prompt and answer and more (the next turn of a
        # chat, which hits the cache for all of them), or an earlier prompt again.
        kind = data.draw(st.sampled_from(["prefix", "prefix", "next turn", "again"] if index else ["prefix"]))
        if kind == "prefix":
            prefix = PREFIXES[data.draw(st.integers(0, len(PREFIXES) - 1), label="prefix")]
            prompt = prefix[: data.draw(st.integers(0, len(prefix)), label="shared part")]
            prompt = prompt + _ids(data.draw(st.integers(1, 8), label="own tokens"), seed=index)
        else:
            earlier = data.draw(st.integers(0, index - 1), label="earlier request")
            prompt = list(requests[earlier][0])
            if kind == "next turn":
                prompt += list(wants[earlier].token_ids) + _ids(data.draw(st.integers(1, 4)), seed=index)
        params, schema, stop = data.draw(samplings(), label="sampling")
        arrival = data.draw(st.integers(0, 4), label="arrival step")
        cancel_at = data.draw(st.none() | st.none() | st.integers(0, 20), label="cancelled at step")
        requests.append((prompt, params, schema, stop, arrival, cancel_at))
        wants.append(alone(tiny, prompt, params, stop))
    longest = max(len(prompt) + params.max_new_tokens for prompt, params, *_ in requests)
    # Every request fits the pool alone; together they need more than it holds.
    num_blocks = data.draw(st.integers(-(-longest // BLOCK), -(-longest // BLOCK) + 3), label="pool blocks")
    runner = PrefixCachingRunner(tiny, num_blocks=num_blocks, block_size=BLOCK)
    engine = BatchEngine(
        runner,
        max_batch_tokens=data.draw(st.sampled_from([4, 16, 64, 512]), label="max_batch_tokens"),
        max_running=data.draw(st.sampled_from([32, 32, 2, 1]), label="max_running"),
        policy=data.draw(st.sampled_from(["lpm", "fcfs"]), label="policy"),
        max_wait_steps=4,
    )
    handles: dict[int, object] = {}
    generated: list[list[int]] = [[] for _ in requests]
    step = 0
    try:
        while len(handles) < len(requests) or engine.num_pending:
            for index, (prompt, params, _, stop, arrival, cancel_at) in enumerate(requests):
                if arrival == step:
                    handles[index] = engine.submit(prompt, params, on_token=_stopper(stop, generated[index]))
                if cancel_at == step and index in handles:
                    handles[index].cancel()
            engine.step()
            step += 1
            assert step < 3000, "the engine made no progress"
    finally:
        engine.close()
    for index, ((prompt, params, schema, stop, *_), want) in enumerate(zip(requests, wants, strict=True)):
        try:
            got = handles[index].result()
        except CancelledError:
            assert handles[index].cancelled
            event("a request was cancelled")
            continue
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), f"request {index}"
        assert list(got.token_ids) == generated[index]
        if params.logprobs is not None:
            assert [r.token_id for r in got.logprobs] == list(got.token_ids)
            for mine, theirs in zip(got.logprobs, want.logprobs, strict=True):
                assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
                assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
        assert got.usage.cached_tokens + got.usage.prefilled_tokens == len(prompt)
        stopped = bool(stop) and tuple(got.token_ids[-len(stop) :]) == stop
        _check_answer(got, params, schema, stopped)
        ending = "stop sequence" if stopped else got.finish_reason
        event(f"{'free' if schema is None else 'constrained'} answer ends: {ending}")
        if got.usage.cached_tokens:
            event("a prompt hit the cache")
    event(f"preemptions: {min(engine.preempted_requests, 3)}")
    event(f"evictions: {min(runner.cache.stats().evicted_blocks, 1)}")
    assert_quiescent(runner.cache)
    runner.cache.check_invariants()
