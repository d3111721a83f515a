"""The runner: the cache, pool and model of one deployment, and the serial calls on them.

:class:`PrefixCachingRunner` owns the block pool, the radix cache and the request checks (the model and tokenizer
fingerprint).  Its calls (:meth:`~PrefixCachingRunner.generate`, :meth:`~PrefixCachingRunner.stream`,
:meth:`~PrefixCachingRunner.prefill`, teacher-forced replay, :meth:`~PrefixCachingRunner.chat`) each drive an
:class:`~prefixcache.engine.core.EngineCore` holding that one request, synchronously in the calling thread, as vLLM's
offline ``LLM`` drives the engine core its server also runs; :meth:`~PrefixCachingRunner.generate_many` drives one
with many.  So prefill, decode, stopping and the result are the core's, whichever way a request comes.

Concurrency: the cache's own mutex serializes tree and pool bookkeeping (match, lock, allocate, insert); each call's
core runs its forward passes outside it, on blocks its request owns privately, so calls on different threads compute
in parallel and only wait for each other during bookkeeping.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import CancelledError
from typing import TYPE_CHECKING, Any

from prefixcache.cache.host import host_pool_for
from prefixcache.cache.pool import KVBlockPool
from prefixcache.cache.radix_cache import RadixCache
from prefixcache.cache.resume import DEFAULT_STATE_INTERVAL_BLOCKS
from prefixcache.cache.snapshot import Snapshot, SnapshotSummary
from prefixcache.cache.snapshot import writer as snapshot_write
from prefixcache.cache.snapshot.staging import StagingBuffer
from prefixcache.cache.tokens import TokenIds
from prefixcache.chat.tokenizer import ByteTokenizer, Tokenizer
from prefixcache.engine.chat import complete_chat
from prefixcache.engine.checks import RequestChecks
from prefixcache.engine.core import EngineCore
from prefixcache.engine.request import EngineRequest
from prefixcache.engine.results import ChatResult, GenerationResult, Usage
from prefixcache.engine.sampling import SamplingParams
from prefixcache.engine.speculation import TreeDrafts
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.base import CausalLM

if TYPE_CHECKING:
    from prefixcache.models.sources import ModelSource

__all__ = [
    "DEFAULT_CACHE_TOKENS",
    "ChatResult",
    "GenerationResult",
    "PrefixCachingRunner",
    "SamplingParams",
    "Usage",
    "load_pretrained",
]

DEFAULT_CACHE_TOKENS = 1 << 16

_DRAFTS_LOCK = threading.Lock()

MIN_STATES = 256
"""Recurrent-state snapshots the default state budget holds at least (:func:`state_budget`): a model whose pool holds
little or no K/V (Mamba-2's is a placeholder) would otherwise keep too few to resume a chat's turns."""


def state_budget(model: CausalLM, pool: KVBlockPool, state_cache_memory: int | None) -> int:
    """Bytes the cache may spend on a recurrent model's state snapshots: ``state_cache_memory`` when given, else a
    quarter of the KV pool's bytes and at least ``MIN_STATES`` (256) snapshots of ``model.state_bytes`` each (37.7 MiB
    each for Qwen3-Next-80B in bf16: 9.4 GiB; give ``state_cache_memory`` to bound it).  SGLang sizes
    its Mamba state pool apart from the KV pool the same way.  Raises InvalidArgumentError for a size that is not a
    positive int."""
    if state_cache_memory is not None:
        if isinstance(state_cache_memory, bool) or not isinstance(state_cache_memory, int) or state_cache_memory < 1:
            raise InvalidArgumentError(f"state_cache_memory must be a positive int (bytes), got {state_cache_memory!r}")
        return state_cache_memory
    return max(pool.nbytes // 4, MIN_STATES * int(getattr(model, "state_bytes", 0)), 1)


def load_pretrained(
    source: ModelSource,
    *,
    dtype: Any = "auto",
    device: Any = None,
    tokenizer: str | os.PathLike[str] | None = None,
    quantize: str | None = "none",
) -> tuple[CausalLM, Tokenizer | None]:
    """The model of a resolved ``source`` and its tokenizer: ``tokenizer`` (a folder or ``.gguf``) when given, else the
    model's own (:attr:`ModelSource.tokenizer <prefixcache.models.sources.ModelSource.tokenizer>`), else None (the byte
    tokenizer); ``quantize`` as :func:`~prefixcache.models.loading.load_model`'s.  Both are read in one
    :func:`~prefixcache.models.loading.loading` context (a GGUF's header parsed once), the model first, so that a bad
    file is named as a model.  The one loading path of
    :meth:`PrefixCachingRunner.from_model` and ``prefixcache serve``.  Raises as
    :func:`~prefixcache.models.loading.load_source` and :class:`~prefixcache.chat.hf_tokenizer.HFTokenizer`."""
    from prefixcache.models.loading import load_source, loading

    chosen = tokenizer if tokenizer is not None else source.tokenizer
    with loading(source):
        model = load_source(source, dtype, device, quantize)
        if chosen is None:
            return model, None
        from prefixcache.chat.hf_tokenizer import HFTokenizer

        return model, HFTokenizer(chosen)


class PrefixCachingRunner:
    """Runs a :class:`~prefixcache.models.base.CausalLM` through a :class:`~prefixcache.cache.radix_cache.RadixCache`.

    The pool is sized by exactly one of ``num_blocks``, ``cache_tokens`` (rounded up to whole blocks) or
    ``cache_memory`` (bytes); with none, it holds ``DEFAULT_CACHE_TOKENS`` tokens.  It lives on the model's device
    in the model's dtype.  Every namespace is salted with a fingerprint of the model and tokenizer (xxhash), so a
    cache is never reused across a model or tokenizer change.

    Weight changes.  A model may offer ``weights_version()``: an int that moves whenever a weight changes (ours and
    the Hugging Face adapter sum torch's per-tensor version counters, which every in-place write, ``load_state_dict``
    and merged adapter bumps).  It is read at each admission, O(parameters) integer reads; when it moved, the
    fingerprint changes, so nothing cached with the old weights is ever served.  :meth:`invalidate` does the same for
    changes no counter sees (``tensor.data`` writes, a swapped module).

    ``eviction_granularity`` and ``max_retained_fraction`` are passed to the :class:`RadixCache`.  With
    ``host_cache_tokens`` or ``host_cache_memory`` (bytes) the cache gets a host-memory tier of that size
    (:mod:`prefixcache.cache.host`): evicted blocks move there and come back when a prompt matches them.

    A model with recurrent layers (``model.recurrent``: Qwen3-Next, Nemotron-H, Granite-4.0-H, MiniMax, Mamba-2 through
    :class:`~prefixcache.models.hf.HFCausalLM`) gets a cache that also keeps state snapshots at the end of every prompt
    and answer, before every prompt's last token and every ``state_interval_blocks`` blocks of a prompt (0: not inside
    prompts) (``RadixCache(resume_states=True)``), within ``state_cache_memory`` bytes (:func:`state_budget`: by default
    a quarter of the pool, at least 256 snapshots); a prompt resumes at the deepest kept snapshot of its match.

    Raises:
        InvalidArgumentError: more than one size given, or a bad size.
    """

    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer | None = None,
        *,
        num_blocks: int | None = None,
        cache_tokens: int | None = None,
        cache_memory: int | None = None,
        block_size: int = 16,
        policy: str = "lru",
        eviction_granularity: str = "block",
        max_retained_fraction: float = 0.5,
        host_cache_tokens: int | None = None,
        host_cache_memory: int | None = None,
        state_cache_memory: int | None = None,
        state_interval_blocks: int = DEFAULT_STATE_INTERVAL_BLOCKS,
    ) -> None:
        if not isinstance(model, CausalLM):
            raise InvalidArgumentError(f"model must implement the CausalLM protocol, got {type(model).__name__}")
        self.model = model
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        if self.tokenizer.vocab_size > model.vocab_size:
            raise InvalidArgumentError(
                f"tokenizer vocabulary ({self.tokenizer.vocab_size}) exceeds the model's ({model.vocab_size})"
            )
        sizes = [s for s in (num_blocks, cache_tokens, cache_memory) if s is not None]
        if len(sizes) > 1:
            raise InvalidArgumentError("give at most one of num_blocks, cache_tokens, cache_memory")
        shape = {"num_layers": model.num_layers, "num_kv_heads": model.num_kv_heads, "head_dim": model.head_dim}
        if cache_memory is not None:
            self.pool = KVBlockPool.from_memory_budget(
                cache_memory, block_size, dtype=model.dtype, device=model.device, **shape
            )
        else:
            if num_blocks is None:
                tokens = DEFAULT_CACHE_TOKENS if cache_tokens is None else cache_tokens
                if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
                    raise InvalidArgumentError(f"cache_tokens must be a positive int, got {tokens!r}")
                num_blocks = -(-tokens // block_size) if isinstance(block_size, int) and block_size > 0 else 0
            self.pool = KVBlockPool(num_blocks, block_size, dtype=model.dtype, device=model.device, **shape)
        recurrent = bool(getattr(model, "recurrent", False))
        self.cache = RadixCache(
            self.pool,
            policy,
            eviction_granularity=eviction_granularity,
            max_retained_fraction=max_retained_fraction,
            host_pool=host_pool_for(self.pool, host_cache_tokens, host_cache_memory),
            resume_states=recurrent,
            max_state_bytes=state_budget(model, self.pool, state_cache_memory) if recurrent else None,
        )
        if isinstance(state_interval_blocks, bool) or not isinstance(state_interval_blocks, int):
            raise InvalidArgumentError(f"state_interval_blocks must be an int, got {state_interval_blocks!r}")
        if state_interval_blocks < 0:
            raise InvalidArgumentError(f"state_interval_blocks must be >= 0, got {state_interval_blocks}")
        self.state_interval = state_interval_blocks * block_size if recurrent else 0
        """Tokens between the state snapshots a recurrent model's prefill keeps inside a prompt (0: none)."""
        self.checks = RequestChecks(model, self.tokenizer.name, self.pool)
        """Every request's checks and the fingerprint of its namespaces (see :class:`RequestChecks`)."""
        self._tree_drafts: TreeDrafts | None = None

    # ---- public API ----------------------------------------------------------------------------------------

    @classmethod
    def from_model(
        cls,
        model: str | os.PathLike[str],
        *,
        dtype: Any = "auto",
        device: Any = None,
        tokenizer: str | os.PathLike[str] | None = None,
        quantize: str | None = "none",
        **options: Any,
    ) -> PrefixCachingRunner:
        """A runner over the model ``model`` names, with its own tokenizer and chat template: ``"smollm2"``, a
        ``.gguf`` file, a Hugging Face folder (``"hf:PATH"`` or ``PATH``) or an embedded preset
        (:func:`~prefixcache.models.loading.load_model`, whose ``dtype``, ``device`` and ``quantize`` these are:
        ``quantize="int8"`` or ``"int4"`` for weight-only quantized linear layers on the CPU); ``tokenizer`` (a
        folder or ``.gguf``) replaces the model's own, and a model without one gets the byte tokenizer.  ``options``
        are the constructor's (``cache_tokens``, ``block_size``, ...).  As vLLM's ``LLM(model=...)``.

        Raises InvalidArgumentError (unknown model, dtype or quantization, missing path, ``smollm2`` not installed, a
        missing extra) and UnsupportedModelError, as ``load_model``; the constructor's errors.
        """
        from prefixcache.models.sources import resolve_model

        loaded, loaded_tokenizer = load_pretrained(
            resolve_model(model), dtype=dtype, device=device, tokenizer=tokenizer, quantize=quantize
        )
        return cls(loaded, loaded_tokenizer, **options)

    def invalidate(self) -> None:
        """Never serve anything cached so far: the next request starts a new namespace fingerprint.  For weight
        changes that ``weights_version`` cannot see; the old entries age out of the pool through eviction.  Also
        drops the model's packed weight copies (``model.drop_weight_copies()`` where it has one: batched decode on
        the CPU), which follow the same version counters."""
        drop = getattr(self.model, "drop_weight_copies", None)
        if drop is not None:
            drop()
        self.checks.invalidate()

    @property
    def fingerprint(self) -> str:
        """Hex id of the model, tokenizer and invalidation epoch that salts every namespace (``checks.fingerprint``)."""
        return self.checks.fingerprint

    def namespace_key(self, namespace: str | None) -> str:
        """The tree namespace for a user namespace: the model/tokenizer fingerprint plus the cache salt."""
        return self.checks.namespace_key(namespace)

    def save_snapshot(self, directory: str | os.PathLike[str]) -> SnapshotSummary:
        """Save what is cached for this model and tokenizer (every namespace under the current fingerprint) into the
        snapshot folder ``directory``, with the model and tokenizer fingerprints (see :meth:`RadixCache.save`: atomic,
        changes nothing in the cache).  Call it between requests' model steps (the server saves on its engine thread).

        Raises:
            SnapshotWriteError: a write or sync failed (also an OSError); the previous snapshot is kept.
            SnapshotError: safetensors is missing.
        """
        return snapshot_write.write(self.capture_snapshot(), directory)

    def capture_snapshot(self, staging: StagingBuffer | None = None) -> Snapshot:
        """What :meth:`save_snapshot` writes, copied into host memory (into ``staging`` when given): the cache's
        :meth:`~prefixcache.cache.radix_cache.RadixCache.capture` of this fingerprint's namespaces, with the model and
        tokenizer fingerprints.  Call it between model steps; write it with
        :func:`~prefixcache.cache.snapshot.writer.write` on any thread.  O(cached tokens) plus a memcpy of the
        blocks."""
        self.checks.refresh_weights()
        prefix = f"{self.fingerprint}:"
        return self.cache.capture(
            identity=self._snapshot_identity(),
            keep_namespace=lambda namespace: namespace is not None and namespace.startswith(prefix),
            staging=staging,
        )

    def load_snapshot(self, directory: str | os.PathLike[str]) -> SnapshotSummary:
        """Replace what is cached with the snapshot in ``directory``, saved by :meth:`save_snapshot` for the same model
        weights and tokenizer (most recently used part first when the pool is smaller).  Returns what was loaded.
        The snapshot is read and verified before anything cached is dropped; on any error the cache is unchanged.

        Raises:
            SnapshotNotFoundError: no snapshot there.  SnapshotCorruptError: truncated, edited or damaged files.
            SnapshotMismatchError: another model or tokenizer fingerprint, KV dtype, block size or KV shape.
            SnapshotError: requests are running (they hold locks or blocks).
        """
        self.checks.refresh_weights()
        loader = self.model.load_state if getattr(self.model, "recurrent", False) else None
        return self.cache.restore(directory, identity=self._snapshot_identity(), replace=True, state_loader=loader)

    def _snapshot_identity(self) -> dict[str, str]:
        # The cache fingerprint adds invalidate()'s epoch: a snapshot saved after invalidate() names weights that no
        # fingerprint identifies, so it never loads into a fresh runner.
        return {
            "model_fingerprint": self.model.fingerprint(),
            "tokenizer": self.tokenizer.name,
            "cache_fingerprint": self.fingerprint,
        }

    def generate(
        self,
        prompt_ids: TokenIds,
        sampling: SamplingParams | None = None,
        *,
        namespace: str | None = None,
        forced_tokens: TokenIds | None = None,
        return_logits: bool = False,
        request_id: str | None = None,
        priority: int | None = None,
        retain_s: float | None = None,
        max_batch_tokens: int | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> GenerationResult:
        """Serve one request: prefill the uncached part of ``prompt_ids``, then decode.

        ``max_batch_tokens`` prefills (and computes a forced answer) in chunks of at most that many tokens, one
        forward each (None: in one forward); ``on_step(position)`` is called after every forward with the number of
        the request's tokens whose K/V are written (the cached prefix included), so a caller can show a long
        prefill's progress, and a Ctrl-C lands between chunks.

        With ``forced_tokens`` (teacher forcing, used by replay) those tokens are appended as the answer without
        sampling: their K/V are computed in one pass and cached with the prompt.  ``request_id`` names the request
        in the cache's stats: a retry that finds its own earlier tokens counts them as self-hits, not hits.
        ``priority`` (and ``retain_s``) retain the prompt once cached, as :meth:`prefill` does.

        Raises:
            InvalidTokensError: prompt empty, not integers, or ids outside the model's vocabulary.
            CapacityError: prompt + new tokens exceed the model's positions or the whole pool.
            PoolBusyError: free plus evictable blocks cannot cover the request because other requests hold the rest
                (nothing is evicted; counted in ``cache.stats().rejected_requests``).
            NamespaceError, InvalidArgumentError: bad namespace or sampling.
        Whatever is raised, the cache is left with no lock or block of this request.
        """
        steps = self.stream(
            prompt_ids,
            sampling,
            namespace=namespace,
            forced_tokens=forced_tokens,
            return_logits=return_logits,
            request_id=request_id,
            priority=priority,
            retain_s=retain_s,
            max_batch_tokens=max_batch_tokens,
            on_step=on_step,
        )
        try:
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    return done.value
        finally:
            # An exception landing here between steps (KeyboardInterrupt) would otherwise leave the generator
            # suspended, holding its blocks and locks for as long as the traceback keeps this frame alive.
            steps.close()

    def stream(
        self,
        prompt_ids: TokenIds,
        sampling: SamplingParams | None = None,
        *,
        namespace: str | None = None,
        forced_tokens: TokenIds | None = None,
        return_logits: bool = False,
        on_token: Callable[[int], None] | None = None,
        request_id: str | None = None,
        priority: int | None = None,
        retain_s: float | None = None,
        max_batch_tokens: int | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> Generator[int, None, GenerationResult]:
        """Like :meth:`generate`, yielding each new token id as it is produced; the generator's return value
        (``StopIteration.value``) is the :class:`GenerationResult`.  Closing the generator early, or an exception
        from ``on_token``, releases everything the request holds and caches nothing of it.  Sending ``"stop"``
        (``steps.send("stop")``) after a decoded token ends generation there as a stop token would (finish reason
        ``"stop"``, the token's K/V not computed) and caches the prompt and the tokens before it: that is how a
        string stop sequence, matched on decoded text, ends a request."""
        if on_token is not None and not callable(on_token):
            raise InvalidArgumentError(f"on_token must be callable or None, got {type(on_token).__name__}")
        request = self.checks.request(
            prompt_ids,
            sampling,
            namespace=namespace,
            forced_tokens=forced_tokens,
            return_logits=return_logits,
            request_id=request_id,
            priority=priority,
            retain_s=retain_s,
        )
        request.external_verdict = True
        core = self.new_core(max_batch_tokens=max_batch_tokens, policy="fcfs")
        return _drive(core, request, on_token, on_step)

    def new_core(self, **options: Any) -> EngineCore:
        """An :class:`~prefixcache.engine.core.EngineCore` on this runner's model, cache and checks (``options``:
        ``max_batch_tokens``, ``max_running``, ``policy``, ``max_wait_steps``, ``speculate``, ``drafts``); with
        ``speculate="tree"`` and no ``drafts``, the runner's :meth:`tree_drafts`.  Raises InvalidArgumentError for
        bad options."""
        options.setdefault("state_interval", self.state_interval)
        if options.get("speculate", "off") != "off" and options.get("drafts") is None:
            options["drafts"] = self.tree_drafts()
        return EngineCore(self.model, self.cache, self.checks, **options)

    def tree_drafts(self) -> TreeDrafts:
        """The runner's :class:`~prefixcache.engine.speculation.TreeDrafts` (speculative drafts from the request's
        context and this cache's blocks), made and subscribed to the cache's events on first use (O(cached tokens)
        once), then shared by every speculating core."""
        with _DRAFTS_LOCK:
            if self._tree_drafts is None:
                self._tree_drafts = TreeDrafts(self.cache)
            return self._tree_drafts

    def generate_many(
        self,
        prompts: Sequence[TokenIds],
        sampling: SamplingParams | None = None,
        *,
        namespace: str | None = None,
        max_batch_tokens: int = 512,
        speculate: str = "off",
    ) -> list[GenerationResult]:
        """Serve ``prompts`` together with continuous batching (see :class:`~prefixcache.engine.batching.BatchEngine`):
        one batched forward per step, prefill chunked under ``max_batch_tokens``.  Results are in prompt order; each
        equals what :meth:`generate` returns for that prompt alone (greedy tokens; logits within float rounding).
        ``speculate="tree"``: greedy requests verify drafts from their context and the cache
        (:mod:`prefixcache.engine.speculation`).  Raises as :meth:`generate`, for the first prompt that fails."""
        core = self.new_core(max_batch_tokens=max_batch_tokens, speculate=speculate)
        requests = [self.checks.request(prompt, sampling, namespace=namespace) for prompt in prompts]
        for request in requests:
            core.add(request)
        try:
            while core.step():
                pass
        finally:
            for request in core.take_all():  # a KeyboardInterrupt between steps leaves nothing locked
                core.abort(request, CancelledError())
        return [request.handle.result() for request in requests]

    def prefill(
        self,
        prompt_ids: TokenIds,
        *,
        namespace: str | None = None,
        priority: int | None = None,
        retain_s: float | None = None,
    ) -> Usage:
        """Compute and cache ``prompt_ids`` without generating (warm a shared system prompt).  With ``priority``
        the prompt is retained (:meth:`RadixCache.retain`): evicted only after everything of lower priority, or
        once ``retain_s`` seconds have passed.  Raises as :meth:`generate`."""
        params = SamplingParams(max_new_tokens=0)
        return self.generate(prompt_ids, params, namespace=namespace, priority=priority, retain_s=retain_s).usage

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        namespace: str | None = None,
        request_id: str | None = None,
        stop: str | Sequence[str] | None = None,
        tool_choice: Any = None,
        **sampling: Any,
    ) -> ChatResult:
        """Render OpenAI-format ``messages`` (and ``tools``) with the tokenizer's chat template, generate, and
        return the text.  ``sampling`` are :class:`SamplingParams` fields; the tokenizer's end-of-turn tokens
        stop generation unless ``stop_token_ids`` is given; ``stop`` strings end the text before them.  With
        ``tools``, ``<tool_call>`` blocks come back parsed in ``ChatResult.tool_calls`` (see
        :func:`prefixcache.engine.chat.chat_stream`, which also streams).  Raises TemplateError for bad messages,
        InvalidArgumentError for no messages, bad ``stop`` or ``tool_choice``, else as :meth:`generate`."""
        done = complete_chat(
            self,
            messages,
            tools,
            namespace=namespace,
            request_id=request_id,
            stop=stop,
            tool_choice=tool_choice,
            **sampling,
        )
        return ChatResult(
            done.content or "", done.token_ids, done.finish_reason, done.usage, done.tool_calls, done.logprobs
        )


def _drive(
    core: EngineCore,
    request: EngineRequest,
    on_token: Callable[[int], Any] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> Generator[int, Any, GenerationResult]:
    """Step ``core`` with ``request`` alone in it, yielding each token as the request produces it, ``on_token``
    called with it just before (its return value never stops the request), ``on_step(request.position)`` after each
    step that computed some of it; a ``"stop"`` sent after a sampled token
    is the request's verdict (:meth:`EngineCore.conclude`).  Closing the generator, or an exception thrown into it
    or raised by ``on_token``, releases everything the request holds and caches nothing of it."""
    core.add(request)
    seen = 0
    try:
        # Alone in its core, the request moves at every step (admitted or failed, then computed or waiting for
        # its verdict, which the loop gives), so the loop ends.
        while not request.handle.future.done():
            before = request.position
            core.step()
            if on_step is not None and request.position != before:
                on_step(request.position)
            if not request.awaiting_verdict:
                continue  # admitted, failed, or finished without a token to show
            command = None
            while seen < len(request.generated):
                token = request.generated[seen]
                seen += 1
                if on_token is not None:
                    # Here, not in the core: forced tokens come all at once, and the caller may close the
                    # stream before it sees the next one.
                    on_token(token)
                command = yield token
            core.conclude(request, stop=command == "stop")
    finally:
        if not request.handle.future.done():
            core.abort(request, CancelledError())  # closed, or an exception thrown in: nothing of it cached
    return request.handle.result()
