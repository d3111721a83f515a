"""``echo`` on /v1/completions (lm-eval's log-likelihood requests: a prompt of token ids, ``echo``, ``logprobs``) and
``stream_options.continuous_usage_stats``, over a real socket with the ``openai`` client: the prompt tokens' logprobs
equal the model's own uncached forward, the first is null, a cached prompt is recomputed for them and says so, and
every streamed chunk carries the usage so far."""

from __future__ import annotations

import httpx
import pytest
import torch

from prefixcache import PrefixCachingRunner
from prefixcache.testing import assert_quiescent

TOLERANCE = 1e-4
PROMPT = "The weather in Paris is mild in spring; the weather in Rome is warm."


def _reference_logprobs(runner: PrefixCachingRunner, ids: list[int]) -> list[float]:
    logits = runner.model.forward_reference(torch.tensor(ids), return_logits=True)[:, : runner.tokenizer.vocab_size]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echoed_prompt_logprobs_equal_the_uncached_forward_even_when_the_prompt_is_cached(
    served_tiny, max_tokens
) -> None:
    runner, _, client = served_tiny
    ids = runner.tokenizer.encode(PROMPT)
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0)
    assert plain.usage.prompt_tokens == len(ids)
    # The prompt is cached now; its logprobs need every position's logits, so it is prefilled again.
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=max_tokens, echo=True, logprobs=2)
    choice = out.choices[0]
    assert choice.text.startswith(runner.tokenizer.decode(ids))
    logprobs = choice.logprobs
    assert logprobs.tokens[: len(ids)] == [runner.tokenizer.decode([t]) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    reference = _reference_logprobs(runner, ids)
    assert max(abs(a - b) for a, b in zip(logprobs.token_logprobs[1 : len(ids)], reference, strict=True)) <= TOLERANCE
    assert all(len(top) >= 2 for top in logprobs.top_logprobs[1 : len(ids)])
    assert len(logprobs.tokens) == len(ids) + max_tokens
    offsets = logprobs.text_offset
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    assert out.usage.completion_tokens == max_tokens
    again = client.completions.create(model="tiny", prompt=ids, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids) - 1  # the prompt stays cached for others
    assert_quiescent(runner.cache)


def test_echo_without_logprobs_prepends_the_prompt_and_streams_it_first(served_tiny) -> None:
    runner, _, client = served_tiny
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    chunks = list(
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True)
    )
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text
    streamed = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=1, stream=True
        )
    )
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=1)
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == whole.choices[0].logprobs.tokens
    assert_quiescent(runner.cache)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(served_tiny, endpoint) -> None:
    runner, _, client = served_tiny
    options = {"include_usage": True, "continuous_usage_stats": True}
    if endpoint == "chat":
        messages = [{"role": "user", "content": PROMPT}]
        stream = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, stream=True, stream_options=options
        )
    else:
        stream = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=8, stream=True, stream_options=options
        )
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] < 8
    assert endpoint != "chat" or counts[0] == 0  # the role chunk comes before any token
    final = chunks[-1].usage
    assert final.completion_tokens == 8 and counts[-2] == 8
    assert {c.usage.prompt_tokens for c in chunks} == {final.prompt_tokens}
    # Unasked, the chunks before the last carry none.
    if endpoint == "chat":
        unasked = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, stream=True))
        assert all(c.usage is None for c in unasked[:-1])
    assert_quiescent(runner.cache)


def test_continuous_usage_stats_are_on_a_streamed_tool_calls_chunk_too(served_tiny) -> None:
    pytest.importorskip("llguidance")  # the call's arguments constrained, so that it completes within the budget
    runner, _, client = served_tiny
    parameters = {"type": "object", "properties": {"a": {"const": "x"}}, "required": ["a"]}
    parameters["additionalProperties"] = False
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        tools=[{"type": "function", "function": {"name": "f", "parameters": parameters}}],
        tool_choice={"type": "function", "function": {"name": "f"}},
        max_tokens=50,
        stream=True,
        stream_options={"continuous_usage_stats": True},
    )
    chunks = list(stream)
    [with_calls] = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert all(c.usage is not None for c in chunks)
    assert with_calls.usage.completion_tokens == chunks[-1].usage.completion_tokens
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert_quiescent(runner.cache)


def test_chat_echo_is_refused(served_tiny) -> None:
    _, url, _ = served_tiny
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "echo": True}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"
