"""What ``replay --sweep`` reports: the LRU hit curve at round sizes, Belady's bound beside it, the knee, bytes for a
model shape, as a table, as JSON and as a plot.

The curve comes from one pass (:func:`~prefixcache.replay.sweep.sweep_lru`, Mattson et al. 1970); Belady's bound
(Belady 1966, :mod:`prefixcache.replay.belady`) is simulated once per printed size, on whole blocks (a partly
matched block counts nothing there, so at sizes where LRU's copied rows matter it can read slightly below LRU).  The
knee is the smallest pool, in whole blocks, whose hit rate is within ``knee_points`` percentage points of the
unlimited cache's.  One exact replay through the radix tree at the knee (``exact_at_knee``) shows how far the
tree's eviction is from the pure stack model there (see :mod:`prefixcache.replay.sweep` for why it can differ).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tabulate import tabulate

from prefixcache.errors import InvalidArgumentError
from prefixcache.replay.belady import build_block_trace, simulate
from prefixcache.replay.sweep import SweepResult

__all__ = [
    "KV_DTYPES",
    "SweepPoint",
    "SweepSummary",
    "format_sweep",
    "kv_bytes_per_token_from_config",
    "knee_blocks",
    "plot_sweep",
    "round_sizes",
    "summarize",
    "sweep_json",
]

KV_DTYPES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
"""Bytes per KV element of each ``--kv-dtype``."""


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One size of the curve: ``capacity_tokens`` (whole blocks), the LRU hits there (tokens and rate, and the rate
    of whole blocks alone), Belady's bound on whole blocks (None when not computed) and the KV bytes of that pool
    (None without a model shape)."""

    capacity_tokens: int
    lru_hit_tokens: int
    lru_hit_rate: float
    lru_whole_block_rate: float
    belady_hit_rate: float | None = None
    capacity_bytes: int | None = None


@dataclass(slots=True)
class SweepSummary:
    """A file's sweep: its curve at round sizes, the knee and the unlimited figures (tokens unless named)."""

    scenario: str
    requests: int
    prompt_tokens: int
    block_size: int
    min_capacity_tokens: int
    working_set_tokens: int
    unlimited_hit_rate: float
    knee_tokens: int
    knee_hit_rate: float
    points: list[SweepPoint] = field(default_factory=list)
    bytes_per_token: int | None = None
    exact_at_knee: float | None = None
    sweep_s: float = 0.0

    @property
    def knee_bytes(self) -> int | None:
        return None if self.bytes_per_token is None else self.knee_tokens * self.bytes_per_token


