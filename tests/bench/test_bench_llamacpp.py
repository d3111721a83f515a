"""``prefixcache bench llamacpp`` (:mod:`prefixcache.bench.llamacpp` and its modules): where the programs are found,
the skip without a llama-server, the server processes stopped with every child, the requests each server is sent;
and, only where a llama-server is found, the side-by-side itself on SmolLM2."""

from __future__ import annotations

import os
import stat
import sys
import textwrap
import time
from pathlib import Path

import pytest

from prefixcache.bench import BENCHMARKS
from prefixcache.bench.llamacpp import random_prompt
from prefixcache.bench.llamacpp_client import LLAMA_CPP, PREFIXCACHE, request_body
from prefixcache.bench.llamacpp_find import find_llama_quantize, find_llama_server
from prefixcache.bench.llamacpp_process import (
    ServerProcess,
    _group_members,
    free_port,
    llama_server_command,
    prefixcache_serve_command,
)
from prefixcache.bench.precision import PRECISION_NAMES, parse_precision
from prefixcache.cli import bench as bench_cli
from prefixcache.cli import main
from prefixcache.errors import InvalidArgumentError


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def no_llama(monkeypatch, tmp_path):
    """No llama-server anywhere: not in the environment, a PATH of one empty folder."""
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.delenv("LLAMA_QUANTIZE", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))


def test_without_a_llama_server_the_benchmark_says_why_and_exits_0(no_llama, capsys) -> None:
    assert main(["bench", "llamacpp"]) == 0
    out = capsys.readouterr().out
    assert "llamacpp: skipped: no llama-server: give --llama-server PATH or $LLAMA_SERVER" in out


def test_a_given_path_that_is_no_program_is_named_in_the_skip(no_llama, capsys, tmp_path) -> None:
    command = [
        "bench",
        "llamacpp",
        "--llama-server",
        str(tmp_path / "nothing"),
        "--precision",
        "int8",
        "--threads",
        "1",
    ]
    assert main(command) == 0
    assert f"--llama-server '{tmp_path / 'nothing'}' is not an executable file" in capsys.readouterr().out


def test_the_server_is_found_by_flag_then_environment_then_path(no_llama, monkeypatch, tmp_path) -> None:
    (tmp_path / "bin").mkdir()
    on_path = _executable(tmp_path / "bin" / "llama-server")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert find_llama_server().path == on_path.resolve()
    from_env = _executable(tmp_path / "env-server")
    monkeypatch.setenv("LLAMA_SERVER", str(from_env))
    assert find_llama_server().path == from_env.resolve()
    given = _executable(tmp_path / "given-server")
    assert find_llama_server(given).path == given.resolve()
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "missing"))
    found = find_llama_server()
    assert found.path is None and "$LLAMA_SERVER" in found.reason  # PATH is not tried behind a wrong setting


def test_llama_quantize_is_found_beside_the_server(no_llama, tmp_path) -> None:
    server = _executable(tmp_path / "llama-server")
    assert find_llama_quantize(server).path is None
    quantize = _executable(tmp_path / "llama-quantize")
    assert find_llama_quantize(server).path == quantize


