"""A server with speculative decoding (``create_app(speculate="tree")``, ``serve --speculate tree``): a repeated greedy
request answers as a server without speculation does, stop strings and ``n`` > 1 included, while its usage and
``/metrics`` count the draft tokens verified and accepted; an engine process speculates the same way."""

from __future__ import annotations

import asyncio
import functools
import re

import httpx

from prefixcache import SamplingParams
from prefixcache.engine.process import EngineProcess
from prefixcache.serve import create_app
from prefixcache.testing import assert_quiescent, tiny_runner

BODY = {"model": "tiny", "prompt": "The tool said: id=ABC123, seat 14C. Repeat it:", "max_tokens": 24, "temperature": 0}


def post_all(app, requests: list[tuple[str, str, object]]) -> list[httpx.Response]:
    """Send ``(method, path, json body)`` one after another through the ASGI transport."""

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            return [await http.request(method, path, json=body) for method, path, body in requests]

    return asyncio.run(main())


def test_a_speculating_server_answers_as_one_without_and_counts_its_drafts() -> None:
    apps = [create_app(tiny_runner(4096), model_name="tiny", speculate=mode) for mode in ("off", "tree")]
    try:
        first = post_all(apps[0], [("POST", "/v1/completions", BODY)])[0].json()
        text = first["choices"][0]["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 2]  # a stop string inside the answer: drafts cross it
        stopped = {**BODY, "stop": [stop]}
        off = post_all(apps[0], [("POST", "/v1/completions", stopped)])[0].json()
        answers = post_all(
            apps[1],
            [
                ("POST", "/v1/completions", BODY),
                ("POST", "/v1/completions", BODY),
                ("POST", "/v1/completions", stopped),
            ],
        )
        on = [answer.json() for answer in answers]
        assert [a["choices"][0]["text"] for a in on] == [text, text, off["choices"][0]["text"]]
        assert on[2]["choices"][0]["finish_reason"] == off["choices"][0]["finish_reason"] == "stop"
        assert first["usage"]["drafted_tokens"] == first["usage"]["accepted_tokens"] == 0
        assert on[1]["usage"]["accepted_tokens"] > 0  # the first answer is cached: the tree drafts it
        (metrics,) = post_all(apps[1], [("GET", "/metrics", None)])
        accepted = float(re.search(r"^prefixcache_spec_accepted_tokens_total (\S+)$", metrics.text, re.M).group(1))
        drafted = float(re.search(r"^prefixcache_spec_draft_tokens_total (\S+)$", metrics.text, re.M).group(1))
        assert accepted == sum(a["usage"]["accepted_tokens"] for a in on) and drafted >= accepted > 0
        (samples,) = post_all(apps[1], [("POST", "/v1/completions", {**BODY, "n": 2})])
        assert [c["text"] for c in samples.json()["choices"]] == [text, text]
        assert apps[1].state.engine.wait_idle(30)
        assert_quiescent(apps[1].state.runner.cache)
    finally:
        for app in apps:
            app.state.engine.close()


def test_an_engine_process_speculates() -> None:
    prompt = list(b"Seat 14C, seat 14C, seat 14C, seat")
    params = SamplingParams(max_new_tokens=20)
    alone = tiny_runner(4096).generate(prompt, params)
    process = EngineProcess(functools.partial(tiny_runner, 4096), speculate="tree")
    try:
        results = [process.submit(prompt, params).result(timeout=120) for _ in range(2)]
        figures = process.figures()
    finally:
        process.close()
    assert [r.token_ids for r in results] == [alone.token_ids] * 2
    assert results[1].usage.accepted_tokens > 0
    assert figures.accepted_tokens == sum(r.usage.accepted_tokens for r in results)
