"""lm-eval's ``local-completions`` model on a multiple-choice task against the server on 127.0.0.1, offline: the task
is a YAML over a local JSONL file, and no tokenizer is given: lm-eval finds the server's ``/tokenizer_info`` and
``/tokenize`` and tokenizes through them (the embedded byte tokenizer is on no hub).  Each choice's log-likelihood
comes from ``/v1/completions`` with ``echo`` and ``logprobs`` (the prompt tokens' logprobs, a prefill that reuses
nothing cached) and equals the model's own uncached forward."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prefixcache.testing import assert_quiescent

if os.environ.get("CI") != "true":  # CI installs every extra: there a missing one fails
    pytest.importorskip("lm_eval", reason="needs: pip install 'prefixcache[lmeval]'")

TOLERANCE = 1e-4
DOCS = (
    {"question": "The sky is", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"question": "Paris is in", "choices": ["France", "Peru", "Mars"], "answer": 0},
)


def _task_folder(folder: Path) -> Path:
    folder.mkdir()
    docs = folder / "docs.jsonl"
    docs.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    # JSON inside YAML: the file path needs no quoting rules of its own.
    task = {
        "task": "tiny_mc",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(docs)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    (folder / "tiny_mc.yaml").write_text(json.dumps(task))
    return folder


def _reference(runner, context: str, continuation: str) -> tuple[float, bool]:
    """The log-likelihood of ``continuation`` after ``context`` by a full uncached forward, and whether every one of
    its tokens is the argmax."""
    head, tail = runner.tokenizer.encode(context), runner.tokenizer.encode(continuation)
    ids = head + tail
    logits = runner.model.forward_reference(torch.tensor(ids), return_logits=True)[:, : runner.tokenizer.vocab_size]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    rows = range(len(head) - 1, len(ids) - 1)
    total = sum(float(logprobs[row, ids[row + 1]]) for row in rows)
    return total, all(int(logprobs[row].argmax()) == ids[row + 1] for row in rows)


def test_a_multiple_choice_task_scores_each_choice_as_the_models_own_forward(served_tiny, tmp_path) -> None:
    runner, url, _ = served_tiny
    tasks = _task_folder(tmp_path / "tasks")
    model_args = f"base_url={url}/v1/completions,model=tiny,num_concurrent=1,max_retries=1"
    command = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args]
    command += ["--tasks", "tiny_mc", "--include_path", str(tasks), "--log_samples", "--output_path", "out"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Using remote tokenizer backend" in done.stderr
    [samples] = (tmp_path / "out").glob("*/samples_tiny_mc_*.jsonl")
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [record["doc"] for record in records] == list(DOCS)
    scored = 0
    for record in records:
        assert len(record["resps"]) == len(record["doc"]["choices"])
        for index, [[loglikelihood, greedy]] in enumerate(record["resps"]):
            pair = record["arguments"][f"gen_args_{index}"]
            assert pair["arg_1"] == " " + record["doc"]["choices"][index]
            total, is_greedy = _reference(runner, pair["arg_0"], pair["arg_1"])
            assert abs(float(loglikelihood) - total) <= TOLERANCE
            assert greedy == str(is_greedy)
            scored += 1
    assert scored == 8
    assert_quiescent(runner.cache)