def kv_bytes_per_token_from_config(config_path: str | Path, kv_dtype: str = "bf16", layers: int | None = None) -> int:
    """``2 * layers * kv_heads * head_dim * element bytes`` from a Hugging Face ``config.json`` (the text model's,
    under ``text_config`` when there is one): ``num_hidden_layers`` (or ``layers``), ``num_key_value_heads``
    (default ``num_attention_heads``), ``head_dim`` (default ``hidden_size // num_attention_heads``).  The formula of
    :func:`prefixcache.cache.pool.kv_bytes_per_token`, which ``plan`` and the memory benchmark use.

    Raises:
        InvalidArgumentError: unreadable file, missing fields, an unknown ``kv_dtype``.
    """
    if kv_dtype not in KV_DTYPES:
        raise InvalidArgumentError(f"--kv-dtype {kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
    try:
        config = json.loads(Path(config_path).read_text(encoding="utf-8"))
        config = config.get("text_config", config)
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        num_layers = int(layers if layers is not None else config["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise InvalidArgumentError(f"--model-config {config_path}: cannot read the KV shape ({error})") from None
    if min(heads, kv_heads, head_dim, num_layers) < 1:
        raise InvalidArgumentError(f"--model-config {config_path}: layers, heads and head_dim must be positive")
    return 2 * num_layers * kv_heads * head_dim * KV_DTYPES[kv_dtype]


def round_sizes(min_tokens: int, max_tokens: int, block_size: int) -> list[int]:
    """Round pool sizes in tokens (1, 2, 5 x 10^k, rounded up to whole blocks) from ``min_tokens`` to below
    ``max_tokens``, then ``min_tokens`` and ``max_tokens`` themselves, sorted and distinct."""
    sizes = {min_tokens, max_tokens}
    if max_tokens > 0:
        for exponent in range(int(math.log10(max(min_tokens, 1))), int(math.log10(max_tokens)) + 1):
            for mantissa in (1, 2, 5):
                size = -(-(mantissa * 10**exponent) // block_size) * block_size
                if min_tokens < size < max_tokens:
                    sizes.add(size)
    return sorted(s for s in sizes if s > 0)


def knee_blocks(result: SweepResult, points: float = 1.0) -> int:
    """The smallest pool (blocks, at least ``min_blocks``) whose hit rate is within ``points`` percentage points of
    the unlimited cache's.  O(working set)."""
    hits = result.hits_by_blocks
    if not len(hits) or not result.prompt_tokens:
        return result.min_blocks
    target = result.unlimited_hit_tokens - points / 100 * result.prompt_tokens
    good = np.flatnonzero(hits[result.min_blocks :] >= target - 1e-9)
    return result.min_blocks + int(good[0]) if len(good) else len(hits) - 1


def summarize(
    scenario: str,
    result: SweepResult,
    pairs: Sequence[tuple[Any, Any]] | None = None,
    *,
    bytes_per_token: int | None = None,
    knee_points: float = 1.0,
    exact: Callable[[int], float] | None = None,
    at_tokens: Sequence[int] = (),
) -> SweepSummary:
    """The table rows of one file: the curve at :func:`round_sizes` and at each size of ``at_tokens`` (``--sweep-at``:
    pool sizes in tokens, rounded up to whole blocks as ``--cache-tokens`` is), Belady's bound at each (when the
    request ``pairs`` are given; one simulation per size, O(accesses log capacity) each), the knee, and
    ``exact(tokens)`` (the radix tree's own hit rate at a size) at the knee when given."""
    bs = result.block_size
    ws_blocks = max(result.working_set_blocks, result.min_blocks)
    knee = knee_blocks(result, knee_points)
    summary = SweepSummary(
        scenario=scenario,
        requests=result.num_requests,
        prompt_tokens=result.prompt_tokens,
        block_size=bs,
        min_capacity_tokens=result.min_blocks * bs,
        working_set_tokens=ws_blocks * bs,
        unlimited_hit_rate=result.hit_rate(len(result.hits_by_blocks)),
        knee_tokens=knee * bs,
        knee_hit_rate=result.hit_rate(knee),
        bytes_per_token=bytes_per_token,
    )
    trace = build_block_trace(pairs, bs) if pairs is not None and result.num_requests else None
    asked = {-(-int(tokens) // bs) * bs for tokens in at_tokens}
    for tokens in sorted(set(round_sizes(result.min_blocks * bs, ws_blocks * bs, bs)) | asked):
        blocks = tokens // bs
        belady = simulate(trace, blocks, "belady").hit_rate if trace is not None and blocks else None
        summary.points.append(
            SweepPoint(
                capacity_tokens=tokens,
                lru_hit_tokens=result.hit_tokens(blocks),
                lru_hit_rate=result.hit_rate(blocks),
                lru_whole_block_rate=result.whole_block_hit_tokens(blocks) / max(result.prompt_tokens, 1),
                belady_hit_rate=belady,
                capacity_bytes=None if bytes_per_token is None else tokens * bytes_per_token,
            )
        )
    if exact is not None and result.num_requests:
        summary.exact_at_knee = exact(knee * bs)
    return summary


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.2f} {unit}"
    return f"{num_bytes:,} B"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def format_sweep(summaries: Sequence[SweepSummary]) -> str:
    """One table per file (size, LRU hits, Belady's bound, bytes) and a line for its knee."""
    out = []
    for s in summaries:
        with_bytes = s.bytes_per_token is not None
        headers = [
            "cache tokens",
            *(["KV bytes"] if with_bytes else []),
            "LRU hit rate",
            "LRU hit tokens",
            "LRU whole blocks",
            "Belady whole blocks",
        ]
        rows = []
        for p in s.points:
            row = [p.capacity_tokens, *([_size(p.capacity_bytes)] if with_bytes else [])]
            rows.append(
                [*row, _pct(p.lru_hit_rate), p.lru_hit_tokens, _pct(p.lru_whole_block_rate), _pct(p.belady_hit_rate)]
            )
        knee = f"{s.knee_tokens:,} tokens" + (f" ({_size(s.knee_bytes)})" if with_bytes else "")
        exact = "" if s.exact_at_knee is None else f"; the radix tree replayed at that size: {_pct(s.exact_at_knee)}"
        out.append(
            f"{s.scenario}: {s.requests:,} requests, {s.prompt_tokens:,} prompt tokens, block size {s.block_size}; "
            f"sweep {s.sweep_s:.1f} s\n"
            + tabulate(rows, headers=headers, tablefmt="github", intfmt=",")
            + f"\nunlimited: {_pct(s.unlimited_hit_rate)} from {s.working_set_tokens:,} tokens on; smallest pool "
            f"that replays the file: {s.min_capacity_tokens:,} tokens\n"
            f"knee (within 1 point of unlimited): {knee}, {_pct(s.knee_hit_rate)}{exact}"
        )
    return "\n\n".join(out)


def sweep_json(summaries: Sequence[SweepSummary]) -> dict[str, Any]:
    """The sweep as a JSON-ready dict: ``{"sweeps": [...]}``, one entry per file with its points."""
    return {"sweeps": [{**asdict(s), "knee_bytes": s.knee_bytes} for s in summaries]}


def plot_sweep(summaries: Sequence[SweepSummary], results: Sequence[SweepResult], path: str | Path) -> Path:
    """Hit rate against pool size (log x, tokens; bytes on a second axis with a model shape): the LRU curve at every
    block count, Belady's bound at the printed sizes, the knee and the unlimited rate.  Saved to ``path`` (format from
    the suffix).

    Raises:
        MissingDependencyError: matplotlib is not installed.
    """
    from prefixcache.replay.plot import require_matplotlib

    require_matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    fig = Figure(figsize=(7.5, 3.2 * len(summaries) + 0.6), layout="constrained")
    axes = fig.subplots(len(summaries), 1, squeeze=False)[:, 0]
    for ax, s, r in zip(axes, summaries, results, strict=True):
        blocks = np.arange(r.min_blocks, max(len(r.hits_by_blocks), r.min_blocks + 1))
        rates = [r.hit_rate(int(b)) for b in blocks] if len(blocks) < 20_000 else None
        if rates is None:  # thin a long curve to about 20k points, always keeping its ends
            blocks = np.unique(np.geomspace(r.min_blocks, blocks[-1], 20_000).astype(np.int64))
            rates = [r.hit_rate(int(b)) for b in blocks]
        ax.plot(blocks * r.block_size, rates, color="#1f77b4", label="LRU (stack distances)")
        belady = [(p.capacity_tokens, p.belady_hit_rate) for p in s.points if p.belady_hit_rate is not None]
        if belady:
            ax.plot(*zip(*belady, strict=True), "o--", color="#2ca02c", markersize=4, label="Belady (whole blocks)")
        ax.axhline(s.unlimited_hit_rate, color="grey", linestyle=":", label="unlimited")
        ax.axvline(s.knee_tokens, color="#d62728", linestyle="--", linewidth=1, label=f"knee {s.knee_tokens:,}")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_ylabel("token hit rate")
        ax.set_xlabel("cache size (tokens)")
        ax.set_title(Path(s.scenario).name, fontsize=10)
        if s.bytes_per_token:
            per = s.bytes_per_token / 2**30
            top = ax.secondary_xaxis("top", functions=(lambda t, per=per: t * per, lambda g, per=per: g / per))
            top.set_xlabel("KV GiB")
        ax.legend(fontsize=8, loc="lower right")
    out = Path(path)
    fig.savefig(out, dpi=110)
    return out
