"""The runner: serve requests through the prefix cache, prefilling only what is not cached.

Per request: match the longest cached prefix (at most ``len - 1`` tokens: the last prompt token is always computed,
its logits start decoding), lock it, copy the rows of a partially matched block into a private block, allocate
blocks for the rest (evicting unreferenced leaves), prefill the remaining tokens at positions continuing from the
cached length, decode, insert prompt + generated tokens into the tree so the next turn reuses them, unlock.
Whatever goes wrong midway (model error, out of blocks, ``KeyboardInterrupt``, a closed stream) releases every
lock and block the request took, and nothing it half-wrote is ever cached.

This is the flow of SGLang's and vLLM's schedulers for one request, without batching: the point here is exact
reuse and its accounting, in-process.

Concurrency: the cache's own mutex serializes tree and pool bookkeeping (match, lock, allocate, insert); the
model's forward passes run outside it, each on blocks its request owns privately, so requests on different
threads compute in parallel and only wait for each other during bookkeeping.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from prefixcache.cache.host_tier import host_pool_for
from prefixcache.cache.pool import KVBlockPool
from prefixcache.cache.radix_cache import InsertResult, Lease, RadixCache, check_namespace
from prefixcache.cache.snapshot import SnapshotSummary
from prefixcache.cache.tokens import TokenIds, as_token_array
from prefixcache.chat.tokenizer import ByteTokenizer, Tokenizer
from prefixcache.engine.sampling import SamplingParams, sample_token, sampling_generator
from prefixcache.errors import CapacityError, InvalidArgumentError, InvalidTokensError
from prefixcache.models.base import CausalLM, LiveKV

DEFAULT_CACHE_TOKENS = 1 << 16


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting and timing of one request.

    ``cached_tokens`` counts every prompt token whose KV was reused, shared or copied (``copied_tokens`` is the
    copied part), so ``cached_tokens + prefilled_tokens == prompt_tokens``.  ``ttft_s`` is the prefill time up to
    the first token's logits; ``decode_s`` the time after it (decode steps, or the teacher-forced tokens).
    ``host_cached_tokens`` of the cached tokens were promoted from the host-memory tier (0 without one); the rest
    were on the device.
    """

    prompt_tokens: int
    cached_tokens: int
    prefilled_tokens: int
    copied_tokens: int
    generated_tokens: int
    ttft_s: float
    decode_s: float
    host_cached_tokens: int = 0

    def to_openai(self) -> dict[str, Any]:
        """OpenAI-style usage: ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and
        ``prompt_tokens_details.cached_tokens``, plus our extra counts."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.generated_tokens,
            "total_tokens": self.prompt_tokens + self.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "prefilled_tokens": self.prefilled_tokens,
            "copied_tokens": self.copied_tokens,
            "host_cached_tokens": self.host_cached_tokens,
            "ttft_s": self.ttft_s,
            "decode_s": self.decode_s,
        }


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """Output of one request: the new token ids, why it stopped (``"stop"``, ``"length"``, ``"forced"`` for
    teacher forcing, ``"prefill"`` when nothing was generated), usage, and, when asked for, the float32 logits of
    the prefilled prompt positions (``[prefilled_tokens, vocab_size]``, on the CPU)."""

    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    prompt_logits: torch.Tensor | None = None
    insert: InsertResult | None = None


@dataclass(frozen=True, slots=True)
class ChatResult:
    """Output of :meth:`PrefixCachingRunner.chat`: decoded text (stop tokens and strings removed), token ids, finish
    reason (``"tool_calls"`` when calls were parsed), usage, and the OpenAI ``tool_calls``."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    tool_calls: tuple[dict[str, Any], ...] = ()


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
    (:mod:`prefixcache.cache.host_tier`): evicted blocks move there and come back when a prompt matches them.

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
        self.cache = RadixCache(
            self.pool,
            policy,
            eviction_granularity=eviction_granularity,
            max_retained_fraction=max_retained_fraction,
            host_pool=host_pool_for(self.pool, host_cache_tokens, host_cache_memory),
        )
        self._epoch = 0
        # One thread at a time checks the weights and moves the fingerprint: a second one must not find the new
        # version stored and go on with the fingerprint of the old weights while the first computes the new one.
        self._weights_lock = threading.Lock()
        self._weights_version = self._read_weights_version()
        self.fingerprint = self._make_fingerprint()

    # ---- public API ----------------------------------------------------------------------------------------

    def invalidate(self) -> None:
        """Never serve anything cached so far: the next request starts a new namespace fingerprint.  For weight
        changes that ``weights_version`` cannot see; the old entries age out of the pool through eviction.  Also
        drops the model's packed weight copies (``model.drop_weight_copies()`` where it has one: batched decode on
        the CPU), which follow the same version counters."""
        drop = getattr(self.model, "drop_weight_copies", None)
        if drop is not None:
            drop()
        with self._weights_lock:
            self._new_epoch()

    def _new_epoch(self) -> None:
        self._epoch += 1
        self.fingerprint = self._make_fingerprint()

    def namespace_key(self, namespace: str | None) -> str:
        """The tree namespace for a user namespace: the model/tokenizer fingerprint plus the cache salt."""
        namespace = check_namespace(namespace)
        return f"{self.fingerprint}:" + ("-" if namespace is None else "=" + namespace)

    def save_snapshot(self, directory: str | os.PathLike[str]) -> SnapshotSummary:
        """Save what is cached for this model and tokenizer (every namespace under the current fingerprint) into the
        snapshot folder ``directory``, with the model and tokenizer fingerprints (see :meth:`RadixCache.save`: atomic,
        changes nothing in the cache).  Call it between requests' model steps (the server saves on its engine thread).

        Raises:
            SnapshotWriteError: a write failed (also an OSError); the previous snapshot stays current.
            SnapshotError: safetensors is missing.
        """
        self._check_weights()
        prefix = f"{self.fingerprint}:"
        return self.cache.save(
            directory,
            identity=self._snapshot_identity(),
            keep_namespace=lambda namespace: namespace is not None and namespace.startswith(prefix),
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
        self._check_weights()
        return self.cache.restore(directory, identity=self._snapshot_identity(), replace=True)

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
    ) -> GenerationResult:
        """Serve one request: prefill the uncached part of ``prompt_ids``, then decode.

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
    ) -> Generator[int, None, GenerationResult]:
        """Like :meth:`generate`, yielding each new token id as it is produced; the generator's return value
        (``StopIteration.value``) is the :class:`GenerationResult`.  Closing the generator early, or an exception
        from ``on_token``, releases everything the request holds and caches nothing of it.  Sending ``"stop"``
        (``steps.send("stop")``) after a decoded token ends generation there as a stop token would (finish reason
        ``"stop"``, the token's K/V not computed) and caches the prompt and the tokens before it: that is how a
        string stop sequence, matched on decoded text, ends a request."""
        sampling = sampling if sampling is not None else SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise InvalidArgumentError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        prompt = self._check_tokens(prompt_ids, "prompt")
        forced = (
            self._check_tokens(forced_tokens, "forced_tokens", allow_empty=True) if forced_tokens is not None else None
        )
        num_new = len(forced) if forced is not None else sampling.max_new_tokens
        retention = check_retention(priority, retain_s)
        self._check_capacity(len(prompt) + num_new)
        self._check_weights()
        namespace = self.namespace_key(namespace)
        return self._steps(prompt, sampling, namespace, forced, return_logits, on_token, request_id, retention)

    def generate_many(
        self,
        prompts: Sequence[TokenIds],
        sampling: SamplingParams | None = None,
        *,
        namespace: str | None = None,
        max_batch_tokens: int = 512,
    ) -> list[GenerationResult]:
        """Serve ``prompts`` together with continuous batching (see :class:`~prefixcache.engine.batching.BatchEngine`):
        one batched forward per step, prefill chunked under ``max_batch_tokens``.  Results are in prompt order; each
        equals what :meth:`generate` returns for that prompt alone (greedy tokens; logits within float rounding).
        Raises as :meth:`generate`, for the first prompt that fails."""
        from prefixcache.engine.batching import BatchEngine

        engine = BatchEngine(self, max_batch_tokens=max_batch_tokens)
        handles = [engine.submit(prompt, sampling, namespace=namespace) for prompt in prompts]
        engine.run_until_idle()
        return [handle.result() for handle in handles]

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
        from prefixcache.engine.chat import complete_chat

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
        return ChatResult(done.content or "", done.token_ids, done.finish_reason, done.usage, done.tool_calls)

    # ---- internals -----------------------------------------------------------------------------------------

    def _check_tokens(self, token_ids: TokenIds, what: str, *, allow_empty: bool = False):
        try:
            ids = as_token_array(token_ids, allow_empty=allow_empty)
        except InvalidTokensError as error:
            raise InvalidTokensError(f"{what}: {error}") from None
        if len(ids) and max(ids) >= self.model.vocab_size:
            raise InvalidTokensError(
                f"{what}: token id {max(ids)} is outside the model's vocabulary; allowed ids are "
                f"0 .. {self.model.vocab_size - 1}"
            )
        return ids

    def _read_weights_version(self) -> int | None:
        read = getattr(self.model, "weights_version", None)
        return None if read is None else read()

    def _check_weights(self) -> None:
        with self._weights_lock:
            version = self._read_weights_version()
            if version != self._weights_version:
                self._new_epoch()  # the packed copies see what weights_version sees
                self._weights_version = version

    def _make_fingerprint(self) -> str:
        key = f"{self.model.fingerprint()}|{self.tokenizer.name}"
        if self._epoch:
            key += f"|epoch {self._epoch}"
        return xxhash.xxh64(key.encode()).hexdigest()

    def _check_capacity(self, num_tokens: int) -> None:
        if num_tokens > self.model.max_position:
            raise CapacityError(
                f"prompt + new tokens = {num_tokens} tokens exceed the model's maximum of "
                f"{self.model.max_position} positions"
            )
        if self.pool.blocks_for_tokens(num_tokens) > self.pool.num_blocks:
            raise CapacityError(
                f"prompt + new tokens = {num_tokens} tokens exceed the pool's capacity of "
                f"{self.pool.capacity_tokens} tokens ({self.pool.num_blocks} blocks of {self.pool.block_size})"
            )

    def _steps(
        self,
        prompt,
        sampling: SamplingParams,
        namespace: str,
        forced,
        return_logits: bool,
        on_token: Callable[[int], None] | None,
        request_id: str | None,
        retention: tuple[int, float | None] | None = None,
    ) -> Generator[int, None, GenerationResult]:
        model, cache, pool = self.model, self.cache, self.pool
        device = model.device
        lease: Lease = cache.acquire(prompt, namespace, request_id=request_id, num_tokens=len(prompt))
        try:
            start = time.perf_counter()
            cached = lease.num_cached_tokens
            cache.reserve(lease, len(prompt))
            table = pool.block_table_tensor(lease.block_table)
            new_ids = torch.tensor(prompt[cached:], dtype=torch.long, device=device)
            # One live K/V for the request's lifetime: decode steps append to it instead of re-gathering the prefix.
            live = LiveKV(len(prompt) + (len(forced) if forced is not None else sampling.max_new_tokens))
            logits = model.forward_cached(new_ids, cached, pool.kv, table, return_logits=return_logits, live=live)
            last = logits[-1]
            generator = sampling_generator(sampling, device)
            if forced is None and sampling.max_new_tokens:
                token = sample_token(last, sampling, generator)
            else:
                _synchronize(device)
                token = None
            ttft = time.perf_counter() - start
            prompt_logits = logits.float().cpu() if return_logits else None
            generated: list[int] = []
            committed = list(prompt)
            decode_start = time.perf_counter()
            if forced is not None:
                finish = "forced"
                if len(forced):
                    cache.reserve(lease, len(prompt) + len(forced))
                    table = pool.block_table_tensor(lease.block_table)
                    forced_ids = torch.tensor(forced, dtype=torch.long, device=device)
                    model.forward_cached(forced_ids, len(prompt), pool.kv, table, live=live)
                    _synchronize(device)
                    generated = list(forced)
                    committed.extend(generated)
                    for t in generated:
                        if on_token is not None:
                            on_token(t)
                        yield t
            elif token is None:
                finish = "prefill"
            else:
                finish = "length"
                position = len(prompt)
                while True:
                    generated.append(token)
                    if on_token is not None:
                        on_token(token)
                    command = yield token
                    if command == "stop" or token in sampling.stop_token_ids:
                        finish = "stop"
                        break
                    if len(generated) >= sampling.max_new_tokens:
                        break
                    if position + 1 > lease.capacity_tokens:
                        cache.reserve(lease, position + 1)
                        table = pool.block_table_tensor(lease.block_table)
                    step = torch.tensor([token], dtype=torch.long, device=device)
                    last = model.forward_cached(step, position, pool.kv, table, live=live)[-1]
                    committed.append(token)
                    position += 1
                    token = sample_token(last, sampling, generator)
            decode = time.perf_counter() - decode_start
            insert = cache.commit(lease, committed)
        except BaseException:
            if not lease.closed:
                cache.release(lease)
            raise
        if retention is not None:
            cache.retain(prompt, namespace, priority=retention[0], retain_s=retention[1])
        usage = Usage(
            prompt_tokens=len(prompt),
            cached_tokens=cached,
            prefilled_tokens=len(prompt) - cached,
            copied_tokens=lease.num_copied_tokens,
            generated_tokens=len(generated),
            ttft_s=ttft,
            decode_s=decode,
            host_cached_tokens=lease.num_host_tokens,
        )
        return GenerationResult(tuple(generated), finish, usage, prompt_logits, insert)


def check_retention(priority: int | None, retain_s: float | None) -> tuple[int, float | None] | None:
    """``(priority, retain_s)`` checked for :meth:`PrefixCachingRunner.stream` and the batching engine's submit, or
    None without a priority.  Raises InvalidArgumentError: ``retain_s`` without a priority, a priority that is not a
    positive int, a ``retain_s`` that is not a positive number of seconds (NaN included)."""
    if priority is None:
        if retain_s is not None:
            raise InvalidArgumentError("retain_s needs a priority")
        return None
    if isinstance(priority, bool) or not isinstance(priority, int) or priority < 1:
        raise InvalidArgumentError(f"priority must be a positive int, got {priority!r}")
    if retain_s is not None and (
        isinstance(retain_s, bool) or not isinstance(retain_s, (int, float)) or not retain_s > 0  # NaN too
    ):
        raise InvalidArgumentError(f"retain_s must be a positive number of seconds, got {retain_s!r}")
    return priority, retain_s


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
