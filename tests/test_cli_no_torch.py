"""The measuring commands run no model, so they import no torch (16-37 s on a loaded machine, for 2-3 s of work):
``replay --no-model``, ``replay --sweep`` and ``replay --endpoint``, each run in a fresh interpreter that reports
whether torch was imported by the time the command returned."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prefixcache.testing import ScriptedModel, require_extra

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = "scenarios/multi_turn_chat.jsonl"
_RUN = (
    "import sys; from prefixcache.cli import main; status = main(sys.argv[1:]); "
    "print('torch imported:', 'torch' in sys.modules, file=sys.stderr); sys.exit(status)"
)


def run_cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PREFIXCACHE_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run(
        [sys.executable, "-c", _RUN, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_replay_no_model_imports_no_torch(tmp_path: Path) -> None:
    done = run_cli("replay", SCENARIO, "--no-model", "--no-progress", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| multi_turn_chat |       28 |     36,041 |     33,299 |    92.4% | 92.4% |" in done.stdout
    assert "torch imported: False" in done.stderr


def test_replay_sweep_imports_no_torch(tmp_path: Path) -> None:
    done = run_cli("replay", SCENARIO, "--sweep", "--sweep-at", "8192", "--no-progress", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "|          8,192 | 32.91%         |           11,861 |" in done.stdout
    assert "torch imported: False" in done.stderr


def test_replay_endpoint_imports_no_torch(tmp_path: Path) -> None:
    require_extra("fastapi", "server")
    require_extra("httpx", "server")
    from prefixcache import PrefixCachingRunner
    from prefixcache.serve import create_app, start_background

    runner = PrefixCachingRunner(ScriptedModel.from_texts(["ok"] * 40), cache_tokens=1 << 16)
    app = create_app(runner, model_name="scripted")
    try:
        with start_background(app, "127.0.0.1", 0) as server:
            done = run_cli("replay", SCENARIO, "--endpoint", server.url, "--no-progress", tmp_path=tmp_path)
    finally:
        app.state.engine.close()
    assert done.returncode == 0, done.stderr[-2000:]
    assert "multi_turn_chat" in done.stdout and "torch imported: False" in done.stderr


def test_the_preset_names_resolved_without_torch_are_the_presets() -> None:
    from prefixcache.models.llama import PRESETS
    from prefixcache.models.sources import PRESET_NAMES

    assert PRESET_NAMES == tuple(PRESETS)
