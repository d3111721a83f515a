"""Replay chat transcripts (or request traces) through the prefix cache and account for what it saves.

One request per assistant turn: the prompt is the chat template applied to the history before the turn plus the
generation prompt, and the answer is the transcript's own assistant message, teacher forced, so the next turn's
prompt extends prompt + answer.  Conversations interleave as concurrent users would: round-robin by default, or a
seeded random order.  Each scenario file gets a fresh cache.

With a model, every request really runs: prefill of the uncached suffix, the answer's K/V computed, and the
prefill time of the same prompt with no cache measured alongside (same model, scratch blocks).  ``verify`` also
runs the no-cache reference and raises :class:`~prefixcache.errors.VerificationError` if any logit differs by more
than ``atol`` or any greedy token differs.  Without a model (``--no-model``) only the cache accounting runs, on a
metadata-only pool, which takes seconds for millions of tokens.
"""

from __future__ import annotations

import logging
import random
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from prefixcache.cache.pool import KVBlockPool, check_block_size
from prefixcache.cache.radix_cache import RadixCache
from prefixcache.cache.tokens import TOKEN_TYPECODE
from prefixcache.chat.tokenizer import ByteTokenizer, Tokenizer
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.errors import CapacityError, InvalidArgumentError, ScenarioError, VerificationError
from prefixcache.models.base import CausalLM
from prefixcache.replay.explain import (
    DivergencePoint,
    DivergenceTally,
    Explanation,
    MessageSpan,
    explain,
    message_spans,
)
from prefixcache.replay.ideal import IdealCache
from prefixcache.replay.scenarios import Conversation, default_tools_for, detect_format, iter_mooncake, load_scenario

logger = logging.getLogger(__name__)

