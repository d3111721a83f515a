"""``prefixcache serve`` as a user runs it: a subprocess on 127.0.0.1, a free port, Ctrl-C to stop."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest


def test_serve_command_answers_and_stops_on_ctrl_c(tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("secret-1 team-1\n")
    command = [
        sys.executable,
        "-m",
        "prefixcache",
        "serve",
        "--port",
        "0",
        "--cache-tokens",
        "4096",
        "--max-batch-tokens",
        "64",
    ]
    command += ["--max-running", "2"]
    process = subprocess.Popen([*command, "--api-keys", str(keys)], stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        url = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line).group(1)
        assert httpx.get(url + "/health").json()["status"] == "ok"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 401
        headers = {"Authorization": "Bearer secret-1"}
        answer = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60).json()
        assert answer["usage"]["completion_tokens"] == 3
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0


def test_batch_bounds_below_one_are_refused_before_anything_starts(capsys) -> None:
    from prefixcache.cli import main

    for option in ("--max-batch-tokens", "--max-running"):
        try:
            code = main(["serve", option, "0"])
        except SystemExit as exit_:
            code = exit_.code
        assert code == 2
        assert option in capsys.readouterr().err


MINI_QWEN = {
    "model_type": "qwen2",
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 256,
}


def mini_qwen_config(folder) -> str:
    folder.mkdir()
    config = folder / "config.json"
    config.write_text(json.dumps(MINI_QWEN))
    return str(config)


def test_serve_with_a_model_config_answers_to_its_folder_name_and_takes_layers_and_v_after_it(tmp_path) -> None:
    pytest.importorskip("transformers", reason="needs: pip install 'prefixcache[hf]'")
    config = mini_qwen_config(tmp_path / "mini-qwen")
    command = [sys.executable, "-m", "prefixcache", "serve", "--model-config", config, "--layers", "1", "-v"]
    command += ["--port", "0", "--cache-tokens", "1024"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("serving 'mini-qwen' at "), line
        url = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line).group(1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["mini-qwen"]
        assert client.models.retrieve("mini-qwen").id == "mini-qwen"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("tiny")
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0
    assert "Application startup complete" in err  # uvicorn at info: -v after the subcommand was taken


@pytest.fixture
def served(monkeypatch) -> dict:
    """``main(["serve", ...])`` without a socket: the app it would have served, its announcement and log level."""
    import prefixcache.serve

    seen: dict = {}

    def serve_forever(app, host, port, *, log_level, announce) -> None:
        announce("http://127.0.0.1:1")
        seen.update(app=app, log_level=log_level)
        app.state.engine.close()

    monkeypatch.setattr(prefixcache.serve, "serve_forever", serve_forever)
    return seen


def test_layers_cut_the_model_of_a_model_config(served: dict, tmp_path, capsys) -> None:
    pytest.importorskip("transformers", reason="needs: pip install 'prefixcache[hf]'")
    from prefixcache.cli import main

    assert (
        main(["serve", "--no-engine-process", "--model-config", mini_qwen_config(tmp_path / "mini"), "--layers", "2"])
        == 0
    )
    assert served["app"].state.runner.model.name == "Qwen2ForCausalLM(2 layers)"
    assert served["log_level"] == "warning"
    assert capsys.readouterr().out.startswith("serving 'mini' at http://127.0.0.1:1/v1")


def test_a_saved_model_folder_is_served_under_its_folder_name_unless_named(served: dict, tmp_path, capsys) -> None:
    transformers = pytest.importorskip("transformers", reason="needs: pip install 'prefixcache[hf]'")
    from prefixcache.cli import main

    folder = tmp_path / "my-model"
    config = transformers.AutoConfig.for_model(**MINI_QWEN)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for extra, name in (([], "my-model"), (["--served-model-name", "prod"], "prod")):
        assert main(["serve", "--model", f"hf:{folder}/", "-vv", *extra]) == 0
        assert capsys.readouterr().out.startswith(f"serving {name!r} at ")
        assert served["log_level"] == "info"  # -vv after the subcommand


def test_v_before_and_after_the_subcommand_add_up(served: dict) -> None:
    from prefixcache.cli import build_parser, main

    args = build_parser().parse_args(["-v", "serve", "-v"])
    assert (args.verbose, args.verbose_after) == (1, 1)
    assert main(["serve", "--verbose"]) == 0 and served["log_level"] == "info"
    assert main(["serve"]) == 0 and served["log_level"] == "warning"


def test_layers_without_a_model_config_are_refused(capsys) -> None:
    from prefixcache.cli import main

    assert main(["serve", "--layers", "2"]) == 2
    assert "--layers needs --model-config" in capsys.readouterr().err


def test_max_request_bytes_sets_the_servers_body_limit_and_defaults_to_create_apps(served: dict) -> None:
    import asyncio

    from prefixcache.cli import build_parser, main
    from prefixcache.serve.jobs import DEFAULT_MAX_REQUEST_BYTES

    assert build_parser().parse_args(["serve"]).max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
    assert main(["serve"]) == 0
    assert served["app"].state.max_request_bytes == DEFAULT_MAX_REQUEST_BYTES == 32 << 20
    assert main(["serve", "--max-request-bytes", "1KiB"]) == 0
    app = served["app"]
    assert app.state.max_request_bytes == 1024

    async def post(size: int) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            return await client.post("/v1/chat/completions", content=b" " * size)

    too_large = asyncio.run(post(1025))
    assert too_large.status_code == 413
    assert too_large.json()["error"]["code"] == "request_too_large"
    assert "1,024 bytes" in too_large.json()["error"]["message"]
    assert asyncio.run(post(1024)).status_code == 400  # read whole: blank is not JSON


def test_max_request_bytes_is_in_the_serve_help_and_refuses_what_is_not_a_size(capsys) -> None:
    from prefixcache.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--max-request-bytes BYTES" in capsys.readouterr().out
    for value, message in (("lots", "not a size"), ("0", "at least 1 byte")):
        try:
            code = main(["serve", "--max-request-bytes", value])
        except SystemExit as exit_:
            code = exit_.code
        assert code == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize(("cache_tokens", "block_size"), [("1", "16"), ("15", "16"), ("31", "32")])
def test_cache_tokens_below_one_block_are_refused_before_the_server_starts(
    served: dict, capsys: pytest.CaptureFixture[str], cache_tokens: str, block_size: str
) -> None:
    from prefixcache.cli import main

    assert main(["serve", "--cache-tokens", cache_tokens, "--block-size", block_size]) == 2

    assert "app" not in served
    err = capsys.readouterr().err
    assert f"--cache-tokens {cache_tokens} is less than one block of {block_size} tokens" in err


def test_an_invalid_block_size_is_named_before_the_cache_size_it_would_advise(
    served: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefixcache.cli import main

    assert main(["serve", "--cache-tokens", "10", "--block-size", "300"]) == 2

    assert "app" not in served
    err = capsys.readouterr().err
    assert "block_size must be in 1..256 tokens, got 300" in err and "give at least" not in err


def test_cache_tokens_of_one_block_are_served(served: dict) -> None:
    from prefixcache.cli import main

    assert main(["serve", "--no-engine-process", "--cache-tokens", "16", "--block-size", "16"]) == 0

    assert served["app"].state.runner.pool.num_blocks == 1


def test_a_pool_too_large_for_memory_is_one_line_naming_the_option(served: dict, monkeypatch, capsys) -> None:
    import prefixcache.engine.runner as runner_module
    from prefixcache.cli import main

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 10240000000 bytes.")

    monkeypatch.setattr(runner_module, "PrefixCachingRunner", out_of_memory)
    assert main(["serve", "--no-engine-process", "--cache-tokens", "20000000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the KV pool does not fit in memory (--cache-tokens): ")
    assert err[0].endswith("give a smaller --cache-tokens or --cache-memory")
    assert "app" not in served
