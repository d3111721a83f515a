"""Readable tables of replay reports (tabulate), for the command line, and the template-drift summary."""

from __future__ import annotations

from collections import Counter
from pathlib import PurePath
from typing import Any

from tabulate import tabulate

from prefixcache.replay.formats import FILE_FORMATS
from prefixcache.replay.results import ReplayReport, ScenarioReport
from prefixcache.replay.speculate import DEFAULT_COST_NOTE, DEFAULT_VERIFY_COST


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
            _VERDICT[s.verified],
        ]
    return row


COMPACT_WIDTH = 120
"""Columns the default (compact) replay table fits in, eliding long file names in the middle when it must."""

_NAME_MIN = 12  # characters of a file name the compact table keeps however wide the other columns are


def format_replay(report: ReplayReport, *, wide: bool = False) -> str:
    """The replay table under its title lines: one row per scenario file and a total row.

    By default the compact table (:func:`compact_table`, at most :data:`COMPACT_WIDTH` columns for the usual
    figures); ``wide`` gives every column, under the file names as given.
    """
    table = _wide_table(report) if wide else compact_table(report)
    return _title(report) + "\n" + table


def _title(report: ReplayReport) -> str:
    title = f"model: {report.model or 'none (cache accounting only)'}, block size {report.block_size}"
    if report.state_bytes is not None:
        every = f", also every {report.state_every} blocks in prompts" if report.state_every else ""
        title += (
            f"; recurrent model: states of {report.state_bytes:,} bytes at the end of prompts and answers, before a "
            f"prompt's last token, where requests parted inside a prompt{every} "
            "(cached = resumed tokens; shortfall = matched but not resumable)"
        )
    title += "".join(f"\n{line}" for line in format_inputs(report))
    if report.partial:
        title = (
            f"PARTIAL: interrupted; the table covers the {report.total.requests:,} requests completed before it\n"
            + title
        )
    return title


def compact_table(report: ReplayReport, width: int = COMPACT_WIDTH) -> str:
    """The default table: file (its name without folders and ``.jsonl``, with as many folders as tell two apart),
    requests, prompt and
    cached tokens, hit rate and the ideal's; evictions when any; the host tier's rate and the recurrent shortfall
    when replayed so; with a model the cached prefill seconds, the speed-up when the baseline was timed, and
    ``verified`` under ``--verify``.  Names are elided in the middle (to no fewer than 12 characters) until the
    table fits ``width`` columns.  O(files)."""
    scenarios = list(report.scenarios)
    if len(scenarios) > 1:
        scenarios.append(report.total)
    names = _short_names([s.scenario for s in report.scenarios]) + ["total"] * (len(scenarios) > 1)
    columns: list[tuple[str, Any]] = [
        ("requests", lambda s: s.requests),
        ("prompt tok", lambda s: s.prompt_tokens),
        ("cached tok", lambda s: s.cached_tokens),
        ("hit rate", lambda s: _pct(s.hit_rate)),
        ("ideal", lambda s: _pct(s.ideal_hit_rate)),
    ]
    if any(s.evictions for s in scenarios):
        columns.append(("evictions", lambda s: s.evictions))
    if report.host_tier:
        columns.append(("host rate", lambda s: _pct(s.host_hit_rate)))
    if report.state_bytes is not None:
        columns += [("shortfall", lambda s: s.resume_shortfall_tokens), ("states kept", lambda s: s.num_states)]
    if any(s.speculation is not None and s.speculation.steps for s in scenarios):
        columns.append(("tok/step", lambda s: f"{s.speculation.tokens_per_step:.2f}" if s.speculation else "-"))
    if report.model is not None:
        columns.append(("prefill s", lambda s: _seconds(s.prefill_s_cached)))
        if any(s.prefill_s_uncached is not None for s in scenarios):
            columns.append(("speed-up", lambda s: f"{s.speedup:.2f}x" if s.speedup is not None else "-"))
        if any(s.verified is not None for s in scenarios):
            columns.append(("verified", lambda s: _VERDICT[s.verified]))
    headers = ["scenario"] + [header for header, _ in columns]
    rows = [[_cell(value(s)) for _, value in columns] for s in scenarios]
    suffixes = [" (partial)" if s.partial and name != "total" else "" for name, s in zip(names, scenarios, strict=True)]

    def render(limit: int | None) -> str:
        shown = [_elide(name, limit) + suffix for name, suffix in zip(names, suffixes, strict=True)]
        return _pipe_table(headers, [[n, *r] for n, r in zip(shown, rows, strict=True)])

    table = render(None)
    over = max(map(len, table.splitlines())) - width
    longest = max(map(len, names))
    if over > 0 and longest > _NAME_MIN:
        table = render(max(_NAME_MIN, longest - over))
    return table


