"""``prefixcache replay FILE --endpoint URL`` against ``prefixcache serve`` on 127.0.0.1: with the server's tokenizer
and chat template equal to the replay's (byte tokenizer, ChatML) and a cache large enough, the endpoint's cached
tokens are the in-process replay's, request by request."""

from __future__ import annotations

import json
import socket
from array import array
from dataclasses import replace
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from prefixcache import PrefixCachingRunner
from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.cli import main
from prefixcache.errors import install_command
from prefixcache.replay.endpoint import base_url, percentile
from prefixcache.replay.replayer import Replayer
from prefixcache.replay.requests import read_requests
from prefixcache.serve import ApiKeys, start_background

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


@pytest.fixture
def served(make_app, tiny_model):
    """A ``prefixcache serve`` of the tiny model with room for every scenario (no eviction): its base URL."""
    runner = PrefixCachingRunner(tiny_model, cache_tokens=1 << 17)
    with start_background(make_app(runner, model_name="tiny"), "127.0.0.1", 0) as server:
        yield server.url


def in_process_cached_tokens(path: Path, model=None) -> tuple[list[int], list[int]]:
    """``(prompt tokens, cached tokens)`` per request of prefixcache's own replay of ``path``'s prompts as an endpoint
    gets them (cache-only, or through ``model``): in replay order, one cache, the answers not teacher forced (the
    endpoint writes its own)."""
    requests = read_requests(path, ByteTokenizer()).requests
    prompts_only = [replace(r, answer=array(r.answer.typecode)) for r in requests]
    log: list[dict] = []
    Replayer(model, measure_uncached=False).replay(str(path), prompts_only, log=log)
    return [len(r.prompt) for r in prompts_only], [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in log]


def audit(capsys, path: Path, url: str, tmp_path: Path, *options: str) -> tuple[dict, list[dict], str]:
    out_json, out_requests = tmp_path / "audit.json", tmp_path / "requests.jsonl"
    argv = ["replay", str(path), "--endpoint", url, "--no-progress", "--json", str(out_json)]
    code = main([*argv, "--requests-jsonl", str(out_requests), *options])
    captured = capsys.readouterr()
    stdout = captured.out
    assert code == 0, captured.err
    lines = [json.loads(line) for line in out_requests.read_text().splitlines()]
    return json.loads(out_json.read_text()), lines, stdout


def test_endpoint_cached_tokens_equal_the_in_process_replay_request_by_request(
    served, tiny_model, capsys, tmp_path
) -> None:
    path = SCENARIOS / "multi_turn_chat.jsonl"
    report, requests, stdout = audit(capsys, path, served, tmp_path, "--concurrency", "1")
    prompt_tokens, cached_tokens = in_process_cached_tokens(path)
    assert in_process_cached_tokens(path, tiny_model) == (prompt_tokens, cached_tokens)  # the runner's own counts
    assert len(requests) == len(cached_tokens) == 28
    assert [r["prompt_tokens_server"] for r in requests] == prompt_tokens
    assert [r["cached_tokens_server"] for r in requests] == cached_tokens
    assert [r["simulated_cached_tokens"] for r in requests] == cached_tokens
    assert [r["ideal_cached_tokens"] for r in requests] == cached_tokens  # unlimited: the tree is the ideal
    assert report["prompt_tokens_server"] == report["prompt_tokens_replay"] == sum(prompt_tokens) == 36_041
    assert report["cached_tokens_server"] == report["simulated_cached_tokens"] == sum(cached_tokens) == 22_891
    assert report["hit_rate_server"] == report["ideal_hit_rate"] == pytest.approx(22_891 / 36_041)
    assert report["endpoint"]["cache_fields"] == {"usage.prompt_tokens_details.cached_tokens": 28}
    assert report["input_format"] == "chat" and report["same_prompt_tokens"] is True
    assert all(r["ttft_s"] > 0 for r in requests)
    assert report["ttft_s"]["p50"] <= report["ttft_s"]["p90"] <= report["ttft_s"]["p99"]
    assert "the server counted every prompt as the replay's tokenizer (byte-utf8+chatml-v2) did" in stdout
    table = [line for line in stdout.splitlines() if line.startswith("|")]
    cells = [cell.strip() for cell in table[2].split("|")[1:-1]]
    assert cells[:7] == ["multi_turn_chat.jsonl", "28", "36,041", "22,891", "63.5%", "63.5%", "63.5%"]
    assert max(len(line) for line in table) <= 120


def test_a_token_id_log_goes_to_completions_and_equals_the_in_process_replay(served, capsys, tmp_path) -> None:
    shared = list(range(40, 120))
    lines = [{"model": "tiny", "prompt": shared + list(range(130, 130 + n))} for n in (5, 20, 37)]
    lines.append({"model": "tiny", "prompt": "plain text prompt, encoded by the server"})
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report, requests, _ = audit(capsys, path, served, tmp_path)
    prompt_tokens, cached_tokens = in_process_cached_tokens(path)
    assert report["input_format"] == "requests"
    assert [r["prompt_tokens_server"] for r in requests] == prompt_tokens == [85, 100, 117, 40]
    assert [r["cached_tokens_server"] for r in requests] == cached_tokens == [0, 85, 100, 0]


