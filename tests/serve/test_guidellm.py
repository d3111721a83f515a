"""guidellm's synchronous benchmark (``guidellm run --profile kind=synchronous``) against the server on 127.0.0.1,
offline: synthetic prompts sized with a byte-level BPE tokenizer trained here, four requests.  Every request streams
to its end (guidellm asks ``ignore_eos``, ``max_completion_tokens`` and ``stream_options.continuous_usage_stats``):
all succeed, each with exactly the output tokens asked and the prompt tokens the server's template renders."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from prefixcache.testing import assert_quiescent

if os.environ.get("CI") != "true":  # CI installs every extra: there a missing one fails
    pytest.importorskip("guidellm", reason="needs: pip install 'prefixcache[guidellm]'")

REQUESTS, OUTPUT_TOKENS = 4, 8


def test_the_synchronous_benchmark_completes_every_request_with_the_tokens_asked(
    served_tiny, byte_bpe_dir, tmp_path
) -> None:
    runner, url, _ = served_tiny
    report = tmp_path / "benchmarks.json"
    command = [
        sys.executable,
        "-m",
        "guidellm",
        "run",
        f"--backend=kind=openai_http,target={url}",
        "--profile=kind=synchronous",
        f"--constraint=kind=max_requests,count={REQUESTS}",
        "--constraint=kind=max_duration,seconds=60",
        f"--tokenizer=kind=huggingface_auto,model={byte_bpe_dir}",
        f"--data=kind=synthetic_text,prompt_tokens=16,output_tokens={OUTPUT_TOKENS}",
        f"--output=kind=json,path={report}",
        "--disable-console",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    state = benchmark["scheduler_state"]
    assert (state["successful_requests"], state["errored_requests"]) == (REQUESTS, 0)
    successful = benchmark["requests"]["successful"]
    assert len(successful) == REQUESTS
    for request in successful:
        assert request["output_tokens"] == OUTPUT_TOKENS
        [message] = json.loads(request["request_args"])["body"]["messages"]
        text = "".join(part["text"] for part in message["content"])
        rendered = runner.tokenizer.render_chat([{"role": "user", "content": text}], add_generation_prompt=True)
        assert request["prompt_tokens"] == len(rendered)
    assert_quiescent(runner.cache)
