"""What the benchmarks share: result records, the standard workload and a plain-text table printer (their clock is
:mod:`prefixcache.bench.device_clock`)."""

from __future__ import annotations

import contextlib
import gc
import statistics
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from tqdm import tqdm

from prefixcache.cache.tokens import TOKEN_TYPECODE

T = TypeVar("T")

QUICK_NOT_JUDGED = "quick runs are not judged: goal columns are left empty (sizes too small to mean anything)."


def verdict(met: bool, quick: bool) -> str:
    """A goal column's cell: "met" / "not met", or empty for a ``--quick`` run (see :data:`QUICK_NOT_JUDGED`)."""
    if quick:
        return ""
    return "met" if met else "not met"


@dataclass(frozen=True, slots=True)
class Table:
    """One printed table: a title, column headers and rows of already formatted or numeric cells."""

    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class BenchResult:
    """What one benchmark returns: tables to print and the JSON-ready figures they came from."""

    name: str
    tables: tuple[Table, ...]
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Workload:
    """``num_seqs`` sequences of ``seq_len`` token ids sharing their first ``prefix_len`` tokens.

    ``token_lists`` are lists of Python ints (what a tokenizer hands over); ``token_arrays`` the same as
    ``array('I')`` (what the cache stores), converted once so timed regions do not pay for it.
    """

    num_seqs: int
    seq_len: int
    prefix_len: int
    vocab_size: int
    seed: int
    token_lists: list[list[int]]
    token_arrays: list[array]

    @property
    def params(self) -> dict[str, int]:
        return {
            "num_seqs": self.num_seqs,
            "seq_len": self.seq_len,
            "prefix_len": self.prefix_len,
            "vocab_size": self.vocab_size,
            "seed": self.seed,
        }


def standard_workload(
    num_seqs: int = 2000, seq_len: int = 2000, prefix_len: int = 1500, vocab_size: int = 128_000, seed: int = 0
) -> Workload:
    """The standard tree workload: random token ids (fixed seed) behind one shared prefix.

    The tokens after the prefix are drawn independently per sequence, so with a 128k vocabulary the sequences
    part right after the prefix and the tree is one prefix node with ``num_seqs`` leaves below it.
    """
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab_size, prefix_len, dtype=np.uint32)
    suffixes = rng.integers(0, vocab_size, (num_seqs, seq_len - prefix_len), dtype=np.uint32)
    rows = np.concatenate((np.broadcast_to(prefix, (num_seqs, prefix_len)), suffixes), axis=1)
    token_lists = rows.tolist()
    token_arrays = [array(TOKEN_TYPECODE, row.tobytes()) for row in rows]
    return Workload(num_seqs, seq_len, prefix_len, vocab_size, seed, token_lists, token_arrays)


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """Move every object alive now out of the garbage collector's sight for the duration.

    The workload's token lists hold millions of references; without this, each full collection triggered by
    the cache's own allocations would walk them and bill the cache for the harness's data.  Objects the cache
    creates are still collected (and their collections timed) as usual.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def us_per(total_ns: int, count: int) -> float:
    """Microseconds per item."""
    return total_ns / 1000 / count if count else 0.0


def progress(items: Iterable[T], desc: str, total: int | None = None, enabled: bool = True) -> Iterator[T]:
    """A tqdm bar on stderr, shown only on a terminal (``disable=None``) and when ``enabled``."""
    return iter(tqdm(items, desc=desc, total=total, leave=False, disable=None if enabled else True))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_cell(value: Any) -> str:
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return "" if value is None else str(value)


def format_table(table: Table) -> str:
    """Render a table with aligned columns: text left-aligned, numbers right-aligned."""
    cells = [[format_cell(value) for value in row] for row in table.rows]
    numeric = [all(_is_number(row[i]) for row in table.rows if row[i] is not None) for i in range(len(table.headers))]
    widths = [max([len(header)] + [len(row[i]) for row in cells]) for i, header in enumerate(table.headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    out = [table.title, line(table.headers), line(["-" * w for w in widths])]
    out.extend(line(row) for row in cells)
    out.extend(table.notes)
    return "\n".join(out)


def ratio_spread(ratios: list[float]) -> dict[str, float]:
    """The median, lowest and highest of paired per-repeat ratios: ``ratio``, ``ratio_min``, ``ratio_max``."""
    return {"ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def spread_text(measure: dict) -> str:
    """The median per-repeat ratio with its range: ``"1.02 (0.98-1.05)"``."""
    return f"{measure['ratio']:.2f} ({measure['ratio_min']:.2f}-{measure['ratio_max']:.2f})"


def ms_cells(ours: float, baseline: float) -> tuple[str, str, str]:
    """Table cells of two times in seconds: both in milliseconds, then their ratio."""
    return f"{ours * 1e3:.1f}", f"{baseline * 1e3:.1f}", f"{ours / baseline:.2f}"