ORDERS = ("round-robin", "random", "file")


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One request of a replay: where it comes from, its prompt and teacher-forced answer token ids.

    ``drift_at`` is set when the prompt is not a token-level extension of the previous turn's prompt + answer of
    the same conversation: the token index where the two first differ (template drift).  ``conversation`` is the
    transcript it comes from (``None`` for traces), which ``--explain`` uses to name messages.
    """

    scenario: str
    conversation_id: str
    turn: int
    prompt: array
    answer: array
    drift_at: int | None = None
    conversation: Conversation | None = field(default=None, compare=False, repr=False)


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
    """Totals of one replayed file (or of all, for the ``total`` row).  Tokens are token counts, times seconds."""

    scenario: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    copied_tokens: int = 0
    ideal_cached_tokens: int = 0
    evictions: int = 0
    evicted_tokens: int = 0
    peak_blocks_used: int = 0
    num_blocks: int = 0
    drift_requests: int = 0
    prefill_s_cached: float | None = None
    prefill_s_uncached: float | None = None
    verified: bool | None = None
    max_abs_logit_diff: float | None = None
    skipped_lines: int = 0
    series: ReplaySeries | None = None
    explain_kinds: dict[str, int] | None = None
    divergences: list[DivergencePoint] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ideal_hit_rate(self) -> float:
        return self.ideal_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

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
        out["speedup"] = self.speedup
        return out


@dataclass(slots=True)
class ReplayReport:
    """Per-scenario reports and their totals; :meth:`to_json` has the documented top-level keys."""

    scenarios: list[ScenarioReport] = field(default_factory=list)
    model: str | None = None
    block_size: int = 16
    requests_log: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total(self) -> ScenarioReport:
        total = ScenarioReport("total")
        timed = [s for s in self.scenarios if s.prefill_s_cached is not None]
        for s in self.scenarios:
            for name in (
                "requests",
                "prompt_tokens",
                "cached_tokens",
                "prefilled_tokens",
                "copied_tokens",
                "ideal_cached_tokens",
                "evictions",
                "evicted_tokens",
                "drift_requests",
                "skipped_lines",
                "num_blocks",
            ):
                setattr(total, name, getattr(total, name) + getattr(s, name))
            total.peak_blocks_used = max(total.peak_blocks_used, s.peak_blocks_used)
        if timed:
            total.prefill_s_cached = sum(s.prefill_s_cached for s in timed)
            uncached = [s.prefill_s_uncached for s in timed]
            total.prefill_s_uncached = None if None in uncached else sum(uncached)
        verified = [s.verified for s in self.scenarios]
        total.verified = None if any(v is None for v in verified) else all(verified)
        diffs = [s.max_abs_logit_diff for s in self.scenarios if s.max_abs_logit_diff is not None]
        total.max_abs_logit_diff = max(diffs) if diffs else None
        return total

    def to_json(self) -> dict[str, Any]:
        out = self.total.to_json()
        del out["scenario"]
        out["model"] = self.model
        out["block_size"] = self.block_size
        out["scenarios"] = {s.scenario: s.to_json() for s in self.scenarios}
        return out


def conversation_requests(conversation: Conversation, tokenizer: Tokenizer, scenario: str) -> list[ReplayRequest]:
    """The requests of one conversation, in turn order, with template drift marked.

    Raises TemplateError if a message cannot be rendered.
    """
    requests: list[ReplayRequest] = []
    previous: array | None = None
    for turn in conversation.assistant_turns:
        history = conversation.messages[:turn]
        prompt = array(TOKEN_TYPECODE, tokenizer.render_chat(history, conversation.tools, add_generation_prompt=True))
        full = array(
            TOKEN_TYPECODE,
            tokenizer.render_chat(conversation.messages[: turn + 1], conversation.tools, add_generation_prompt=False),
        )
        start = len(prompt) if full[: len(prompt)] == prompt else _common_prefix(full, prompt)
        answer = full[start:]
        drift_at = None
        if previous is not None and prompt[: len(previous)] != previous:
            drift_at = _common_prefix(prompt, previous)
        requests.append(ReplayRequest(scenario, conversation.id, turn, prompt, answer, drift_at, conversation))
        previous = prompt + answer
    return requests


def _common_prefix(a: array, b: array) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def interleave(per_conversation: Sequence[Sequence[ReplayRequest]], order: str, seed: int) -> list[ReplayRequest]:
    """Merge conversations' request lists, keeping each conversation's turn order.

    ``round-robin``: first turns of all conversations, then second turns, ...; ``random``: a seeded random
    conversation takes its next turn each step; ``file``: each conversation whole, in file order.

    Raises:
        InvalidArgumentError: unknown order.
    """
    if order == "file":
        return [r for requests in per_conversation for r in requests]
    if order == "round-robin":
        out = []
        depth = max((len(r) for r in per_conversation), default=0)
        for i in range(depth):
            out.extend(requests[i] for requests in per_conversation if i < len(requests))
        return out
    if order == "random":
        rng = random.Random(seed)
        queues = [list(reversed(r)) for r in per_conversation if r]
        out = []
        while queues:
            i = rng.randrange(len(queues))
            out.append(queues[i].pop())
            if not queues[i]:
                queues[i] = queues[-1]
                queues.pop()
        return out
    raise InvalidArgumentError(f"unknown order {order!r}; choose one of {ORDERS}")


def load_requests(
    path: str | Path,
    tokenizer: Tokenizer,
    *,
    order: str = "round-robin",
    seed: int = 0,
    limit: int | None = None,
    skip_invalid: bool = False,
    file_format: str = "auto",
) -> tuple[list[ReplayRequest], int]:
    """Read a scenario (chat JSONL) or a Mooncake trace into replay requests; returns ``(requests, skipped)``.

    ``limit`` keeps the first ``limit`` conversations (or trace lines).  Mooncake requests have no answer tokens
    and keep the trace's order.

    Raises:
        ScenarioError: a bad line (unless ``skip_invalid``), or an unreadable file.
    """
    path = Path(path)
    name = str(path)
    fmt = detect_format(path) if file_format == "auto" else file_format
    if fmt == "mooncake":
        empty = array(TOKEN_TYPECODE)
        requests = [
            ReplayRequest(name, f"line{i + 1}", 0, array(TOKEN_TYPECODE, r.token_ids), empty)
            for i, r in enumerate(iter_mooncake(path, limit=limit))
        ]
        return requests, 0
    if fmt != "chat":
        raise InvalidArgumentError(f"unknown format {file_format!r}; choose auto, chat or mooncake")
    scenario = load_scenario(path, tools=default_tools_for(path), skip_invalid=skip_invalid)
    for error in scenario.skipped:
        logger.warning("skipped %s", error)
    conversations = scenario.conversations[:limit] if limit is not None else scenario.conversations
    per_conversation = [conversation_requests(c, tokenizer, name) for c in conversations]
    return interleave(per_conversation, order, seed), len(scenario.skipped)


class Replayer:
    """Replays request lists through a fresh cache per scenario and fills a :class:`ReplayReport`.

    ``model=None`` is the cache-only mode.  The pool holds ``cache_tokens`` tokens (``cache_memory`` bytes with a
    model); with neither, it is sized so that nothing is ever evicted (an infinite cache for this replay).
    With ``explain``, each request is explained against the cache just before it runs
    (:func:`~prefixcache.replay.explain.explain`) and the report keeps the most frequent divergence points.
    """

    def __init__(
        self,
        model: CausalLM | None,
        tokenizer: Tokenizer | None = None,
        *,
        block_size: int = 16,
        cache_tokens: int | None = None,
        cache_memory: int | None = None,
        policy: str = "lru",
        verify: bool = False,
        atol: float = 1e-4,
        measure_uncached: bool = True,
        explain: bool = False,
    ) -> None:
        if model is None and cache_memory is not None:
            raise InvalidArgumentError("--cache-memory needs a model (bytes per token); use --cache-tokens")
        if model is None and verify:
            raise InvalidArgumentError("--verify needs a model; drop --no-model")
        check_block_size(block_size)
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.block_size = block_size
        self.cache_tokens = cache_tokens
        self.cache_memory = cache_memory
        self.policy = policy
        self.verify = verify
        self.atol = atol
        self.measure_uncached = measure_uncached
        self.explain = explain

    def replay(
        self,
        scenario: str,
        requests: Sequence[ReplayRequest],
        *,
        progress: Callable[[Iterable], Iterable] | None = None,
        log: list[dict[str, Any]] | None = None,
    ) -> ScenarioReport:
        """Run ``requests`` through a fresh cache; return the scenario's totals.

        Raises:
            CapacityError: a request longer than the pool or the model can hold (the cache stays consistent).
            VerificationError: with ``verify``, cached output differed from the uncached reference.
        """
        report = ScenarioReport(scenario)
        ideal = IdealCache()
        ideal_hits = []
        for request in requests:
            sequence = request.prompt + request.answer
            ideal_hits.append(min(ideal.lookup(request.prompt), len(request.prompt) - 1))
            ideal.add(sequence)
        if self.model is not None and requests:
            # Before any pool is allocated: a prompt beyond the model's positions must not cost gigabytes first.
            longest = max(requests, key=lambda r: len(r.prompt) + len(r.answer))
            if len(longest.prompt) + len(longest.answer) > self.model.max_position:
                raise CapacityError(
                    f"{scenario}: conversation {longest.conversation_id} turn {longest.turn} needs "
                    f"{len(longest.prompt) + len(longest.answer)} positions; the model has {self.model.max_position}"
                )
        runner, cache = self._make_cache(requests, ideal_hits)
        scratch = self._scratch_pool(requests) if runner is not None and self.measure_uncached else None
        namespace = None
        tree_namespace = runner.namespace_key(None) if runner is not None else namespace
        tally = DivergenceTally() if self.explain else None
        spans: dict[int, list[MessageSpan]] = {}
        report.series = ReplaySeries()
        logger.info(
            "%s: replaying %d requests, pool of %d blocks of %d tokens",
            scenario,
            len(requests),
            cache.pool.num_blocks,
            self.block_size,
        )
        if runner is not None:
            report.prefill_s_cached = 0.0
            report.prefill_s_uncached = 0.0 if scratch is not None else None
            report.max_abs_logit_diff = 0.0 if self.verify else None
        iterator = progress(requests) if progress is not None else requests
        for index, request in enumerate(iterator):
            if tally is not None:
                tally.add(self._explain(cache, request, tree_namespace, spans))
            if runner is None:
                # Admitted as the runner admits (the prompt's blocks at once), so both count the same evictions.
                lease = cache.acquire(request.prompt, namespace, num_tokens=len(request.prompt))
                try:
                    cache.reserve(lease, len(request.prompt) + len(request.answer))
                    cache.commit(lease, request.prompt + request.answer)
                except BaseException:
                    if not lease.closed:
                        cache.release(lease)
                    raise
                cached, copied, ttft = lease.num_cached_tokens, lease.num_copied_tokens, None
            else:
                result = runner.generate(request.prompt, forced_tokens=request.answer, return_logits=self.verify)
                cached, copied, ttft = result.usage.cached_tokens, result.usage.copied_tokens, result.usage.ttft_s
                report.prefill_s_cached += ttft
                if scratch is not None:
                    report.prefill_s_uncached += self._uncached_prefill_s(request.prompt, scratch)
                if self.verify:
                    diff = self._verify(request, cached, result.prompt_logits)
                    report.max_abs_logit_diff = max(report.max_abs_logit_diff, diff)
            report.requests += 1
            report.prompt_tokens += len(request.prompt)
            report.cached_tokens += cached
            report.prefilled_tokens += len(request.prompt) - cached
            report.copied_tokens += copied
            report.ideal_cached_tokens += ideal_hits[index]
            report.drift_requests += request.drift_at is not None
            report.peak_blocks_used = max(report.peak_blocks_used, cache.pool.num_used_blocks)
            report.series.sample(len(request.prompt), cached, ideal_hits[index], cache)
            if log is not None:
                log.append(_request_record(request, cached, copied, ideal_hits[index], ttft))
        stats = cache.stats()
        report.evictions = stats.evictions
        report.evicted_tokens = stats.evicted_tokens
        report.num_blocks = cache.pool.num_blocks
        report.verified = True if self.verify else None
        if tally is not None:
            report.explain_kinds = dict(tally.kinds)
            report.divergences = tally.top(3)
        logger.info(
            "%s: %d requests, hit rate %.1f%% (ideal %.1f%%), %d evictions",
            scenario,
            report.requests,
            100 * report.hit_rate,
            100 * report.ideal_hit_rate,
            report.evictions,
        )
        return report

    def _explain(
        self, cache: RadixCache, request: ReplayRequest, namespace: str | None, spans: dict[int, list[MessageSpan]]
    ) -> Explanation:
        """Explain ``request`` against the cache as it is now, naming its messages when it has a transcript."""
        conversation = request.conversation
        message_list = None
        if conversation is not None:
            key = id(conversation)
            if key not in spans:
                spans[key] = message_spans(self.tokenizer, conversation.messages, conversation.tools)
            # The prompt renders messages[:turn]; later spans belong to the answer and beyond.
            message_list = spans[key][: request.turn]
        return explain(cache, request.prompt, namespace, self.tokenizer, message_list)

    def _make_cache(
        self, requests: Sequence[ReplayRequest], ideal_hits: Sequence[int]
    ) -> tuple[PrefixCachingRunner | None, RadixCache]:
        bs = self.block_size
        if self.cache_tokens is not None:
            num_blocks = -(-self.cache_tokens // bs)
        elif self.cache_memory is None:
            # Enough that nothing is evicted: every request's new tokens, plus the partial blocks at its seams.
            new_tokens = (len(r.prompt) + len(r.answer) - hit for r, hit in zip(requests, ideal_hits, strict=True))
            num_blocks = sum(-(-n // bs) + 2 for n in new_tokens)
            num_blocks = max(num_blocks, 1)
        else:
            num_blocks = None
        if self.model is None:
            cache = RadixCache(KVBlockPool(num_blocks, bs), self.policy)
            return None, cache
        runner = PrefixCachingRunner(
            self.model,
            self.tokenizer,
            num_blocks=num_blocks,
            cache_memory=self.cache_memory if num_blocks is None else None,
            block_size=bs,
            policy=self.policy,
        )
        return runner, runner.cache

    def _scratch_pool(self, requests: Sequence[ReplayRequest]) -> KVBlockPool:
        model = self.model
        longest = max((len(r.prompt) for r in requests), default=1)
        return KVBlockPool(
            -(-longest // self.block_size),
            self.block_size,
            num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            dtype=model.dtype,
            device=model.device,
        )

    def _uncached_prefill_s(self, prompt: array, scratch: KVBlockPool) -> float:
        """Time to prefill the whole prompt with no cache: same model, same kernel, scratch blocks."""
        table = scratch.block_table_tensor(range(scratch.blocks_for_tokens(len(prompt))))
        ids = torch.tensor(prompt, dtype=torch.long, device=self.model.device)
        start = time.perf_counter()
        logits = self.model.forward_cached(ids, 0, scratch.kv, table)
        int(torch.argmax(logits[-1]))
        return time.perf_counter() - start

    def _verify(self, request: ReplayRequest, cached: int, prompt_logits: torch.Tensor) -> float:
        reference = self.model.forward_reference(torch.tensor(request.prompt, dtype=torch.long))[cached:]
        reference = reference.float().cpu()
        diff = float((prompt_logits - reference).abs().max())
        same_tokens = torch.equal(prompt_logits.argmax(-1), reference.argmax(-1))
        if diff > self.atol or not same_tokens:
            raise VerificationError(
                f"{request.scenario} conversation {request.conversation_id} turn {request.turn}: cached logits "
                f"differ from the uncached reference by {diff:.3g} (tolerance {self.atol}); "
                f"greedy tokens {'equal' if same_tokens else 'DIFFER'}"
            )
        return diff


def _request_record(request: ReplayRequest, cached: int, copied: int, ideal: int, ttft: float | None) -> dict[str, Any]:
    prompt = len(request.prompt)
    return {
        "scenario": request.scenario,
        "conversation_id": request.conversation_id,
        "turn": request.turn,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": len(request.answer),
            "total_tokens": prompt + len(request.answer),
            "prompt_tokens_details": {"cached_tokens": cached},
            "prefilled_tokens": prompt - cached,
            "copied_tokens": copied,
            "ttft_s": ttft,
        },
        "ideal_cached_tokens": ideal,
        "drift_at": request.drift_at,
    }


def replay_paths(
    paths: Sequence[str | Path],
    replayer: Replayer,
    *,
    order: str = "round-robin",
    seed: int = 0,
    limit: int | None = None,
    skip_invalid: bool = False,
    file_format: str = "auto",
    progress: Callable[[Iterable, str, int], Iterable] | None = None,
    log_requests: bool = False,
) -> ReplayReport:
    """Replay each file with a fresh cache; return all reports.

    Raises:
        ScenarioError: a file is missing or has a bad line (unless ``skip_invalid``).
    """
    report = ReplayReport(block_size=replayer.block_size)
    if replayer.model is not None:
        report.model = getattr(getattr(replayer.model, "config", None), "name", type(replayer.model).__name__)
    for path in paths:
        if not Path(path).is_file():
            raise ScenarioError("no such scenario file", str(path))
        requests, skipped = load_requests(
            path,
            replayer.tokenizer,
            order=order,
            seed=seed,
            limit=limit,
            skip_invalid=skip_invalid,
            file_format=file_format,
        )
        bar = _bound_progress(progress, str(path), len(requests)) if progress else None
        scenario_report = replayer.replay(
            str(path), requests, progress=bar, log=report.requests_log if log_requests else None
        )
        scenario_report.skipped_lines = skipped
        report.scenarios.append(scenario_report)
    return report


def _bound_progress(progress: Callable[[Iterable, str, int], Iterable], path: str, total: int):
    return lambda items: progress(items, path, total)
