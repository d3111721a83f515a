"""Plots of a replay: hit rate against the ideal, and what the block pool holds, request by request.

Needs matplotlib, the optional ``prefixcache[plot]`` extra; without it :func:`plot_replay` raises
:class:`MissingDependencyError` saying how to install it.  Drawing uses matplotlib's object API on a private
:class:`~matplotlib.figure.Figure` (no pyplot, no global backend change), so it is safe inside other programs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from prefixcache.errors import PrefixCacheError, install_command

if TYPE_CHECKING:
    from prefixcache.replay.results import ReplayReport, ScenarioReport

__all__ = ["MissingDependencyError", "check_plot_path", "plot_replay", "require_matplotlib"]

_HIT = "#1f77b4"
_IDEAL = "#2ca02c"
_CACHED = "#9ecae1"
_LOCKED = "#fdae6b"
_FREE = "#e5e5e5"
_EVICT = "#d62728"


class MissingDependencyError(PrefixCacheError, ImportError):
    """An optional dependency (an extra of the package) is not installed."""


def require_matplotlib() -> None:
    """Raise :class:`MissingDependencyError` unless matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            f"plotting needs matplotlib: {install_command('plot')} (or pip install matplotlib)"
        ) from None


def check_plot_path(path: str | Path) -> None:
    """Refuse a plot file name whose suffix is not a format matplotlib writes, before any work.

    Raises:
        MissingDependencyError: matplotlib is not installed.
        InvalidArgumentError: naming the formats it writes.
    """
    require_matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase

    from prefixcache.errors import InvalidArgumentError

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in formats:
        given = f"'.{suffix}'" if suffix else "no suffix"
        raise InvalidArgumentError(
            f"--plot {path}: {given} is not an image format matplotlib writes; use one of "
            + ", ".join(f".{name}" for name in sorted(formats))
        )


def plot_replay(
    report: ReplayReport, path: str | Path | BinaryIO, *, dpi: int = 110, image_format: str | None = None
) -> Path | BinaryIO:
    """Draw one row per scenario of ``report`` and save it to ``path`` (format from the suffix, e.g. ``.png``, or
    ``image_format``, which a binary file object given as ``path`` needs); returns ``path`` (as a Path if a name).

    Left: cumulative hit rate (cached / prompt tokens so far) against the ideal cache's, the gap shaded.  Right:
    the pool's blocks after each request, stacked as cached-and-evictable, locked (only drawn when some are) and
    free, with a red mark at each request during which evictions happened.  x is the request index within the
    scenario.

    Raises:
        MissingDependencyError: matplotlib is not installed.
        InvalidArgumentError: no scenario has a recorded series.
    """
    require_matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    from prefixcache.errors import InvalidArgumentError

    rows = [s for s in report.scenarios if s.series is not None and s.series.prompt_tokens]
    if not rows:
        raise InvalidArgumentError("nothing to plot: the report has no per-request series")
    fig = Figure(figsize=(13, 2.5 * len(rows) + 1.1), layout="constrained")
    axes = fig.subplots(len(rows), 2, squeeze=False)
    any_locked = any(u != e for s in rows for u, e in zip(s.series.used_blocks, s.series.evictable_blocks, strict=True))
    for (left, right), scenario in zip(axes, rows, strict=True):
        _hit_rate_panel(left, scenario)
        _pool_panel(right, scenario, any_locked)
    for ax in axes[-1]:
        ax.set_xlabel("request")
    handles = [
        Line2D([], [], color=_HIT, marker="o", markersize=3, label="radix cache hit rate"),
        Line2D([], [], color=_IDEAL, linewidth=3.5, alpha=0.5, label="ideal (infinite cache)"),
        Patch(color=_IDEAL, alpha=0.15, label="missed vs ideal"),
        Patch(color=_CACHED, label="cached blocks (evictable)"),
        *([Patch(color=_LOCKED, label="locked blocks")] if any_locked else []),
        Patch(color=_FREE, label="free blocks"),
        Line2D([], [], color=_EVICT, marker="v", linestyle="none", label="evictions during the request"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=9, frameon=False)
    model = report.model or "no model (cache accounting only)"
    fig.suptitle(f"prefixcache replay: {model}, block size {report.block_size}", fontsize=12)
    out = Path(path) if isinstance(path, (str, Path)) else path
    fig.savefig(out, dpi=dpi, format=image_format)
    return out


def _x(n: int) -> list[int]:
    return list(range(1, n + 1))


def _ratio(part: Sequence[int], whole: Sequence[int]) -> list[float]:
    return [p / w if w else 0.0 for p, w in zip(part, whole, strict=True)]


def _hit_rate_panel(ax, scenario: ScenarioReport) -> None:
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    series = scenario.series
    x = _x(len(series.prompt_tokens))
    hit = _ratio(series.cached_tokens, series.prompt_tokens)
    ideal = _ratio(series.ideal_cached_tokens, series.prompt_tokens)
    marker = "o" if len(x) <= 60 else None
    # The ideal is drawn wide and pale underneath, so it stays visible where the cache reaches it.
    ax.plot(x, ideal, color=_IDEAL, linewidth=3.5, alpha=0.5)
    ax.fill_between(x, hit, ideal, color=_IDEAL, alpha=0.15, linewidth=0)
    ax.plot(x, hit, color=_HIT, marker=marker, markersize=3, linewidth=1.6)
    ax.set_ylim(0, 1.02)
    ax.set_xlim(0.5, len(x) + 0.5)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("cumulative hit rate")
    ax.grid(alpha=0.3)
    ax.set_title(
        f"{Path(scenario.scenario).stem}: hit rate {100 * scenario.hit_rate:.1f}% "
        f"(ideal {100 * scenario.ideal_hit_rate:.1f}%), {scenario.requests} requests",
        fontsize=10,
        loc="left",
    )


def _pool_panel(ax, scenario: ScenarioReport, with_locked: bool) -> None:
    from matplotlib.ticker import MaxNLocator

    series = scenario.series
    x = _x(len(series.used_blocks))
    layers = [series.evictable_blocks]
    colors = [_CACHED]
    if with_locked:
        layers.append([u - e for u, e in zip(series.used_blocks, series.evictable_blocks, strict=True)])
        colors.append(_LOCKED)
    layers.append(series.free_blocks)
    colors.append(_FREE)
    # One bar-like step per request: edges at i - 0.5 and i + 0.5, the last value repeated to close the step.
    edges = [i - 0.5 for i in x] + [len(x) + 0.5]
    ax.stackplot(edges, *[[*layer, layer[-1]] for layer in layers], colors=colors, step="post")
    total = scenario.num_blocks or max(u + f for u, f in zip(series.used_blocks, series.free_blocks, strict=True))
    previous = [0, *series.evictions[:-1]]
    evicted_at = [i for i, now, before in zip(x, series.evictions, previous, strict=True) if now > before]
    if evicted_at:
        ax.plot(evicted_at, [total] * len(evicted_at), "v", color=_EVICT, markersize=6, clip_on=False)
    ax.set_ylim(0, total * 1.04)
    ax.set_xlim(0.5, len(x) + 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("blocks")
    ax.grid(alpha=0.3)
    evictions = series.evictions[-1]
    ax.set_title(
        f"pool of {total:,} blocks: peak {scenario.peak_blocks_used:,} used; "
        f"{evictions} eviction{'' if evictions == 1 else 's'} ({series.evicted_tokens[-1]:,} tokens)",
        fontsize=10,
        loc="left",
    )
