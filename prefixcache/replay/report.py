"""Readable tables of replay reports (tabulate), for the command line."""

from __future__ import annotations

from tabulate import tabulate

from prefixcache.replay.replayer import ReplayReport, ScenarioReport


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _row(s: ScenarioReport, with_model: bool) -> list:
    row = [
        s.scenario,
        s.requests,
        s.prompt_tokens,
        s.cached_tokens,
        _pct(s.hit_rate),
        s.ideal_cached_tokens,
        _pct(s.ideal_hit_rate),
        s.prefilled_tokens,
        s.copied_tokens,
        s.evictions,
        s.peak_blocks_used,
        s.drift_requests,
    ]
    if with_model:
        speedup = s.speedup
        row += [
            f"{s.prefill_s_cached:.2f}" if s.prefill_s_cached is not None else "-",
            f"{s.prefill_s_uncached:.2f}" if s.prefill_s_uncached is not None else "-",
            f"{speedup:.2f}x" if speedup is not None else "-",
            {True: "yes", False: "NO", None: "-"}[s.verified],
        ]
    return row


def format_replay(report: ReplayReport) -> str:
    """The replay table: one row per scenario file and a total row."""
    with_model = report.model is not None
    headers = [
        "scenario",
        "requests",
        "prompt tok",
        "cached tok",
        "hit rate",
        "ideal cached",
        "ideal rate",
        "prefilled",
        "copied",
        "evictions",
        "peak blocks",
        "drift",
    ]
    if with_model:
        headers += ["prefill s (cache)", "prefill s (none)", "speed-up", "verified"]
    rows = [_row(s, with_model) for s in report.scenarios]
    if len(report.scenarios) > 1:
        rows.append(_row(report.total, with_model))
    title = f"model: {report.model or 'none (cache accounting only)'}, block size {report.block_size}"
    return title + "\n" + tabulate(rows, headers=headers, tablefmt="github", intfmt=",")
