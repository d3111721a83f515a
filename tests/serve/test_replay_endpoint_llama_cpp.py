"""``replay --endpoint`` against a server we did not write: llama-cpp-python's OpenAI-compatible server
(``pip install 'llama-cpp-python[server]' gguf``, which compiles llama.cpp) on a random-weight llama made here as a
GGUF file.  Skips without those packages."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp.server", reason="needs: pip install 'llama-cpp-python[server]'")
gguf = pytest.importorskip("gguf", reason="needs: pip install gguf")
np = pytest.importorskip("numpy")
httpx = pytest.importorskip("httpx", reason="needs: pip install 'prefixcache[server]'")

from prefixcache.cli import main  # noqa: E402

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"
PROMPT_TOKENS_SERVER = 33_552  # the ChatML-rendered prompts in its SentencePiece vocabulary
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_tiny_llama(path: Path, *, n_embd: int = 64, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2) -> None:
    """A random-weight llama in GGUF (f32): a SentencePiece-style vocabulary of the three specials, the 256 byte
    tokens and the printable ASCII characters (with and without the word-start mark), and a ChatML template."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256  # unknown, control, control, byte
    ascii_pieces = [chr(c) for c in range(33, 127)]
    pieces += ["\u2581"] + ascii_pieces + ["\u2581" + p for p in ascii_pieces]
    types += [1] * (1 + 2 * len(ascii_pieces))
    n_vocab, n_ff, head_dim = len(pieces), 2 * n_embd, n_embd // n_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([0.0] * 3 + [-1000.0] * 256 + [-float(i) for i in range(n_vocab - 259)])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(CHATML)
    rng = np.random.default_rng(0)

    def weight(*shape: int):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd))
    for i in range(n_layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(n_kv_heads * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(n_kv_heads * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(n_embd, n_ff))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", weight(n_vocab, n_embd))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def llama_cpp_server(tmp_path_factory):
    """llama-cpp-python's server (a subprocess) on 127.0.0.1 serving a tiny random llama: its base URL."""
    folder = tmp_path_factory.mktemp("llama-cpp")
    model = folder / "tiny-llama.gguf"
    write_tiny_llama(model)
    port = free_port()
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--model_alias", "tiny-llama"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", "4096", "--n_threads", "1", "--verbose", "false"]
    log_path = folder / "server.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}/v1"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(url + "/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"llama_cpp.server did not start: {log_path.read_text()[-2000:]}")
                time.sleep(0.5)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=30)


def audit(capsys, url: str, tmp_path: Path, *options: str) -> tuple[dict, str]:
    out_json = tmp_path / "audit.json"
    argv = ["replay", str(SCENARIOS / "multi_turn_chat.jsonl"), "--endpoint", url, "--no-progress"]
    code = main([*argv, "--json", str(out_json), *options])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    return json.loads(out_json.read_text()), stdout


def test_a_stream_without_usage_is_audited_for_ttft_and_says_the_counts_are_missing(
    llama_cpp_server, capsys, tmp_path
) -> None:
    report, stdout = audit(capsys, llama_cpp_server, tmp_path, "--concurrency", "2")
    assert report["endpoint"]["model"] == "tiny-llama"
    assert report["requests"] == 28 and report["prompt_tokens_replay"] == 36_041
    assert report["prompt_tokens_server"] is None and report["prompt_reported_requests"] == 0
    assert report["hit_rate_server"] is None and report["endpoint"]["cache_fields"] == {}
    assert 0 < report["ttft_s"]["p50"] <= report["ttft_s"]["p90"] <= report["ttft_s"]["p99"]
    assert "prompt tokens: the endpoint reported none (its stream carries no usage: --no-stream" in stdout
    assert "cached tokens: the endpoint reported none" in stdout


def test_whole_responses_give_the_servers_own_prompt_counts(llama_cpp_server, capsys, tmp_path) -> None:
    report, stdout = audit(capsys, llama_cpp_server, tmp_path, "--no-stream")
    assert report["endpoint"]["stream"] is False
    assert report["requests"] == report["prompt_reported_requests"] == 28
    # Its SentencePiece vocabulary (bytes, ASCII characters, word starts) is not the replay's byte tokenizer.
    assert report["prompt_tokens_server"] == PROMPT_TOKENS_SERVER
    assert report["prompt_tokens_replay"] == 36_041 and report["same_prompt_tokens"] is False
    assert "different tokenizers or chat templates; each hit rate is a ratio of its own counts" in stdout
    assert report["hit_rate_server"] is None  # llama-cpp-python reuses the last prompt's prefix but reports no count
