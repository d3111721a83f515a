"""Replay chat transcripts (or request traces) through the prefix cache and account for what it saves.

One request per assistant turn: the prompt is the chat template applied to the history before the turn plus the
generation prompt, and the answer is the transcript's own assistant message, teacher forced, so the next turn's
prompt extends prompt + answer.  Conversations interleave as concurrent users would: round-robin by default, or a
seeded random order.  Each scenario file gets a fresh cache.

With a model, every request really runs: prefill of the uncached suffix, the answer's K/V computed, and the
prefill time of the same prompt with no cache measured alongside (same model, scratch blocks).  ``verify`` also
runs the no-cache reference (whose time then is the uncached prefill time) and raises
:class:`~prefixcache.errors.VerificationError` if any logit differs by more than ``atol`` or any greedy token differs.
Without a model (``--no-model``) only the cache accounting runs, on a metadata-only pool, which takes seconds for
millions of tokens.

Recurrent models (``state_bytes``, cache-only): the cache then models a hybrid or state-space model (Qwen3-Next,
Nemotron-H, Mamba-2) whose recurrent state snapshot costs ``state_bytes`` bytes (:mod:`prefixcache.cache.resume`):
a request resumes only at a kept state, and the replay keeps them where the engine core does: at the end of every
prompt (when its prefill ends) and of every answer (a chat's next turn resumes there), before every prompt's last
token (a repeated prompt resumes there), at every ``state_every``-th block boundary the prefill passes inside the
prompt (default 16, the runner's ``state_interval_blocks``; 0: none; vLLM caches Mamba state at block boundaries), and
at the branch marks it passes (:mod:`prefixcache.cache.marks`: where an earlier request's match was cut back to a kept
state, so the second conversation behind a shared system prompt keeps a state at its end and the third resumes there).
The hit rate then counts resumed tokens only; the shortfall is reported beside it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixcache.cache.host import host_pool_for
from prefixcache.cache.pool import KVBlockPool, check_block_size, kv_bytes_per_token
from prefixcache.cache.radix_cache import RadixCache
from prefixcache.cache.resume import DEFAULT_STATE_INTERVAL_BLOCKS, StateMarker
from prefixcache.chat.tokenizer import ByteTokenizer, Tokenizer
from prefixcache.errors import CapacityError, InvalidArgumentError
from prefixcache.replay.explain import (
    DivergenceTally,
    Explanation,
    MessageLocator,
    explain,
)
from prefixcache.replay.ideal import IdealCache
from prefixcache.replay.model_limits import DEFAULT_ATOL as DEFAULT_ATOL
from prefixcache.replay.model_limits import HALF_ATOL as HALF_ATOL
from prefixcache.replay.model_limits import RECURRENT_ATOL as RECURRENT_ATOL
from prefixcache.replay.model_limits import default_atol, free_memory_bytes, gib
from prefixcache.replay.options import check_options as check_options
from prefixcache.replay.requests import ORDERS as ORDERS
from prefixcache.replay.requests import Progress, read_requests, smallest_pool_tokens
from prefixcache.replay.requests import ReplayRequest as ReplayRequest
from prefixcache.replay.requests import conversation_requests as conversation_requests
from prefixcache.replay.requests import interleave as interleave
from prefixcache.replay.requests import load_requests as load_requests
from prefixcache.replay.results import DriftRecord as DriftRecord
from prefixcache.replay.results import ReplayReport as ReplayReport
from prefixcache.replay.results import ReplaySeries as ReplaySeries
from prefixcache.replay.results import ScenarioReport as ScenarioReport
from prefixcache.replay.scenarios import expand_paths
from prefixcache.replay.speculate import DEFAULT_VERIFY_COST, SPECULATE_MODES, Speculator, costs_by_length

if TYPE_CHECKING:  # a replay without a model (--no-model) imports no torch
    from prefixcache.engine.runner import PrefixCachingRunner
    from prefixcache.models.base import CausalLM

logger = logging.getLogger(__name__)


DEFAULT_PREFILL_CHUNK_TOKENS = 512
"""Tokens per prefill forward in a model replay (the server's ``--max-batch-tokens`` default): a long prompt's
progress shows chunk by chunk and a Ctrl-C acts between chunks."""


class ReplayInterrupted(KeyboardInterrupt):
    """Ctrl-C during a replay: ``report`` holds the requests completed before it, marked ``partial``.

    A :class:`KeyboardInterrupt`, so a caller that does not look for it still stops as on any Ctrl-C.
    """

    def __init__(self, report: ScenarioReport | ReplayReport) -> None:
        super().__init__("replay interrupted")
        self.report = report


class Replayer:
    """Replays request lists through a fresh cache per scenario and fills a :class:`ReplayReport`.

    ``model=None`` is the cache-only mode.  The pool holds ``cache_tokens`` tokens (``cache_memory`` bytes with a
    model); with neither, it is sized so that nothing is ever evicted (an infinite cache for this replay).
    ``host_cache_tokens`` / ``host_cache_memory`` add a host-memory tier of that size
    (:mod:`prefixcache.cache.host`); the report then says how many cached tokens came from it.
    With ``explain``, each request is explained against the cache just before it runs
    (:func:`~prefixcache.replay.explain.explain`) and the report keeps the most frequent divergence points.
    ``state_bytes`` (cache-only) models a recurrent model (see the module docstring): states of that many bytes,
    also every ``state_every`` blocks inside prompts when not 0, within ``max_state_bytes`` (default: enough that
    the budget evicts no state, an infinite state cache for this replay, as for the pool).
    With a model, prompts (and teacher-forced answers) are computed in forwards of at most ``prefill_chunk_tokens``
    tokens (None: one forward each), the uncached baseline too, so a tqdm bar given as ``progress`` shows each
    prefill chunk by chunk (in its postfix) and a Ctrl-C acts between chunks.
    ``speculate`` (``"context"`` or ``"tree"``; ``"off"``: none) predicts speculative decoding on the recorded answers
    (:mod:`prefixcache.replay.speculate`), a verify of ``k`` draft tokens costing ``verify_cost[k]`` decode steps.
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
        atol: float | None = None,
        measure_uncached: bool = True,
        explain: bool = False,
        host_cache_tokens: int | None = None,
        host_cache_memory: int | None = None,
        state_bytes: int | None = None,
        state_every: int = DEFAULT_STATE_INTERVAL_BLOCKS,
        max_state_bytes: int | None = None,
        prefill_chunk_tokens: int | None = DEFAULT_PREFILL_CHUNK_TOKENS,
        speculate: str = "off",
        verify_cost: Sequence[float] | None = None,
    ) -> None:
        check_options(
            has_model=model is not None,
            cache_memory=cache_memory,
            verify=verify,
            host_cache_memory=host_cache_memory,
            state_bytes=state_bytes,
            state_every=state_every,
            max_state_bytes=max_state_bytes,
            host_tier=host_cache_tokens is not None or host_cache_memory is not None,
        )
        check_block_size(block_size)
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.block_size = block_size
        self.cache_tokens = cache_tokens
        self.cache_memory = cache_memory
        self.policy = policy
        self.verify = verify
        if atol is None:
            atol = default_atol(model)
        self.atol = atol
        self.measure_uncached = measure_uncached
        self.explain = explain
        self.host_cache_tokens = host_cache_tokens
        self.host_cache_memory = host_cache_memory
        self.state_bytes = state_bytes
        self.state_every = state_every
        self.max_state_bytes = max_state_bytes
        if prefill_chunk_tokens is not None and (isinstance(prefill_chunk_tokens, bool) or prefill_chunk_tokens < 1):
            raise InvalidArgumentError(
                f"prefill_chunk_tokens must be a positive int or None, got {prefill_chunk_tokens}"
            )
        self.prefill_chunk_tokens = prefill_chunk_tokens
        if speculate not in SPECULATE_MODES:
            raise InvalidArgumentError(f"speculate must be one of {SPECULATE_MODES}, got {speculate!r}")
        self.speculate = speculate
        self.verify_cost = tuple(verify_cost) if verify_cost is not None else DEFAULT_VERIFY_COST

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
        speculator = None
        if self.speculate != "off":
            speculator = Speculator(requests, self.speculate, self.verify_cost)
            if self.speculate == "tree":
                cache.subscribe(speculator.drafter)
        reference = None
        if runner is not None:
            from prefixcache.replay.reference import UncachedReference

            reference = UncachedReference(self.model, self.block_size, self.atol, self.prefill_chunk_tokens)
            if requests:
                reference.warm_up(requests[0].prompt)
        scratch = reference.scratch_pool(requests) if reference is not None and self.measure_uncached else None
        namespace = None
        tree_namespace = runner.namespace_key(None) if runner is not None else namespace
        tally = DivergenceTally() if self.explain else None
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
        note = getattr(iterator, "set_postfix_str", None)  # a tqdm bar: each prefill's progress shown beside it
        previous_end: dict[str, int] = {}
        try:
            for index, request in enumerate(iterator):
                explanation = self._explain(cache, request, tree_namespace) if tally is not None else None
                if speculator is not None:  # before the request's own commit: the cache holds earlier ones only
                    speculator.run(request, tree_namespace)
                if runner is None:
                    cached, copied, ttft = self._account(cache, request, namespace)
                else:
                    result = runner.generate(
                        request.prompt,
                        forced_tokens=request.answer,
                        return_logits=self.verify,
                        max_batch_tokens=self.prefill_chunk_tokens,
                        on_step=_prefill_note(note, len(request.prompt)),
                    )
                    cached, copied, ttft = result.usage.cached_tokens, result.usage.copied_tokens, result.usage.ttft_s
                    if self.verify:
                        diff, uncached_s = reference.verify(request, cached, result.prompt_logits)
                        report.max_abs_logit_diff = max(report.max_abs_logit_diff, diff)
                    elif scratch is not None:
                        uncached_s = reference.prefill_s(request.prompt, scratch)
                    report.prefill_s_cached += ttft
                    if scratch is not None:
                        report.prefill_s_uncached += uncached_s
                if explanation is not None:
                    tally.add(explanation)
                if request.drift_at is not None and request.conversation_id in previous_end:
                    before_end = previous_end[request.conversation_id] - request.drift_at
                    report.drifts.append(self._drift(request, before_end, explanation is not None))
                previous_end[request.conversation_id] = len(request.prompt) + len(request.answer)
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
        except KeyboardInterrupt:
            report.partial = True
        if speculator is not None:
            report.speculation = speculator.tally
            if self.speculate == "tree":
                cache.unsubscribe(speculator.drafter)
        self._finish(report, cache, tally)
        if report.partial:
            raise ReplayInterrupted(report)
        return report

    def _account(self, cache: RadixCache, request: ReplayRequest, namespace: str | None) -> tuple[int, int, None]:
        """Cache-only mode: acquire, reserve and commit the request's tokens; ``(cached, copied, None)``."""
        # Admitted as the runner admits (the prompt's blocks at once), so both count the same evictions.
        lease = cache.acquire(request.prompt, namespace, num_tokens=len(request.prompt))
        try:
            state = None
            if self.state_bytes is not None:
                # As the engine core does (tree_writes), in its order, which decides what a tight state budget
                # evicts: the prefill keeps a state at each block boundary it passes (inserting the prompt so far)
                # and branch mark, then the prompt goes in with the state after it, then the one before its last
                # token (for a repeat).
                state = StateMarker(self.state_bytes)
                last = len(request.prompt) - 1
                boundaries = set(self._inner_state_positions(lease.num_cached_tokens, last))
                marks = {p for p in lease.state_points if p < last}
                for length in sorted(boundaries | marks):
                    if length in boundaries:
                        cache.insert_prefix(lease, request.prompt[:length], state=state)
                    else:
                        cache.put_state(lease, length, state)
                cache.insert_prefix(lease, request.prompt, state=state)
                if last > lease.num_cached_tokens:
                    cache.put_state(lease, last, state)
            cache.reserve(lease, len(request.prompt) + len(request.answer))
            cache.commit(lease, request.prompt + request.answer, state=state)
        except BaseException:
            if not lease.closed:
                cache.release(lease)
            raise
        return lease.num_cached_tokens, lease.num_copied_tokens, None

    def _inner_state_positions(self, resumed: int, prompt_tokens: int) -> range:
        """The block boundaries strictly between the resume point and the prompt's end at which a prefill from
        ``resumed`` keeps a state: every ``state_every``-th block (none when 0)."""
        if not self.state_every:
            return range(0)
        step = self.state_every * self.block_size
        return range((resumed // step + 1) * step, prompt_tokens, step)

    def _states_per_request(self, request: ReplayRequest) -> int:
        """Distinct states a request may add at most: the end of its prompt and answer, before the prompt's last token,
        the inner block boundaries, and one at a branch mark (each request marks at most one position, and a state
        put again at a marked position replaces the one there)."""
        return 4 + len(self._inner_state_positions(0, len(request.prompt)))

    def _drift(self, request: ReplayRequest, before_end: int, name_message: bool) -> DriftRecord:
        span = None
        if name_message and request.conversation is not None:
            span = self._locator(request).locate(request.drift_at)
        return DriftRecord(
            request.conversation_id,
            request.turn,
            request.drift_at,
            before_end,
            span.index if span else None,
            span.role if span else None,
        )

    def _finish(self, report: ScenarioReport, cache: RadixCache, tally: DivergenceTally | None) -> None:
        stats = cache.stats()
        report.evictions = stats.evictions
        report.evicted_tokens = stats.evicted_tokens
        report.host_cached_tokens = stats.host_hit_tokens
        report.resume_shortfall_tokens = stats.resume_shortfall_tokens
        report.num_states = stats.num_states
        report.state_bytes = stats.state_bytes
        report.max_state_bytes = stats.max_state_bytes
        report.evicted_states = stats.evicted_states
        report.dropped_states = stats.dropped_states
        report.kv_evicted_states = stats.kv_evicted_states
        report.num_blocks = cache.pool.num_blocks
        report.verified = True if self.verify and report.requests else None  # none verified: no verdict
        if tally is not None:
            report.explain_kinds = dict(tally.kinds)
            report.divergences = tally.top(3)
        logger.info(
            "%s: %d requests, hit rate %.1f%% (ideal %.1f%%), %d evictions",
            report.scenario,
            report.requests,
            100 * report.hit_rate,
            100 * report.ideal_hit_rate,
            report.evictions,
        )

    def _locator(self, request: ReplayRequest) -> MessageLocator:
        conversation = request.conversation
        messages = conversation.messages[: request.turn]
        return MessageLocator(self.tokenizer, messages, conversation.tools, prompt=request.prompt)

    def _explain(self, cache: RadixCache, request: ReplayRequest, namespace: str | None) -> Explanation:
        """Explain ``request`` against the cache as it is now, naming its messages when it has a transcript; the
        messages are located on the request's own prompt, so a template that re-renders history is no problem."""
        locator = self._locator(request) if request.conversation is not None else None
        return explain(cache, request.prompt, namespace, self.tokenizer, locator)

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
            if self.state_bytes is not None and requests:
                # A request that cannot resume a cached prefix holds blocks for all of it until commit releases the
                # duplicates: room for the longest request on top, so that nothing is evicted still.
                num_blocks += max(-(-(len(r.prompt) + len(r.answer)) // bs) + 1 for r in requests)
            num_blocks = max(num_blocks, 1)
        else:
            num_blocks = None
        if self.model is None:
            pool = KVBlockPool(num_blocks, bs)
            if self.state_bytes is not None:
                budget = self.max_state_bytes
                if budget is None:  # enough for every state the replay puts: the budget evicts none
                    budget = self.state_bytes * sum(self._states_per_request(r) for r in requests)
                return None, RadixCache(pool, self.policy, resume_states=True, max_state_bytes=budget)
            cache = RadixCache(pool, self.policy, host_pool=host_pool_for(pool, self.host_cache_tokens))
            return None, cache
        if num_blocks is not None:
            self.check_pool_memory(num_blocks * bs * self.bytes_per_token, "the unlimited pool this replay needs")
        from prefixcache.engine.runner import PrefixCachingRunner

        runner = PrefixCachingRunner(
            self.model,
            self.tokenizer,
            num_blocks=num_blocks,
            cache_memory=self.cache_memory if num_blocks is None else None,
            block_size=bs,
            policy=self.policy,
            host_cache_tokens=self.host_cache_tokens,
            host_cache_memory=self.host_cache_memory,
        )
        return runner, runner.cache

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V per cached token of the model (0 without a model)."""
        if self.model is None:
            return 0
        m = self.model
        return kv_bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, m.dtype)

    def capacity_tokens(self) -> int | None:
        """Tokens the pool holds when its size is fixed (``cache_tokens`` or ``cache_memory``), in whole blocks;
        ``None`` when it is sized to the replay."""
        bs = self.block_size
        if self.cache_tokens is not None:
            return -(-self.cache_tokens // bs) * bs
        if self.cache_memory is not None and self.model is not None:
            return self.cache_memory // (self.bytes_per_token * bs) * bs
        return None

    def check_pool_memory(self, num_bytes: int | None = None, what: str | None = None) -> None:
        """Refuse a KV pool of ``num_bytes`` larger than the memory free on the model's device, before trying to
        allocate it.  By default the fixed pool: ``cache_memory``, or ``cache_tokens`` times the bytes per token.

        Raises:
            CapacityError: naming both sizes.
        """
        if self.model is None:
            return
        if num_bytes is None:
            if self.cache_memory is not None:
                num_bytes, what = self.cache_memory, "--cache-memory"
            elif self.cache_tokens is not None:
                num_bytes, what = self.capacity_tokens() * self.bytes_per_token, f"--cache-tokens {self.cache_tokens:,}"
            else:
                return
        free = free_memory_bytes(self.model.device)
        if free is not None and num_bytes > free:
            raise CapacityError(
                f"{what} asks for {gib(num_bytes)} of KV but {self.model.device} has only {gib(free)} free; "
                f"give a smaller --cache-memory (or --cache-tokens)"
            )


def _prefill_note(note: Callable[..., object] | None, prompt_tokens: int) -> Callable[[int], None] | None:
    """``on_step`` for a request of ``prompt_tokens``: ``note("prefill 1,024/30,000 tok")`` while its prompt is
    computed (None without a bar)."""
    if note is None:
        return None

    def on_step(position: int) -> None:
        if position <= prompt_tokens:
            note(f"prefill {position:,}/{prompt_tokens:,} tok", refresh=True)

    return on_step


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
    progress: Progress | None = None,
    log_requests: bool = False,
) -> ReplayReport:
    """Replay each file with a fresh cache; return all reports.

    A folder stands for its ``*.jsonl`` files, sorted.  All files are read and tokenized first, so that a pool
    too small for the largest request is refused before anything runs, naming the smallest size that replays
    the whole input.  ``progress`` sees each phase (tokenizing, replaying) of each file.

    Raises:
        ScenarioError: a file is missing or has a bad line (unless ``skip_invalid``).
        CapacityError: the pool (``cache_tokens`` or ``cache_memory``) cannot hold the largest request.
        ReplayInterrupted: Ctrl-C; its ``report`` has the files and requests completed before it, marked partial.
    """
    report = ReplayReport(block_size=replayer.block_size)
    report.state_bytes = replayer.state_bytes
    report.state_every = replayer.state_every
    report.speculate = replayer.speculate
    # The table the simulation charges: one cost for each draft length up to the maximum, the last value repeated.
    report.verify_cost = costs_by_length(replayer.verify_cost) if replayer.speculate != "off" else None
    report.host_tier = replayer.host_cache_tokens is not None or replayer.host_cache_memory is not None
    if replayer.model is not None:
        report.model = getattr(getattr(replayer.model, "config", None), "name", type(replayer.model).__name__)
    loaded: list[tuple[str, list[ReplayRequest], int]] = []
    formats: dict[str, str] = {}
    try:
        for path in expand_paths(paths):
            file = read_requests(
                path,
                replayer.tokenizer,
                order=order,
                seed=seed,
                limit=limit,
                skip_invalid=skip_invalid,
                file_format=file_format,
                progress=progress,
            )
            loaded.append((file.path, file.requests, file.skipped))
            formats[file.path] = file.file_format
        _check_capacity(replayer, loaded)
        for name, requests, skipped in loaded:
            bar = None
            if progress is not None:
                bar = _bound_progress(progress, f"replay {Path(name).name}", len(requests))
            log = report.requests_log if log_requests else None
            try:
                scenario_report = replayer.replay(name, requests, progress=bar, log=log)
            except ReplayInterrupted as interrupted:
                interrupted.report.skipped_lines = skipped
                interrupted.report.input_format = formats[name]
                report.scenarios.append(interrupted.report)
                raise
            scenario_report.skipped_lines = skipped
            scenario_report.input_format = formats[name]
            report.scenarios.append(scenario_report)
    except KeyboardInterrupt:
        report.partial = True
        raise ReplayInterrupted(report) from None
    return report


def _check_capacity(replayer: Replayer, loaded: Sequence[tuple[str, list[ReplayRequest], int]]) -> None:
    capacity = replayer.capacity_tokens()
    if capacity is None or not loaded:
        return
    bs = replayer.block_size
    need, largest = max((smallest_pool_tokens(requests, bs) for _, requests, _ in loaded), key=lambda x: x[0])
    if largest is None or need <= capacity:
        return
    where = f"{largest.scenario}: conversation {largest.conversation_id} turn {largest.turn}"
    if replayer.cache_tokens is not None:
        given, fix = f"--cache-tokens {replayer.cache_tokens:,}", f"--cache-tokens {need}"
    else:
        given = f"--cache-memory {replayer.cache_memory:,} bytes ({capacity:,} tokens)"
        fix = f"--cache-memory {need * replayer.bytes_per_token}"
    raise CapacityError(
        f"{given} is too small for this input: {where} holds {len(largest.prompt) + len(largest.answer):,} tokens "
        f"at once ({need // bs:,} blocks of {bs}); the whole input replays with {fix} or more"
    )


def _bound_progress(progress: Progress, description: str, total: int) -> Callable[[Iterable], Iterable]:
    return lambda items: progress(items, description, total, "req")
