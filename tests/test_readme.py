"""The README's Python examples run as written (a newcomer copies them), each saved to a file and run in a fresh
interpreter.  The agent-framework section's examples need a server and are run by tests/serve/test_readme_agents.py."""

from __future__ import annotations

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
    assert done.returncode == 0, done.stderr[-2000:]
