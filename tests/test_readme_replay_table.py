"""The README's ``--wide`` example table ("What the replay prints") against the replay of today's code: its token
columns are exact, so each must be what ``prefixcache replay scenarios/*.jsonl --wide`` prints now.

The README's table comes from a run with the ``tiny`` model and ``--verify``; the token counts do not depend on the
model (answers are teacher-forced, the cache matches ids), so the replay here runs ``--no-model`` in a second or two.
The times and speed-ups vary from run to run and are not checked."""

from __future__ import annotations

import re
from pathlib import Path

from prefixcache.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXACT = ("requests", "prompt tok", "cached tok", "hit rate", "ideal cached", "prefilled", "copied")


def markdown_rows(table: str) -> dict[str, dict[str, str]]:
    """``scenario -> column -> cell`` of a GitHub-flavoured table (names without folders, ``.jsonl`` or bold)."""
    lines = [line for line in table.strip().splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        name = Path(cells[0].strip("*")).name.removesuffix(".jsonl")
        rows[name] = dict(zip(header, cells, strict=True))
    return rows


def readme_table() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## What the replay prints") :]
    return re.search(r"\n(\| scenario \| requests .*?)\n\n", section, re.S).group(1)


def test_the_readme_wide_tables_token_counts_are_todays_replay(monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    scenarios = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "scenarios").glob("*.jsonl"))
    assert main(["replay", *scenarios, "--no-model", "--wide", "--no-progress"]) == 0
    printed = markdown_rows(capsys.readouterr().out.split("\n", 3)[3])
    quoted = markdown_rows(readme_table())
    assert sorted(quoted) == sorted(printed) and "total" in quoted
    for name, row in quoted.items():
        assert {column: row[column] for column in EXACT} == {column: printed[name][column] for column in EXACT}, name