def test_concurrent_requests_all_complete_and_are_counted(served, capsys, tmp_path) -> None:
    path = SCENARIOS / "support_bot.jsonl"
    report, requests, stdout = audit(capsys, path, served, tmp_path, "--concurrency", "4", "--cache-tokens", "65536")
    prompt_tokens, cached_tokens = in_process_cached_tokens(path)
    assert report["requests"] == len(requests) == 23
    assert report["cached_reported_requests"] == 23
    assert [r["prompt_tokens_server"] for r in requests] == prompt_tokens
    assert report["prompt_tokens_server"] == sum(prompt_tokens) == 93_342
    assert report["simulated_cached_tokens"] == sum(cached_tokens)
    # Requests in flight together miss what the others are still prefilling: never more than one at a time would hit.
    assert 0 < report["cached_tokens_server"] <= report["ideal_cached_tokens"]
    assert report["endpoint"]["concurrency"] == 4 and report["simulation"]["cache_tokens"] == 65_536
    assert "with 4 requests in flight" in stdout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unreachable_endpoint_fails_in_one_line(capsys) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code = main(["replay", str(SCENARIOS / "few_shot.jsonl"), "--endpoint", url, "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"error: {url}/v1: cannot reach the endpoint")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_an_http_error_names_the_status_the_message_and_the_request(served, capsys) -> None:
    argv = ["replay", str(SCENARIOS / "few_shot.jsonl"), "--endpoint", served, "--no-progress"]
    code = main([*argv, "--endpoint-model", "no-such-model"])
    err = capsys.readouterr().err
    assert code == 2
    assert "few_shot.jsonl: conversation" in err and "turn" in err
    assert "HTTP 404: the model 'no-such-model' does not exist; this server serves 'tiny'" in err
    assert "Traceback" not in err


def test_a_missing_api_key_variable_is_refused_before_anything_is_sent(capsys, monkeypatch) -> None:
    monkeypatch.delenv("PREFIXCACHE_TEST_NO_SUCH_KEY", raising=False)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: the key is checked first
    argv = ["replay", str(SCENARIOS / "few_shot.jsonl"), "--endpoint", url, "--no-progress"]
    code = main([*argv, "--api-key-env", "PREFIXCACHE_TEST_NO_SUCH_KEY"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == (
        "error: --api-key-env PREFIXCACHE_TEST_NO_SUCH_KEY: the environment variable PREFIXCACHE_TEST_NO_SUCH_KEY is "
        "not set or empty"
    )


def test_the_api_key_from_the_variable_opens_a_server_that_wants_one(
    make_app, tiny_model, capsys, monkeypatch, tmp_path
) -> None:
    runner = PrefixCachingRunner(tiny_model, cache_tokens=1 << 16)
    app = make_app(runner, model_name="tiny", api_keys=ApiKeys({"sekret-1": "team-1"}))
    argv = ["replay", str(SCENARIOS / "few_shot.jsonl"), "--limit", "1", "--no-progress"]
    with start_background(app, "127.0.0.1", 0) as server:
        assert main([*argv, "--endpoint", server.url]) == 2
        assert "HTTP 401" in capsys.readouterr().err
        monkeypatch.setenv("AUDIT_KEY", "sekret-1")
        options = ("--limit", "1", "--api-key-env", "AUDIT_KEY")
        report, requests, _ = audit(capsys, SCENARIOS / "few_shot.jsonl", server.url, tmp_path, *options)
    assert main([*argv, "--endpoint", "http://127.0.0.1:1", "--api-key-env", "AUDIT_KEY", "--verify"]) == 2
    assert "--endpoint audits a server's cache; it does not take --verify" in capsys.readouterr().err
    assert main([*argv, "--endpoint", "http://127.0.0.1:1", "--sweep"]) == 2
    assert "--endpoint audits a server's cache; it does not take --sweep" in capsys.readouterr().err
    assert report["requests"] == 1 and requests[0]["cached_tokens_server"] == 0


def test_without_httpx_the_error_names_the_extra(capsys, monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "httpx", None)
    argv = ["replay", str(SCENARIOS / "few_shot.jsonl"), "--endpoint", "http://127.0.0.1:1", "--no-progress"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"error: --endpoint needs httpx: {install_command('server')}"


def test_the_base_url_gets_v1_only_when_it_has_no_path() -> None:
    assert base_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert base_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000/v1"
    assert base_url("https://example.test/openai/v1/") == "https://example.test/openai/v1"
    with pytest.raises(ValueError, match="give an http:// or https:// URL"):
        base_url("127.0.0.1:8000")


def test_percentiles_interpolate_between_ranks() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile([float(i) for i in range(101)], 0.9) == pytest.approx(90.0)


def test_llama_cpp_timings_count_as_cached_tokens_when_usage_has_none(capsys, tmp_path) -> None:
    """llama.cpp's own server (``llama-server``) streams ``timings`` with ``cache_n`` (tokens reused) and
    ``prompt_n`` (tokens evaluated); a stand-in that answers in that shape, to read it."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "stand-in", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        assert body["stream"] and body["max_tokens"] == 1 and body["temperature"] == 0 and body["model"] == "stand-in"
        cache_n = 10 if len(body["messages"]) > 2 else 0
        chunks = [
            {"choices": [{"index": 0, "delta": {"content": "x"}}]},
            {
                "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                "timings": {"cache_n": cache_n, "prompt_n": 90},
            },
        ]
        lines = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]
        return StreamingResponse(iter(lines), media_type="text/event-stream")

    with start_background(app, "127.0.0.1", 0) as server:
        report, requests, stdout = audit(capsys, SCENARIOS / "multi_turn_chat.jsonl", server.url, tmp_path)
    assert report["endpoint"]["cache_fields"] == {"timings.cache_n": 28}
    assert {r["cached_tokens_server"] for r in requests} == {0, 10}
    assert {r["prompt_tokens_server"] for r in requests} == {90, 100}  # prompt_n + cache_n
    assert report["hit_rate_server"] == report["cached_tokens_server"] / report["prompt_tokens_server"]
    assert "cached tokens: timings.cache_n on 28 of 28 requests" in stdout
