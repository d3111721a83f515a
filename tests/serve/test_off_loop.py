"""A request's work runs on a worker thread, not on the event loop (its tokenizing always; its parsing and checks
when its body is large), and a large body answers exactly as a small one: the same results, the same 400s, on
every endpoint that renders or tokenizes (chat, completions, responses, prefill)."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import Future

import httpx
import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.errors import InvalidArgumentError
from prefixcache.serve.jobs import PARSE_OFF_LOOP_BYTES
from prefixcache.serve.offload import RequestWork, loads_yielding
from prefixcache.testing import assert_quiescent

PAD = " " * (PARSE_OFF_LOOP_BYTES + 1)  # JSON allows trailing whitespace: the same request, a large body
PROMPT = "The weather in Paris is mild today. " * 40


def _post(app, path: str, body: dict, *, pad: bool) -> httpx.Response:
    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=120) as client:
            content = json.dumps(body) + (PAD if pad else "")
            return await client.post(path, content=content, headers={"content-type": "application/json"})

    return asyncio.run(post())


class ThreadRecorder:
    """A tokenizer that notes the thread each prompt is rendered or encoded on."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.threads: list[str] = []

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def render_chat(self, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        return self._tokenizer.render_chat(*args, **kwargs)

    def encode(self, text: str):
        self.threads.append(threading.current_thread().name)
        return self._tokenizer.encode(text)


REQUESTS = {
    "chat": ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}]}),
    "completion": ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 1}),
    "responses": ("/v1/responses", {"model": "tiny", "input": PROMPT, "store": False}),
    "prefill": ("/v1/cache/prefill", {"prompt": PROMPT}),
}


@pytest.mark.parametrize("endpoint", REQUESTS)
def test_a_request_is_rendered_on_the_worker_thread_and_a_large_body_answers_as_a_small_one(
    make_app, tiny_model, endpoint
) -> None:
    path, body = REQUESTS[endpoint]
    body = {**body, "max_tokens": 4} if endpoint in ("chat", "completion") else body
    body = {**body, "max_output_tokens": 4} if endpoint == "responses" else body
    answers, threads = [], []
    for pad in (False, True):  # a fresh runner each: both prefill the whole prompt
        runner = PrefixCachingRunner(tiny_model, cache_tokens=8192)
        recorder = ThreadRecorder(runner.tokenizer)
        runner.tokenizer = recorder
        app = make_app(runner, model_name="tiny")
        answer = _post(app, path, body, pad=pad)
        assert answer.status_code == 200, answer.text
        answers.append(answer.json())
        threads.append(set(recorder.threads))
        app.state.engine.close()
        assert_quiescent(runner.cache)
    small, large = answers
    for used in threads:  # small or large, the tokenizer is used on the one worker thread
        assert len(used) == 1 and used.pop().startswith("prefixcache-request"), used
    for answer in answers:
        answer.pop("id", None)
        answer.pop("created", None)
        answer.pop("created_at", None)
        answer.pop("completed_at", None)  # a clock second too: the two answers may fall either side of one
        for item in answer.get("output", []):
            item.pop("id", None)
        for timing in ("ttft_s", "decode_s"):  # wall times
            answer["usage"].pop(timing, None)
    assert large == small
    assert large["usage"]["prompt_tokens" if endpoint != "responses" else "input_tokens"] >= len(PROMPT)


class DecodeRecorder(ThreadRecorder):
    """Also notes the thread each decode runs on (the tokenizer routes decode on request)."""

    def decode(self, ids):
        self.threads.append(threading.current_thread().name)
        return self._tokenizer.decode(ids)


TOKENIZER_ROUTES = {
    "tokenize text": ("/tokenize", {"model": "tiny", "prompt": PROMPT, "return_token_strs": True}),
    "tokenize chat": ("/tokenize", {"messages": [{"role": "user", "content": PROMPT}], "return_token_strs": True}),
    "detokenize": ("/detokenize", {"tokens": list(PROMPT.encode())}),
}