def test_an_unknown_precision_is_refused_by_the_command_line(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "llamacpp", "--precision", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err


def test_threads_below_one_are_refused() -> None:
    from prefixcache.bench.llamacpp import run

    with pytest.raises(InvalidArgumentError, match="threads must be >= 1"):
        run(llama_server=sys.executable, threads=0)


def test_the_command_line_knows_every_precision_and_benchmark() -> None:
    assert bench_cli.PRECISION_NAMES == PRECISION_NAMES
    assert "llamacpp" in BENCHMARKS and bench_cli.BENCHMARK_NAMES == tuple(BENCHMARKS)


def test_each_precision_has_llama_cpps_file_type_of_its_class() -> None:
    types = {name: parse_precision(name).gguf_type for name in PRECISION_NAMES}
    assert types == {
        "float32": "F32",
        "bfloat16": "BF16",
        "int8": "Q8_0",
        "int4": "Q4_0",
        "bfloat16+int8": "Q8_0",
        "bfloat16+int4": "Q4_0",
    }


def test_both_servers_get_the_same_threads_context_and_one_slot(tmp_path) -> None:
    theirs = llama_server_command(Path("/bin/llama-server"), tmp_path / "m.gguf", 8123, 2, 4096)
    assert theirs[theirs.index("-t") + 1] == theirs[theirs.index("-tb") + 1] == "2"
    assert (theirs[theirs.index("-c") + 1], theirs[theirs.index("-np") + 1]) == ("4096", "1")
    assert theirs[theirs.index("--port") + 1] == "8123" and theirs[theirs.index("--host") + 1] == "127.0.0.1"
    ours = prefixcache_serve_command(tmp_path / "m.gguf", parse_precision("bfloat16+int4"), 8124, 4096)
    assert ours[:4] == [sys.executable, "-m", "prefixcache", "serve"]
    flags = dict(zip(ours[4::2], ours[5::2], strict=True))
    assert flags["--dtype"] == "bfloat16" and flags["--quantize"] == "int4"
    assert (flags["--cache-tokens"], flags["--max-running"], flags["--port"]) == ("4096", "1", "8124")


def test_both_servers_are_asked_for_the_same_greedy_tokens() -> None:
    ids = [5, 6, 7]
    path, theirs = request_body(LLAMA_CPP, ids, 9)
    assert path == "/completion"
    assert (theirs["prompt"], theirs["n_predict"], theirs["temperature"], theirs["ignore_eos"]) == (ids, 9, 0.0, True)
    path, ours = request_body(PREFIXCACHE, ids, 9)
    assert path == "/v1/completions"
    assert (ours["prompt"], ours["max_tokens"], ours["temperature"], ours["ignore_eos"]) == (ids, 9, 0.0, True)
    with pytest.raises(InvalidArgumentError):
        request_body("vllm", ids, 9)


def test_prompts_are_seeded_ids_above_the_special_tokens() -> None:
    prompt = random_prompt(1000, 500, seed=3)
    assert prompt == random_prompt(1000, 500, seed=3) != random_prompt(1000, 500, seed=4)
    assert len(prompt) == 500 and min(prompt) >= 256 and max(prompt) < 1000
    with pytest.raises(InvalidArgumentError):
        random_prompt(200, 5, seed=0)


FAKE_SERVER = textwrap.dedent(
    """
    import http.server, subprocess, sys
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a child, as our engine process
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
    """
)


def test_stopping_a_server_ends_its_children_too(tmp_path) -> None:
    port = free_port()
    script = tmp_path / "server.py"
    script.write_text(FAKE_SERVER)
    server = ServerProcess("fake", [sys.executable, str(script), str(port)], port, tmp_path / "log")
    with server:
        server.start(timeout_s=30)
        group = server.process.pid
        deadline = time.monotonic() + 10
        while len(_group_members(group)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_group_members(group)) == 2
        assert server.resident_bytes() > 1 << 20
    assert _group_members(group) == []


def test_a_server_that_exits_at_start_is_reported_with_its_log(tmp_path) -> None:
    command = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    server = ServerProcess("broken", command, free_port(), tmp_path / "log")
    with pytest.raises(InvalidArgumentError, match=r"broken exited \(3\): no model here"):
        server.start(timeout_s=30)
    assert server.process is None


def _llama_server() -> Path | None:
    return find_llama_server().path


@pytest.mark.skipif(_llama_server() is None, reason="no llama-server ($LLAMA_SERVER or PATH): nothing to compare with")
def test_side_by_side_with_llama_server_on_smollm2(tmp_path) -> None:
    from prefixcache.bench.llamacpp import run
    from prefixcache.models.sources import smollm2_path

    try:
        smollm2_path()
    except InvalidArgumentError as error:
        pytest.skip(str(error))
    result = run(quick=True, precisions=("int8",), cache_dir=tmp_path)
    (side,) = result.data["results"]
    for kind in (PREFIXCACHE, LLAMA_CPP):
        figures = side["sides"][kind]
        assert figures["prefill_tokens_per_s"] > 0 and figures["decode_tokens_per_s"] > 0
        assert figures["resident_bytes"] > 50 << 20  # SmolLM2 in Q8_0 is 145 MB
    assert side["sides"][LLAMA_CPP]["prefill_prompt_tokens"] == [64]  # the ids as sent: no BOS added
    assert side["gguf_type"] == "Q8_0" and Path(side["gguf"]).parent == tmp_path
    assert os.path.exists(side["gguf"])


def test_the_table_gives_ours_over_llama_cpp_and_our_memory_by_process() -> None:
    from prefixcache.bench.llamacpp import QUICK, _rows

    def side(prefill: float, decode: float, parts: list[int]) -> dict:
        listed = [{"pid": i, "name": "p", "bytes": mib << 20} for i, mib in enumerate(parts)]
        figures = {"prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode, "resident_parts": listed}
        return {**figures, "resident_bytes": sum(p["bytes"] for p in listed)}

    result = {
        "precision": "int8",
        "gguf_type": "Q8_0",
        "sides": {PREFIXCACHE: side(300.0, 40.0, [400, 1200]), LLAMA_CPP: side(200.0, 50.0, [800])},
    }
    assert _rows(result, QUICK) == [
        ("int8 / Q8_0", "prefill 64 (tokens/s)", "300.0", "200.0", "1.50"),
        ("int8 / Q8_0", "decode at 128 (tokens/s)", "40.0", "50.0", "0.80"),
        ("int8 / Q8_0", "resident memory (MiB)", "1,600 (400 + 1,200)", "800", "2.00"),
    ]
