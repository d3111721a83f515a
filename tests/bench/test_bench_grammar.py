"""The structured-output rows of ``bench engine``: figures from real constrained decoding, or a row that says the
extra is missing."""

from __future__ import annotations

import sys

import pytest

from prefixcache.bench.grammar import NEW_TOKENS, ROWS, grammar_rows, measure_grammar


def test_constrained_and_plain_steps_are_measured_and_tabulated() -> None:
    pytest.importorskip("llguidance", reason="needs: pip install 'prefixcache[structured]'")
    figures = measure_grammar(quick=True, repeats=2)
    assert figures["available"] and figures["rows"] == ROWS
    assert figures["constrained_s"] > 0 and figures["plain_s"] > 0
    (row,) = grammar_rows(figures)
    assert row[1] == f"{NEW_TOKENS} new" and float(row[5]) == pytest.approx(
        figures["constrained_s"] / figures["plain_s"], abs=0.01
    )


def test_without_the_grammar_engine_the_row_says_what_to_install(monkeypatch) -> None:
    # As where the structured extra is not installed: llguidance cannot be imported (the grammar module itself can).
    monkeypatch.setitem(sys.modules, "llguidance", None)
    figures = measure_grammar(quick=True, repeats=1)
    assert figures == {"available": False}
    assert "prefixcache[structured]" in grammar_rows(figures)[0][2]
