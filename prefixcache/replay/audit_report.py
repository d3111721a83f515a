"""The figures of an endpoint audit (``replay --endpoint``): per request, per file and in total, as a table and JSON.

Three hit rates stand side by side, each a ratio of its own counts: the endpoint's (its cached tokens over the prompt
tokens as *it* counted them), prefixcache's simulation at the same capacity and the ideal (an infinite cache), both
over the prompt tokens as the replay's tokenizer counted them.  With the server's tokenizer and chat template equal
to the replay's, the two prompt counts agree request by request; otherwise the report says that they differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tabulate import tabulate

from prefixcache.replay.endpoint import EndpointResult, percentile

__all__ = ["AuditReport", "AuditRow", "RequestFigures", "audit_json", "format_audit"]


@dataclass(frozen=True, slots=True)
class RequestFigures:
    """One audited request: where it comes from, the endpoint's answer, and the replay's own counts (tokens) of the
    same prompt: ``replay_prompt_tokens``, ``simulated_cached_tokens`` (prefixcache's tree at the audit's
    capacity) and ``ideal_cached_tokens`` (an infinite cache)."""

    scenario: str
    conversation_id: str
    turn: int
    endpoint: EndpointResult
    replay_prompt_tokens: int
    simulated_cached_tokens: int
    ideal_cached_tokens: int

    def to_json(self) -> dict[str, Any]:
        e = self.endpoint
        return {
            "scenario": self.scenario,
            "conversation_id": self.conversation_id,
            "turn": self.turn,
            "prompt_tokens_server": e.prompt_tokens,
            "cached_tokens_server": e.cached_tokens,
            "cache_field": e.cache_field,
            "ttft_s": e.ttft_s,
            "latency_s": e.latency_s,
            "prompt_tokens_replay": self.replay_prompt_tokens,
            "simulated_cached_tokens": self.simulated_cached_tokens,
            "ideal_cached_tokens": self.ideal_cached_tokens,
        }


@dataclass(frozen=True, slots=True)
class AuditRow:
    """Totals over some requests (a file's, or all).  Tokens are counts, times seconds.

    ``server_prompt_tokens`` / ``server_cached_tokens`` add up the requests whose answer reported them
    (``prompt_reported_requests`` / ``reported_requests`` of them); the endpoint's hit rate divides the cached tokens
    by the prompt tokens of those same requests, so a server that leaves some out is not judged on them.
    """

    name: str
    requests: int
    prompt_reported_requests: int
    server_prompt_tokens: int
    replay_prompt_tokens: int
    server_cached_tokens: int
    reported_requests: int
    reported_prompt_tokens: int
    simulated_cached_tokens: int
    ideal_cached_tokens: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None

    @classmethod
    def of(cls, name: str, figures: Sequence[RequestFigures]) -> AuditRow:
        """The totals of ``figures``.  O(n log n) (the percentiles sort the TTFTs)."""
        reported = [f for f in figures if f.endpoint.cached_tokens is not None and f.endpoint.prompt_tokens is not None]
        ttfts = [f.endpoint.ttft_s for f in figures]
        return cls(
            name,
            len(figures),
            sum(f.endpoint.prompt_tokens is not None for f in figures),
            sum(f.endpoint.prompt_tokens or 0 for f in figures),
            sum(f.replay_prompt_tokens for f in figures),
            sum(f.endpoint.cached_tokens for f in reported),
            len(reported),
            sum(f.endpoint.prompt_tokens for f in reported),
            sum(f.simulated_cached_tokens for f in figures),
            sum(f.ideal_cached_tokens for f in figures),
            percentile(ttfts, 0.5),
            percentile(ttfts, 0.9),
            percentile(ttfts, 0.99),
        )

    @property
    def server_hit_rate(self) -> float | None:
        """The endpoint's cached tokens over its own prompt tokens; ``None`` when it reported no cached tokens."""
        if not self.reported_requests or not self.reported_prompt_tokens:
            return None
        return self.server_cached_tokens / self.reported_prompt_tokens

    @property
    def simulated_hit_rate(self) -> float:
        return self.simulated_cached_tokens / self.replay_prompt_tokens if self.replay_prompt_tokens else 0.0

    @property
    def ideal_hit_rate(self) -> float:
        return self.ideal_cached_tokens / self.replay_prompt_tokens if self.replay_prompt_tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens_server": self.server_prompt_tokens if self.prompt_reported_requests else None,
            "prompt_reported_requests": self.prompt_reported_requests,
            "prompt_tokens_replay": self.replay_prompt_tokens,
            "cached_tokens_server": self.server_cached_tokens,
            "cached_reported_requests": self.reported_requests,
            "hit_rate_server": self.server_hit_rate,
            "simulated_cached_tokens": self.simulated_cached_tokens,
            "simulated_hit_rate": self.simulated_hit_rate,
            "ideal_cached_tokens": self.ideal_cached_tokens,
            "ideal_hit_rate": self.ideal_hit_rate,
            "ttft_s": {"p50": self.ttft_p50_s, "p90": self.ttft_p90_s, "p99": self.ttft_p99_s},
        }


