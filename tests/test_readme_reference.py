"""The README's generated reference tables (serve flags, command synopses, endpoints, body fields, metrics,
architectures) are what the code renders now, and the generator that writes them behaves as documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the endpoint and metrics tables need: pip install 'prefixcache[server]'")

from prefixcache.cli import build_parser  # noqa: E402
from prefixcache.cli.reference import REGENERATE, main, render_tables, splice, stale_blocks  # noqa: E402
from prefixcache.errors import InvalidArgumentError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


@pytest.fixture(scope="module")
def tables() -> dict[str, str]:
    return render_tables()


def test_the_readme_generated_blocks_are_what_the_code_renders_now(tables: dict[str, str]) -> None:
    stale = stale_blocks(README.read_text(encoding="utf-8"), tables)

    assert stale == [], f"README.md's generated blocks {stale} differ from the code; regenerate with: {REGENERATE}"


def test_every_serve_option_has_a_row_with_its_default(tables: dict[str, str]) -> None:
    serve = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
    rows = tables["flags:serve"].splitlines()[2:]
    options = [
        a.option_strings[0] for a in serve._actions if a.option_strings and a.dest not in ("help", "verbose_after")
    ]

    assert [row.split("`")[1].split(" ")[0].rstrip(",") for row in rows] == options
    assert "| `--port` | `8000` |" in tables["flags:serve"]
    assert "| `--max-request-bytes BYTES` | `32MiB` |" in tables["flags:serve"]
    assert "| `--engine-process, --no-engine-process` | on |" in tables["flags:serve"]


def test_every_route_the_server_answers_has_a_row_and_a_summary(tables: dict[str, str]) -> None:
    rows = [row.split(" | ") for row in tables["endpoints"].splitlines()[2:]]
    routes = {(method.lstrip("| "), path.strip("`")) for method, path, _ in rows}

    assert {("POST", "/v1/chat/completions"), ("GET", "/v1/models/{model_id}"), ("GET", "/metrics")} <= routes
    assert ("DELETE", "/v1/responses/{response_id}") in routes
    assert all(summary.rstrip(" |") for _, _, summary in rows), rows


def test_each_post_route_has_its_body_fields(tables: dict[str, str]) -> None:
    assert "`prompt`" in tables["fields:/v1/completions"] and "`echo`" in tables["fields:/v1/completions"]
    assert "`chat_template_kwargs`: vLLM's: chat-template variables" in tables["fields:/v1/chat/completions"]
    assert tables["fields:/v1/cache/prefill"].startswith("Fields (any other is a 400): `model`, `messages`")


def test_the_metrics_table_names_each_family_once_with_its_labels(tables: dict[str, str]) -> None:
    names = re.findall(r"^\| `(\w+)` \|", tables["metrics"], re.M)

    assert len(names) == len(set(names)) and not any(name.endswith("_created") for name in names)
    assert "| `prefixcache_requests_total` | counter | `endpoint`, `status` |" in tables["metrics"]
    assert {"prefixcache_engine_up", "prefixcache_hit_rate", "prefixcache_ttft_seconds"} <= set(names)


def test_the_architectures_table_is_the_support_table() -> None:
    from prefixcache.models.architectures import ARCHITECTURES, LAYER_KINDS

    hf_support = pytest.importorskip("prefixcache.models.hf_support")
    hf_tiny = pytest.importorskip("prefixcache.models.hf_tiny")

    assert {a.model_type for a in ARCHITECTURES} == hf_support.TESTED_MODEL_TYPES
    assert len(ARCHITECTURES) == len(hf_support.TESTED_MODEL_TYPES)
    assert {a.kind for a in ARCHITECTURES} == set(LAYER_KINDS)
    assert {a.model_type for a in ARCHITECTURES if a.kind == "recurrent"} == set(hf_tiny.HYBRID_MODEL_TYPES)


def test_splice_replaces_only_the_bodies_between_the_markers() -> None:
    text = "a\n<!-- generated:x -->\nold\n<!-- /generated:x -->\nb\n"

    assert splice(text, {"x": "new"}) == "a\n<!-- generated:x -->\nnew\n<!-- /generated:x -->\nb\n"
    assert stale_blocks(text, {"x": "old"}) == [] and stale_blocks(text, {"x": "new"}) == ["x"]


def test_splice_refuses_a_block_the_code_has_no_table_for_and_a_table_without_a_block() -> None:
    text = "<!-- generated:gone -->\n<!-- /generated:gone -->\n"

    with pytest.raises(InvalidArgumentError, match=r"unknown \['gone'\], missing \['x'\]"):
        splice(text, {"x": "new"})


def test_check_fails_on_a_stale_file_and_write_brings_it_up_to_date(
    tables: dict[str, str], tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setattr("prefixcache.cli.reference.render_tables", lambda: tables)
    stale = "".join(f"<!-- generated:{name} -->\nold\n<!-- /generated:{name} -->\n" for name in tables)
    path = tmp_path / "README.md"
    path.write_text(stale, encoding="utf-8")

    assert main(["--check", str(path)]) == 1
    assert REGENERATE in capsys.readouterr().err
    assert main(["--write", str(path)]) == 0
    assert main(["--check", str(path)]) == 0
    assert path.read_text(encoding="utf-8") == splice(stale, tables)
