"""The README's "Use it from an agent framework" snippets run as written (the server one against a free port)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.engine import runner as runner_module
from prefixcache.serve import start_background
from prefixcache.testing import require_smollm2

README = Path(__file__).resolve().parents[2] / "README.md"


def needs(module: str, extra: str) -> None:
    # CI installs every extra: there a missing one fails; on a user's machine it skips.
    if os.environ.get("CI") != "true":
        pytest.importorskip(module, reason=f"needs: pip install 'prefixcache[{extra}]'")


def snippets() -> list[str]:
    text = README.read_text()
    section = text[text.index("<!-- agent-frameworks -->") : text.index("<!-- /agent-frameworks -->")]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


def run_snippet(code: str, folder: Path) -> str:
    # From a file, as a user would save it: smolagents' @tool reads the function's source.
    path = folder / "snippet.py"
    path.write_text(code)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(path), run_name="__main__")
    return out.getvalue()


@pytest.fixture(scope="module", autouse=True)
def one_load_of_each_model() -> Iterator[None]:
    """The snippets each call ``PrefixCachingRunner.from_model("smollm2", ...)``: the module loads the model once (about
    10 s on a 2-core CPU) and every runner the snippets build gets that same model, exactly as a second load would
    give it.  Only the loading is shared; each snippet's runner, cache and calls are its own."""
    loaded: dict[tuple[Any, ...], Any] = {}
    original = runner_module.load_pretrained

    def load_once(source: Any, **options: Any) -> Any:
        key = (str(source.location), *sorted((name, str(value)) for name, value in options.items()))
        if key not in loaded:
            loaded[key] = original(source, **options)
        return loaded[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner_module, "load_pretrained", load_once)
        yield


def test_the_section_has_the_three_ways() -> None:
    codes = snippets()
    assert len(codes) == 3
    assert "base_url=" in codes[0] and "ChatPrefixCache" in codes[1] and "PrefixCacheModel" in codes[2]


def test_base_url_snippet(make_app, tmp_path: Path) -> None:
    require_smollm2()
    app = make_app(PrefixCachingRunner.from_model("smollm2", cache_tokens=8192), model_name="smollm2")
    with start_background(app) as server:
        code = snippets()[0].replace("http://127.0.0.1:8000", server.url)
        printed = run_snippet(code, tmp_path)
    cached, total = re.fullmatch(r"(\d+) of (\d+) prompt tokens cached\n", printed).groups()
    assert int(cached) == int(total) - 1


def test_langchain_snippet(tmp_path: Path) -> None:
    needs("langchain_core", "langchain")
    needs("llguidance", "structured")  # the snippet forces its tool
    require_smollm2()
    printed = run_snippet(snippets()[1], tmp_path)
    assert "'cache_read': " in printed and "'cache_read': 0}" not in printed
    assert "'name': 'get_weather'" in printed and "Paris" in printed


def test_smolagents_snippet(tmp_path: Path) -> None:
    needs("smolagents", "smolagents")
    needs("llguidance", "structured")  # a ToolCallingAgent sends tool_choice "required"
    require_smollm2()
    printed = run_snippet(snippets()[2], tmp_path)  # smolagents also prints the agent's parsing errors
    cached = [int(n) for n in re.findall(r"^(\d+) of \d+ prompt tokens cached$", printed, re.MULTILINE)]
    assert len(cached) >= 2
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