def _cell(value: object) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def _pipe_table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown pipe table with no padding beyond one space: the first column left-aligned, the others
    right-aligned (``--:``), as the README's tables are."""
    widths = [max(len(header), *(len(row[i]) for row in rows)) for i, header in enumerate(headers)]

    def line(cells: list[str]) -> str:
        padded = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def _short_names(paths: list[str]) -> list[str]:
    """The shortest trailing parts of ``paths`` (``.jsonl`` dropped) that tell them apart: ``multi_turn_chat``, or
    ``a/chat`` beside ``b/chat``; the paths as given when only the whole path does."""
    parts = [PurePath(path.removesuffix(".jsonl")).parts for path in paths]
    for depth in range(1, max((len(p) for p in parts), default=0) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return list(paths)


def _elide(name: str, limit: int | None) -> str:
    """``name`` cut to ``limit`` characters by an ellipsis in its middle (unchanged when it fits or ``limit`` is
    None)."""
    if limit is None or len(name) <= limit:
        return name
    head = (limit - 1) // 2
    return name[:head] + "…" + name[len(name) - (limit - 1 - head) :]


def _seconds(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


_VERDICT = {True: "yes", False: "NO", None: "-"}


def _wide_table(report: ReplayReport) -> str:
    """Every column (``--wide``), under the file names as given."""
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
    return tabulate(rows, headers=headers, tablefmt="github", intfmt=",")


def format_speculation(report: ReplayReport) -> str | None:
    """The lines on predicted speculative decoding (:mod:`prefixcache.replay.speculate`) over all files: tokens per
    verify step with full drafts, overall and by draft source, then with the adaptive draft length and the projected
    decode speed-up at the cost model; None when it was not predicted or no request had an answer."""
    tally = report.total.speculation
    if tally is None or report.verify_cost is None:
        return None
    where = "each request's own context" + (", else the cache's blocks" if report.speculate == "tree" else "")
    if not tally.steps:
        return f"speculative decoding: no recorded answers to draft ({where})"
    costs = report.verify_cost
    cost_model = "default: " + DEFAULT_COST_NOTE if tuple(costs) == DEFAULT_VERIFY_COST else "--verify-cost"
    return (
        f"speculative decoding, drafts of up to {len(costs) - 1} tokens from {where}, teacher forced on the "
        f"recorded answers: {tally.tokens_per_step:.2f} answer tokens per verify step ({tally.answer_tokens:,} "
        f"tokens in {tally.steps:,} forwards; context drafts {tally.source_tokens_per_step('context'):.2f} a step "
        f"over {tally.context_steps:,}, cache drafts {tally.source_tokens_per_step('tree'):.2f} over "
        f"{tally.tree_steps:,})\n"
        f"adaptive draft length: {tally.adaptive_tokens_per_step:.2f} tokens per step, projected decode speed-up "
        f"{tally.adaptive_speedup:.2f}x (full drafts {tally.speedup:.2f}x), a verify of 1..{len(costs) - 1} draft "
        f"tokens costing {costs[1]:.2f}..{max(costs[1:]):.2f} decode steps ({cost_model})"
    )


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