@dataclass(slots=True)
class AuditReport:
    """An endpoint audit: the endpoint and how it was driven, the simulation's capacity (tokens, whole blocks;
    ``None``: unlimited), whether the requests were streamed (else ``ttft_s`` is each request's whole time), every
    request's figures in the order sent, and each file's format."""

    url: str
    model: str
    concurrency: int
    max_tokens: int
    tokenizer: str
    block_size: int
    policy: str
    simulated_cache_tokens: int | None
    stream: bool = True
    requests: list[RequestFigures] = field(default_factory=list)
    input_formats: dict[str, str] = field(default_factory=dict)

    def rows(self) -> list[AuditRow]:
        """One row per file, in input order, then the total."""
        names = list(dict.fromkeys(f.scenario for f in self.requests))
        rows = [AuditRow.of(name, [f for f in self.requests if f.scenario == name]) for name in names]
        return [*rows, AuditRow.of("total", self.requests)]

    @property
    def cache_fields(self) -> dict[str, int]:
        """Where the cached tokens came from (a response field) -> how many requests reported them there."""
        out: dict[str, int] = {}
        for f in self.requests:
            if f.endpoint.cache_field is not None:
                out[f.endpoint.cache_field] = out.get(f.endpoint.cache_field, 0) + 1
        return out

    @property
    def same_prompt_counts(self) -> bool:
        """Whether the server counted every prompt as the replay's tokenizer did."""
        return all(f.endpoint.prompt_tokens == f.replay_prompt_tokens for f in self.requests)


def audit_json(report: AuditReport) -> dict[str, Any]:
    """The ``--json`` report: the totals at the top level, per file under ``scenarios``, the endpoint under
    ``endpoint``."""
    *files, total = report.rows()
    formats = set(report.input_formats.values())
    return {
        "endpoint": {
            "url": report.url,
            "model": report.model,
            "concurrency": report.concurrency,
            "max_tokens": report.max_tokens,
            "temperature": 0,
            "stream": report.stream,
            "cache_fields": report.cache_fields,
        },
        "tokenizer": report.tokenizer,
        "same_prompt_tokens": report.same_prompt_counts,
        "simulation": {
            "cache_tokens": report.simulated_cache_tokens,
            "block_size": report.block_size,
            "policy": report.policy,
        },
        "input_format": formats.pop() if len(formats) == 1 else "mixed",
        **total.to_json(),
        "scenarios": {row.name: {**row.to_json(), "input_format": report.input_formats.get(row.name)} for row in files},
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def format_audit(report: AuditReport) -> str:
    """The audit table (a row per file and the total) with the lines that say how to read it."""
    capacity = "unlimited" if report.simulated_cache_tokens is None else f"{report.simulated_cache_tokens:,}"
    # One prompt column when the server counted as the replay did: the table fits 120 columns then.
    both = not report.same_prompt_counts
    headers = ["file", "reqs", "prompt", *(["ours"] if both else []), "cached", "hit", "sim", "ideal"]
    headers += ["TTFT p50", "p90", "p99"]
    rows = report.rows()
    table = [
        [
            Path(r.name).name,
            f"{r.requests:,}",
            f"{r.server_prompt_tokens:,}" if r.prompt_reported_requests else "-",
            *([f"{r.replay_prompt_tokens:,}"] if both else []),
            f"{r.server_cached_tokens:,}" if r.reported_requests else "-",
            _pct(r.server_hit_rate),
            _pct(r.simulated_hit_rate),
            _pct(r.ideal_hit_rate),
            _s(r.ttft_p50_s),
            _s(r.ttft_p90_s),
            _s(r.ttft_p99_s),
        ]
        for r in rows
    ]
    total = rows[-1]
    lines = [
        f"endpoint: {report.url}, model {report.model}, {total.requests:,} requests, concurrency "
        f"{report.concurrency}, max_tokens {report.max_tokens}, temperature 0",
        tabulate(
            table,
            headers=headers,
            tablefmt="github",
            colalign=("left", *["right"] * (len(headers) - 1)),
            disable_numparse=True,
        ),
    ]
    lines.append(
        "prompt, cached, hit: the endpoint's own counts" + ("; ours: the replay's prompt tokens" if both else "")
    )
    fields = report.cache_fields
    if fields:
        where = ", ".join(f"{name} on {count:,}" for name, count in fields.items())
        lines.append(f"cached tokens: {where} of {total.requests:,} requests")
    else:
        lines.append(
            "cached tokens: the endpoint reported none (neither usage.prompt_tokens_details.cached_tokens nor "
            "timings.cache_n): its hit rate is unknown"
        )
    if not total.prompt_reported_requests:
        lines.append(
            "prompt tokens: the endpoint reported none"
            + (" (its stream carries no usage: --no-stream asks for whole responses)" if report.stream else "")
        )
    elif report.same_prompt_counts:
        lines.append(
            f"prompt tokens: the server counted every prompt as the replay's tokenizer ({report.tokenizer}) did"
        )
    else:
        lines.append(
            f"prompt tokens: the server counted {total.server_prompt_tokens:,}, the replay's tokenizer "
            f"({report.tokenizer}) {total.replay_prompt_tokens:,}: different tokenizers or chat templates; each hit "
            "rate is a ratio of its own counts (--tokenizer PATH replays with the model's own)"
        )
    timing = "TTFT in seconds" if report.stream else "TTFT: each whole request's seconds (--no-stream)"
    lines.append(
        f"sim: prefixcache's radix tree, {report.policy.upper()}, block size {report.block_size}, {capacity} "
        "tokens; it and the ideal (an infinite cache) replay the prompts as sent, one at a time (the endpoint writes "
        f"its own answers: none is teacher forced); {timing}"
    )
    if report.concurrency > 1:
        lines.append(
            f"with {report.concurrency} requests in flight, requests that share a prefix can miss together; the "
            "simulation and the ideal do not"
        )
    rate = total.server_hit_rate
    if rate is not None and report.same_prompt_counts and total.server_cached_tokens > total.ideal_cached_tokens:
        lines.append(
            "the endpoint cached more than an infinite cache would on this input: its cache was warm before the run "
            "(restart it to audit from cold)"
        )
    return "\n".join(lines)
