"""The README's Python examples run as written (a newcomer copies them), each in a fresh interpreter."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
SHARED = ROOT.parent / "shared" / "data"


def test_the_readme_has_python_examples() -> None:
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("source", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_a_readme_example_runs(source: str) -> None:
    if "../shared/" in source and not SHARED.is_dir():
        pytest.skip("the example reads ../shared/data, absent beside this clone")
    done = subprocess.run(
        [sys.executable, "-c", source], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
