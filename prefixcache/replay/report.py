"""Readable tables of replay reports (tabulate), for the command line, and the template-drift summary."""

from __future__ import annotations

from collections import Counter
from typing import Any

from tabulate import tabulate

from prefixcache.replay.formats import FILE_FORMATS
from prefixcache.replay.results import ReplayReport, ScenarioReport


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.1f}"


def _row(s: ScenarioReport, with_model: bool, host_tier: bool = False, recurrent: bool = False) -> list:
    row = [
        f"{s.scenario} (partial)" if s.partial else s.scenario,
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
    if host_tier:
        row += [_pct(s.device_hit_rate), _pct(s.host_hit_rate)]
    if recurrent:
        row += [s.resume_shortfall_tokens, s.num_states, _mib(s.state_bytes), s.evicted_states]
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
    if report.host_tier:
        headers += ["device rate", "host rate"]
    recurrent = report.state_bytes is not None
    if recurrent:
        headers += ["shortfall", "states kept", "state MiB", "states evicted"]
    if with_model:
        headers += ["prefill s (cache)", "prefill s (none)", "speed-up", "verified"]
    rows = [_row(s, with_model, report.host_tier, recurrent) for s in report.scenarios]
    if len(report.scenarios) > 1:
        rows.append(_row(report.total, with_model, report.host_tier, recurrent))
    title = f"model: {report.model or 'none (cache accounting only)'}, block size {report.block_size}"
    if recurrent:
        every = f", also every {report.state_every} blocks in prompts" if report.state_every else ""
        title += (
            f"; recurrent model: states of {report.state_bytes:,} bytes at the end of prompts and answers, before a "
            f"prompt's last token{every} "
            "(cached = resumed tokens; shortfall = matched but not resumable)"
        )
    title += "".join(f"\n{line}" for line in format_inputs(report))
    if report.partial:
        title = (
            f"PARTIAL: interrupted; the table covers the {report.total.requests:,} requests completed before it\n"
            + title
        )
    return title + "\n" + tabulate(rows, headers=headers, tablefmt="github", intfmt=",")


def format_inputs(report: ReplayReport) -> list[str]:
    """A line per input format of the report: ``input: <what the format is>: <its files>``."""
    files: dict[str, list[str]] = {}
    for s in report.scenarios:
        if s.input_format is not None:
            files.setdefault(s.input_format, []).append(s.scenario)
    return [f"input: {FILE_FORMATS.get(fmt, fmt)}: {', '.join(names)}" for fmt, names in files.items()]


def drift_json(scenario: ScenarioReport) -> dict[str, Any]:
    """The ``drift`` object of a scenario's JSON: how many requests drifted, where relative to the end of their
    conversation's previous prompt + answer (``tokens_before_end``: range, most common, top five), per request
    in ``drifts``."""
    offsets = Counter(d.tokens_before_end for d in scenario.drifts)
    top = offsets.most_common(1)
    return {
        "requests": offsets.total(),
        "tokens_before_end_range": [min(offsets), max(offsets)] if offsets else None,
        "most_common_tokens_before_end": top[0][0] if top else None,
        "most_common_requests": top[0][1] if top else 0,
        "tokens_before_end": {str(k): v for k, v in offsets.most_common(5)},
    }


def format_drift(scenario: ScenarioReport) -> str | None:
    """One line on a scenario's template drift (``None`` without any): how many requests do not extend their
    conversation's previous prompt + answer, and how far before its end they leave it, as a range."""
    if not scenario.drifts:
        return None
    offsets = Counter(d.tokens_before_end for d in scenario.drifts)
    low, high = min(offsets), max(offsets)
    where = f"{low} tokens" if low == high else f"{low} to {high} tokens (most often {offsets.most_common(1)[0][0]})"
    return (
        f"template drift in {scenario.scenario}: {offsets.total()} requests do not extend the previous "
        f"prompt+answer; they leave it {where} before its end"
    )


def format_drift_requests(scenario: ScenarioReport, limit: int = 20) -> str:
    """The ``--explain`` list of drifted requests: conversation, turn, token, and the message holding it."""
    lines = [f"{scenario.scenario}: template drift, request by request"]
    for d in scenario.drifts[:limit]:
        line = f"  conversation {d.conversation_id} turn {d.turn}: token {d.token_index}"
        if d.message_index is not None:
            line += f", message {d.message_index} ({d.message_role})"
        lines.append(line + f", {d.tokens_before_end} tokens before the end of the previous prompt+answer")
    if len(scenario.drifts) > limit:
        lines.append(f"  ... and {len(scenario.drifts) - limit} more (all in --json)")
    return "\n".join(lines)
