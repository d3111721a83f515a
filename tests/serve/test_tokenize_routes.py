"""vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``: the ids are those the completion endpoints run (their
usage counts them), the text round-trips, and a wrong body is a 400 naming the parameter."""

from __future__ import annotations

import httpx
import pytest

from prefixcache.testing import assert_quiescent

TEXT = "Weather in Paris? <|im_end|> é"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


def test_tokenize_gives_the_ids_the_completion_endpoints_count(served_tiny) -> None:
    runner, url, client = served_tiny
    text = httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": TEXT, "add_special_tokens": False}).json()
    assert text["tokens"] == runner.tokenizer.encode(TEXT) and text["count"] == len(text["tokens"])
    assert text["token_strs"] is None
    completion = client.completions.create(model="tiny", prompt=TEXT, max_tokens=1)
    assert completion.usage.prompt_tokens == text["count"]
    chat = httpx.post(url + "/tokenize", json={"messages": MESSAGES, "return_token_strs": True}).json()
    assert chat["tokens"] == runner.tokenizer.render_chat(MESSAGES, add_generation_prompt=True)
    assert chat["token_strs"] == [runner.tokenizer.decode([token]) for token in chat["tokens"]]
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    assert answer.usage.prompt_tokens == chat["count"]
    history = httpx.post(url + "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert chat["tokens"][: history["count"]] == history["tokens"] and history["count"] < chat["count"]
    assert_quiescent(runner.cache)


def test_detokenize_inverts_tokenize_and_the_info_names_the_end_token(served_tiny) -> None:
    runner, url, _ = served_tiny
    ids = httpx.post(url + "/tokenize", json={"prompt": TEXT}).json()["tokens"]
    assert httpx.post(url + "/detokenize", json={"tokens": ids}).json() == {"prompt": TEXT}
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["vocab_size"] == runner.tokenizer.vocab_size
    assert info["tokenizer_class"] == runner.tokenizer.name


@pytest.mark.parametrize(
    ("path", "body", "param", "status"),
    [
        ("/tokenize", {"prompt": "x", "max_tokens": 3}, "max_tokens", 400),
        ("/tokenize", {"prompt": ["x"]}, "prompt", 400),
        ("/tokenize", {}, "prompt", 400),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model", 404),
        ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, "return_token_strs", 400),
        ("/tokenize", {"messages": []}, "messages", 400),
        ("/tokenize", {"messages": [{"role": "user", "content": 5}]}, "messages", 400),
        ("/tokenize", {"messages": [{"role": "bogus", "content": "x"}]}, "messages", 400),
        ("/v1/cache/prefill", {"prompt": "x", "priority": 2**63}, "priority", 400),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens", 400),
        ("/detokenize", {"tokens": "abc"}, "tokens", 400),
        ("/detokenize", {}, "tokens", 400),
    ],
)
def test_a_wrong_body_is_refused_naming_the_parameter(served_tiny, path, body, param, status) -> None:
    _, url, _ = served_tiny
    answer = httpx.post(url + path, json=body)
    assert answer.status_code == status and answer.json()["error"]["param"] == param
