"""Chat fields that change nothing here are accepted (and checked), template variables reach the template, and
``GET /v1/models/{id}``: a real server on 127.0.0.1 (a free port) and the real ``openai`` client."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.serve import ApiKeys, start_background
from prefixcache.testing import ScriptedModel, assert_quiescent, snapshot

MESSAGES = [{"role": "system", "content": "You answer briefly. " * 10}, {"role": "user", "content": "Hi?"}]
HINTS = {
    "prompt_cache_key": "tenant-7/conversation-3",
    "safety_identifier": "user-hash-1",
    "verbosity": "low",
    "modalities": ["text"],
    "prediction": {"type": "content", "content": [{"type": "text", "text": "Hello there."}]},
    "reasoning_effort": "low",
}
# A Qwen3 / gpt-oss style template: a variable it reads changes the prompt, one it does not read changes nothing.
THINKING_TEMPLATE = (
    "{% if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def scripted(*texts: str) -> PrefixCachingRunner:
    return PrefixCachingRunner(ScriptedModel.from_texts(texts), cache_tokens=8192)


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_fields_that_change_nothing_are_accepted_and_change_nothing(make_app) -> None:
    runner = scripted("Hello there.", "Hello there.")
    with start_background(make_app(runner), "127.0.0.1", 0) as server:
        client = client_for(server)
        plain = client.chat.completions.create(model="scripted", messages=MESSAGES)
        hinted = client.chat.completions.create(
            model="scripted",
            messages=MESSAGES,
            **HINTS,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},  # ChatML reads no variables
        )
    assert hinted.choices[0].message.content == plain.choices[0].message.content == "Hello there."
    assert hinted.usage.prompt_tokens == plain.usage.prompt_tokens
    assert hinted.usage.prompt_tokens_details.cached_tokens == hinted.usage.prompt_tokens - 1
    assert_quiescent(runner.cache)


REFUSED = [
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"modalities": "text"}, "modalities"),
    ({"verbosity": "loud"}, "verbosity"),
    ({"prediction": {"type": "file", "content": "x"}}, "prediction"),
    ({"prediction": {"type": "content", "content": [{"type": "image_url", "image_url": {}}]}}, "prediction"),
    ({"prompt_cache_key": 7}, "prompt_cache_key"),
    ({"reasoning_effort": "max"}, "reasoning_effort"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
]


def test_what_would_change_the_answer_or_has_the_wrong_shape_is_still_a_400(make_app) -> None:
    runner = scripted("x")
    before = snapshot(runner.cache, [runner.namespace_key(None)])
    with start_background(make_app(runner), "127.0.0.1", 0) as server:
        for extra, param in REFUSED:
            body = {"model": "scripted", "messages": MESSAGES, **extra}
            response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
            assert response.status_code == 400, (extra, response.text)
            error = response.json()["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", param), extra
    assert snapshot(runner.cache, [runner.namespace_key(None)]) == before


def test_reasoning_effort_and_chat_template_kwargs_reach_the_template(make_app, byte_bpe_dir: Path) -> None:
    from prefixcache.chat.hf_tokenizer import HFTokenizer

    tokenizer = HFTokenizer(byte_bpe_dir, chat_template=THINKING_TEMPLATE)
    runner = PrefixCachingRunner(ScriptedModel.from_texts(["ok"], tokenizer), tokenizer, cache_tokens=8192)

    def prompt_tokens(**variables) -> int:
        return len(tokenizer.render_chat(MESSAGES, template_kwargs=variables))

    with start_background(make_app(runner), "127.0.0.1", 0) as server:
        client = client_for(server)

        def sent(**options) -> int:
            answer = client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=2, **options)
            return answer.usage.prompt_tokens

        assert sent() == prompt_tokens()
        assert sent(reasoning_effort="high") == prompt_tokens(reasoning_effort="high") > prompt_tokens()
        thinking_off = {"chat_template_kwargs": {"enable_thinking": False}}
        assert sent(extra_body=thinking_off) == prompt_tokens(enable_thinking=False) > prompt_tokens()
        # As vLLM merges them: chat_template_kwargs over reasoning_effort.
        override = {"chat_template_kwargs": {"reasoning_effort": "medium", "enable_thinking": False}}
        both = prompt_tokens(reasoning_effort="medium", enable_thinking=False)
        assert sent(reasoning_effort="low", extra_body=override) == both
    assert_quiescent(runner.cache)


def test_a_model_is_retrieved_by_its_id_and_an_unknown_id_is_a_404(make_app) -> None:
    app = make_app(scripted("x"), model_name="org/model-a")  # a slash, as Hugging Face ids have
    with start_background(app, "127.0.0.1", 0) as server:
        client = client_for(server)
        model = client.models.retrieve("org/model-a")
        assert (model.id, model.object, model.owned_by) == ("org/model-a", "model", "prefixcache")
        assert model.model_dump() == client.models.list().data[0].model_dump()
        with pytest.raises(openai.NotFoundError) as caught:
            client.models.retrieve("gpt-4o")
        response = httpx.get(server.url + "/v1/models/gpt-4o")
    assert caught.value.status_code == 404
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "the model 'gpt-4o' does not exist; this server serves 'org/model-a'",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def test_retrieving_a_model_needs_a_key_when_keys_are_set(make_app, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("secret-1\n")
    app = make_app(scripted("x"), api_keys=ApiKeys.from_file(keys))
    with start_background(app, "127.0.0.1", 0) as server:
        with pytest.raises(openai.AuthenticationError):
            client_for(server).models.retrieve("scripted")
        keyed = openai.OpenAI(base_url=server.url + "/v1", api_key="secret-1", max_retries=0)
        assert keyed.models.retrieve("scripted").id == "scripted"
