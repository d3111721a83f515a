"""The README's Python examples run as written (a newcomer copies them), each saved to a file and run in a fresh
interpreter.  The agent-framework section's examples need a server and are run by tests/serve/test_readme_agents.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_README = (ROOT / "README.md").read_text()
_OUTSIDE_AGENTS = re.sub(r"<!-- agent-frameworks -->.*?<!-- /agent-frameworks -->", "", _README, flags=re.S)
EXAMPLES = re.findall(r"```python\n(.*?)```", _OUTSIDE_AGENTS, re.S)
SHARED = ROOT.parent / "shared" / "data"
# The module an optional extra brings -> the extra (pyproject.toml).
EXTRAS = {"transformers": "hf", "zmq": "events", "msgspec": "events", "matplotlib": "plot", "safetensors": "snapshot"}


def test_the_readme_has_python_examples() -> None:
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("source", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_a_readme_example_runs(source: str, tmp_path: Path) -> None:
    if "../shared/" in source and not SHARED.is_dir():
        pytest.skip("the example reads ../shared/data, absent beside this clone")
    script = tmp_path / "example.py"
    script.write_text(source)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", done.stderr)
    extra = EXTRAS.get(missing.group(1).split(".")[0]) if missing else None
    if done.returncode != 0 and extra is not None and os.environ.get("CI", "").strip().lower() not in ("true", "1"):
        pytest.skip(f"the example needs: pip install -e '.[{extra}]'")  # CI installs every extra: there, it fails
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_server_extra_brings_the_openai_client_the_readme_server_example_imports() -> None:
    import tomllib

    section = _README[_README.index("**1. Any OpenAI client, through a base URL**") :]
    assert section.startswith('**1. Any OpenAI client, through a base URL** (`pip install -e ".[server,hf]"`)')
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "from openai import OpenAI" in example
    server = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["server"]
    assert "openai" in {re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower() for requirement in server}
