"""What a replay measured: per-request samples for plots, per-file totals, and the report over all files."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from prefixcache.cache.radix_cache import RadixCache
from prefixcache.replay.explain import DivergencePoint
from prefixcache.replay.speculate import SpeculationTally

__all__ = ["DriftRecord", "ReplayReport", "ReplaySeries", "ScenarioReport"]


@dataclass(frozen=True, slots=True)
class DriftRecord:
    """A request whose prompt leaves the previous prompt + answer of its conversation at ``token_index``,
    ``tokens_before_end`` tokens before the latter's end; the message holding that token is named with
    ``explain``."""

    conversation_id: str
    turn: int
    token_index: int
    tokens_before_end: int
    message_index: int | None = None
    message_role: str | None = None


@dataclass(slots=True)
class ReplaySeries:
    """Samples taken after each request of a scenario (index ``i``: after request ``i``), for plots.

    ``prompt_tokens``, ``cached_tokens``, ``ideal_cached_tokens``, ``evictions`` and ``evicted_tokens`` are
    cumulative.  ``evictable_blocks`` is ``used_blocks`` less the blocks of locked tokens (rounded up); between
    requests of a replay nothing is locked, so it equals ``used_blocks``.
    """

    prompt_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    ideal_cached_tokens: list[int] = field(default_factory=list)
    used_blocks: list[int] = field(default_factory=list)
    evictable_blocks: list[int] = field(default_factory=list)
    free_blocks: list[int] = field(default_factory=list)
    evictions: list[int] = field(default_factory=list)
    evicted_tokens: list[int] = field(default_factory=list)

    def sample(self, prompt: int, cached: int, ideal: int, cache: RadixCache) -> None:
        """Append one sample: this request's prompt, cached and ideal tokens, and the cache's sizes.  O(1)."""
        stats = cache.stats()
        last = len(self.prompt_tokens) - 1
        self.prompt_tokens.append(prompt + (self.prompt_tokens[last] if last >= 0 else 0))
        self.cached_tokens.append(cached + (self.cached_tokens[last] if last >= 0 else 0))
        self.ideal_cached_tokens.append(ideal + (self.ideal_cached_tokens[last] if last >= 0 else 0))
        locked = min(stats.used_blocks, -(-stats.locked_tokens // stats.block_size))
        self.used_blocks.append(stats.used_blocks)
        self.evictable_blocks.append(stats.used_blocks - locked)
        self.free_blocks.append(stats.free_blocks)
        self.evictions.append(stats.evictions)
        self.evicted_tokens.append(stats.evicted_tokens)


@dataclass(slots=True)
class ScenarioReport:
    """Totals of one replayed file (or of all, for the ``total`` row).  Tokens are token counts, times seconds.

    Recurrent-state modelling (``--state-bytes``, :mod:`prefixcache.cache.resume`): ``cached_tokens`` counts resumed
    tokens only, ``resume_shortfall_tokens`` those that matched but had no kept state to resume from;
    ``num_states`` / ``state_bytes`` are the states kept at the end (within ``max_state_bytes``), ``evicted_states``
    the states the budget evicted, ``dropped_states`` those not kept, ``kv_evicted_states`` those freed with their
    KV.  All 0 otherwise.

    ``speculation``: the predicted speculative decoding of the recorded answers (:mod:`prefixcache.replay.speculate`),
    None when not predicted.
    """

    scenario: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    copied_tokens: int = 0
    ideal_cached_tokens: int = 0
    host_cached_tokens: int = 0
    evictions: int = 0
    evicted_tokens: int = 0
    peak_blocks_used: int = 0
    num_blocks: int = 0
    drift_requests: int = 0
    resume_shortfall_tokens: int = 0
    num_states: int = 0
    state_bytes: int = 0
    max_state_bytes: int = 0
    evicted_states: int = 0
    dropped_states: int = 0
    kv_evicted_states: int = 0
    prefill_s_cached: float | None = None
    prefill_s_uncached: float | None = None
    verified: bool | None = None
    max_abs_logit_diff: float | None = None
    skipped_lines: int = 0
    input_format: str | None = None  # the file's format (prefixcache.replay.formats.FILE_FORMATS); None: total row
    partial: bool = False
    series: ReplaySeries | None = None
    explain_kinds: dict[str, int] | None = None
    divergences: list[DivergencePoint] = field(default_factory=list)
    drifts: list[DriftRecord] = field(default_factory=list)
    speculation: SpeculationTally | None = None

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ideal_hit_rate(self) -> float:
        return self.ideal_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def host_hit_rate(self) -> float:
        """Prompt tokens promoted from the host-memory tier, over all prompt tokens (0 without a host tier)."""
        return self.host_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def device_hit_rate(self) -> float:
        """Prompt tokens found in the device pool, over all prompt tokens."""
        return (self.cached_tokens - self.host_cached_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def speedup(self) -> float | None:
        if not self.prefill_s_cached or self.prefill_s_uncached is None:
            return None
        return self.prefill_s_uncached / self.prefill_s_cached

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["series"]  # one sample per request: too big for the report, it is for plots
        out["hit_rate"] = self.hit_rate
        out["ideal_hit_rate"] = self.ideal_hit_rate
        out["device_hit_rate"] = self.device_hit_rate
        out["host_hit_rate"] = self.host_hit_rate
        out["speedup"] = self.speedup
        out["speculation"] = self.speculation.to_json() if self.speculation is not None else None
        return out


@dataclass(slots=True)
class ReplayReport:
    """Per-scenario reports and their totals; :meth:`to_json` has the documented top-level keys."""

    scenarios: list[ScenarioReport] = field(default_factory=list)
    model: str | None = None
    block_size: int = 16
    requests_log: list[dict[str, Any]] = field(default_factory=list)
    partial: bool = False
    host_tier: bool = False  # the replay had a host-memory tier: the table gives hit rates per tier
    state_bytes: int | None = None  # recurrent-state modelling: bytes per state (the table gives the shortfall)
    state_every: int = 0
    speculate: str = "off"  # --speculate: how the answers' speculative decoding was predicted (off: not)
    verify_cost: tuple[float, ...] | None = None  # the cost of a verify of k draft tokens in decode steps, index k

    @property
    def total(self) -> ScenarioReport:
        total = ScenarioReport("total", partial=self.partial)
        timed = [s for s in self.scenarios if s.prefill_s_cached is not None]
        for s in self.scenarios:
            for name in (
                "requests",
                "prompt_tokens",
                "cached_tokens",
                "prefilled_tokens",
                "copied_tokens",
                "ideal_cached_tokens",
                "host_cached_tokens",
                "evictions",
                "evicted_tokens",
                "drift_requests",
                "skipped_lines",
                "num_blocks",
                "resume_shortfall_tokens",
                "num_states",
                "state_bytes",
                "max_state_bytes",
                "evicted_states",
                "dropped_states",
                "kv_evicted_states",
            ):
                setattr(total, name, getattr(total, name) + getattr(s, name))
            total.peak_blocks_used = max(total.peak_blocks_used, s.peak_blocks_used)
        if timed:
            total.prefill_s_cached = sum(s.prefill_s_cached for s in timed)
            uncached = [s.prefill_s_uncached for s in timed]
            total.prefill_s_uncached = None if None in uncached else sum(uncached)
        verified = [s.verified for s in self.scenarios]
        total.verified = None if not verified or any(v is None for v in verified) else all(verified)
        diffs = [s.max_abs_logit_diff for s in self.scenarios if s.max_abs_logit_diff is not None]
        total.max_abs_logit_diff = max(diffs) if diffs else None
        for s in self.scenarios:
            if s.speculation is not None:
                total.speculation = total.speculation or SpeculationTally()
                total.speculation.add(s.speculation)
        return total

    def to_json(self) -> dict[str, Any]:
        out = self.total.to_json()
        del out["scenario"]
        out["model"] = self.model
        out["block_size"] = self.block_size
        out["partial"] = self.partial
        out["recurrent_state_bytes"] = self.state_bytes
        out["state_every_blocks"] = self.state_every
        out["speculate"] = self.speculate
        out["verify_cost"] = list(self.verify_cost) if self.verify_cost is not None else None
        formats = {s.input_format for s in self.scenarios}
        out["input_format"] = (formats.pop() if len(formats) == 1 else "mixed") if formats else None
        out["scenarios"] = {s.scenario: s.to_json() for s in self.scenarios}
        return out
