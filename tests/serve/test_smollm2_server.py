"""``prefixcache serve --model smollm2`` as a user runs it (a subprocess, the engine in its own process, the real
``openai`` client): a real instruct model answers in English in float32 and bfloat16, and a required tool call through
the generic tool format (SmolLM2's template does not render tools) comes back parsed, valid against its schema, with
the follow-up turn served from the cache."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import openai
import pytest

from prefixcache.testing import require_extra, require_smollm2

require_smollm2()
require_extra("gguf", "hf")
jsonschema = require_extra("jsonschema", "test")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module", params=["float32"])
def server(request) -> Iterator[tuple[str, openai.OpenAI, str]]:
    """``(dtype, client, start line)`` of ``prefixcache serve --model smollm2 --dtype DTYPE`` on a free port.

    One dtype: the server passes requests to the same engine whatever the weights' dtype, and bfloat16's exactness is
    tested in-process (tests/models/test_smollm2.py, its start line there too), where a bfloat16 prefill on a CPU
    without bfloat16 instructions does not cost a second server's start and its prompts."""
    command = [sys.executable, "-m", "prefixcache", "serve", "--model", "smollm2", "--dtype", request.param]
    command += ["--port", "0", "--cache-tokens", "8192"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("serving 'smollm2' at "), (line, process.stderr.read() if not line else "")
        url = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line).group(1)
        yield request.param, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120), line
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
    assert process.returncode == 0


def test_the_start_line_names_the_gguf_file_and_the_dtype_of_weights_and_kv(server) -> None:
    dtype, _, line = server
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in line
    assert f"weights {dtype}, K/V {dtype}" in line
    assert "(the GGUF file's own)" in line


def test_a_question_is_answered_in_english_and_the_next_turn_hits_the_cache(server) -> None:
    _, client, _ = server
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(model="smollm2", messages=ask, max_tokens=24, temperature=0)
    text = first.choices[0].message.content
    assert "Paris" in text, text
    follow = [*ask, {"role": "assistant", "content": text}, {"role": "user", "content": "And of Germany?"}]
    second = client.chat.completions.create(model="smollm2", messages=follow, max_tokens=24, temperature=0)
    assert "Berlin" in second.choices[0].message.content, second.choices[0].message.content
    # Everything of the first turn but its sampled end-of-turn token, whose K/V no forward computed.
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_a_required_tool_call_is_parsed_valid_and_its_follow_up_is_cached_to_the_calls_end(server) -> None:
    require_extra("llguidance", "structured")
    dtype, client, _ = server
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    first = client.chat.completions.create(
        model="smollm2", messages=ask, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0
    )
    assert first.choices[0].finish_reason == "tool_calls", first.choices[0].message.content
    [call] = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert "paris" in arguments["city"].lower()
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 18, "sky": "cloudy"})}
    history = [*ask, first.choices[0].message.model_dump(exclude_none=True), result]
    second = client.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], max_tokens=32)
    assert second.choices[0].message.content
    earlier = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens > earlier
    # Every token of the first turn, the call included, but the end-of-turn token it was stopped by.
    assert second.usage.prompt_tokens_details.cached_tokens == earlier - 1, dtype
