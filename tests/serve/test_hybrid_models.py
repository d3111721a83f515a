"""Hybrid, sliding-window and latent-attention models behind the server: ``prefixcache serve --model-config`` takes
them, and a chat's second turn through the OpenAI client resumes the first (a recurrent model at its kept state)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("transformers", reason="needs: pip install 'prefixcache[hf]'")

from prefixcache import PrefixCachingRunner  # noqa: E402
from prefixcache.cli import main  # noqa: E402
from prefixcache.models.hf import random_model_from_config  # noqa: E402
from prefixcache.models.hf_tiny import tiny_hf_config  # noqa: E402


def _config_file(tmp_path, model_type: str) -> str:
    folder = tmp_path / f"tiny-{model_type}"
    tiny_hf_config(model_type, max_position_embeddings=4096).save_pretrained(folder)
    return str(folder / "config.json")


@pytest.fixture
def served(monkeypatch) -> dict:
    """``main(["serve", ...])`` without a socket: the app it would have served."""
    import prefixcache.serve

    seen: dict = {}

    def serve_forever(app, host, port, *, log_level, announce) -> None:
        seen.update(app=app)
        app.state.engine.close()

    monkeypatch.setattr(prefixcache.serve, "serve_forever", serve_forever)
    return seen


@pytest.mark.parametrize("model_type", ["qwen3_next", "nemotron_h", "mamba2"])
def test_serve_takes_a_hybrid_model_config_and_keeps_its_states(served: dict, tmp_path, model_type: str) -> None:
    assert main(["serve", "--no-engine-process", "--model-config", _config_file(tmp_path, model_type)]) == 0
    runner = served["app"].state.runner
    assert runner.model.recurrent
    assert runner.cache.max_state_bytes >= 16 * runner.model.state_bytes > 0


def test_a_second_chat_turn_resumes_the_first_at_its_kept_state(make_app, asgi_client, tmp_path) -> None:
    runner = PrefixCachingRunner(random_model_from_config(_config_file(tmp_path, "qwen3_next")), cache_tokens=4096)
    client = asgi_client(make_app(runner, model_name="tiny-qwen3-next"))
    system = {"role": "system", "content": "You are a terse assistant. " * 4}

    async def conversation() -> tuple:
        messages = [system, {"role": "user", "content": "Where is my bag?"}]
        first = await client.chat.completions.create(model="tiny-qwen3-next", messages=messages, max_tokens=6)
        messages += [{"role": "assistant", "content": first.choices[0].message.content}]
        messages += [{"role": "user", "content": "And my seat?"}]
        second = await client.chat.completions.create(model="tiny-qwen3-next", messages=messages, max_tokens=6)
        return first, second

    first, second = asyncio.run(conversation())
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The first turn's prompt (its state kept where it ended) is inside the second's: it resumes at least there.
    assert first.usage.prompt_tokens - 1 <= cached < second.usage.prompt_tokens


def test_from_the_third_conversation_on_a_shared_system_prompt_is_cached_whole(make_app, asgi_client, tmp_path) -> None:
    runner = PrefixCachingRunner(random_model_from_config(_config_file(tmp_path, "qwen3_next")), cache_tokens=4096)
    client = asgi_client(make_app(runner, model_name="tiny-qwen3-next"))
    system = {"role": "system", "content": "You are a terse airline agent. Follow the policy. " * 4}  # 200 bytes

    async def conversations() -> list[int]:
        cached = []
        for question in ("Where is my bag?", "Can I change seats?", "Is lunch served?", "How late is it?"):
            messages = [system, {"role": "user", "content": question}]
            answer = await client.chat.completions.create(model="tiny-qwen3-next", messages=messages, max_tokens=2)
            cached.append(answer.usage.prompt_tokens_details.cached_tokens)
        return cached

    cached = asyncio.run(conversations())
    # The second finds no state inside the system prompt (it is shorter than 16 blocks) and marks where it parts from
    # the first; the third and fourth resume there: the system prompt and the user turn's opening.
    assert cached[:2] == [0, 0]
    assert cached[2] == cached[3] >= len(system["content"])