@pytest.mark.parametrize("route", TOKENIZER_ROUTES)
def test_the_tokenizer_routes_use_the_tokenizer_on_the_worker_thread_only(make_app, tiny_model, route) -> None:
    # /tokenize and /detokenize once tokenized on the event loop, beside the worker thread tokenizing other
    # requests at the same time (the race a Hugging Face tokenizer's split_special_tokens state has), and a large
    # body's text stalled the loop.
    path, body = TOKENIZER_ROUTES[route]
    answers = []
    for pad in (False, True):
        runner = PrefixCachingRunner(tiny_model, cache_tokens=8192)
        recorder = DecodeRecorder(runner.tokenizer)
        runner.tokenizer = recorder
        app = make_app(runner, model_name="tiny")
        recorder.threads.clear()  # the app decodes its EOS token once, as it is made
        answer = _post(app, path, body, pad=pad)
        assert answer.status_code == 200, answer.text
        answers.append(answer.json())
        assert recorder.threads and {name.split("_")[0] for name in recorder.threads} == {"prefixcache-request"}
    assert answers[0] == answers[1]
    assert _post(app, path, {**body, "model": "other"}, pad=False).status_code == 404


BAD = {
    "chat role": ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}),
    "chat capacity": (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x" * 40_000}]},
    ),
    "chat model": ("/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "hi"}]}),
    "completion ids": ("/v1/completions", {"model": "tiny", "prompt": [999, 1, 2]}),
    "completion stop": ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": 3}),
    "responses role": ("/v1/responses", {"model": "tiny", "input": [{"role": "wizard", "content": "hi"}]}),
    "prefill both": ("/v1/cache/prefill", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}),
    "prefill ids": ("/v1/cache/prefill", {"prompt": [999]}),
}


@pytest.mark.parametrize("case", BAD)
def test_a_large_bad_request_is_the_same_error_as_a_small_one(make_app, tiny_model, case) -> None:
    path, body = BAD[case]
    runner = PrefixCachingRunner(tiny_model, cache_tokens=8192)
    app = make_app(runner, model_name="tiny")
    small, large = (_post(app, path, body, pad=pad) for pad in (False, True))
    assert small.status_code in (400, 404), small.text
    assert (large.status_code, large.json()) == (small.status_code, small.json())
    assert runner.cache.stats().query_tokens == 0
    assert_quiescent(runner.cache)


def test_a_large_body_nested_too_deep_to_parse_is_a_400(make_app, tiny_model) -> None:
    app = make_app(PrefixCachingRunner(tiny_model, cache_tokens=1024), model_name="tiny")
    deep = '{"model": "tiny", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}"

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client:
            return await client.post("/v1/chat/completions", content=deep)

    answer = asyncio.run(post())
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "the request body nests objects and arrays too deep to parse"


def test_loads_yielding_reads_what_json_loads_reads() -> None:
    text = '{"a": [1, -2, 3.5, 1e3, true, null, "x"], "a": {"b": {}}, "c": [[], {}], "d": 12345678901234567890}'
    assert loads_yielding(text) == json.loads(text)
    with pytest.raises(ValueError):
        loads_yielding('{"a": [1, 2')


class Handle:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def test_a_job_submitted_after_its_handler_was_cancelled_is_cancelled() -> None:
    work = RequestWork(1 << 20)
    release, handle = threading.Event(), Handle()

    def submit(on_delta):
        release.wait(10)
        return handle, Future()

    async def main() -> None:
        waiting = asyncio.ensure_future(work.submit(submit, None))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(main())
    assert not handle.cancelled  # still being submitted on the worker thread
    release.set()
    work.close(wait=True)  # the worker has finished submitting
    assert handle.cancelled


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, None])
def test_request_work_refuses_a_limit_or_pool_size_that_is_not_a_positive_int(bad) -> None:
    with pytest.raises(InvalidArgumentError, match="max_request_bytes"):
        RequestWork(bad)
    with pytest.raises(InvalidArgumentError, match="workers"):
        RequestWork(1024, workers=bad)
