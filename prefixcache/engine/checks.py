"""Request checks: what every request passes exactly once, at submit, before the engine takes it; and the model
fingerprint that names the namespaces it is served in.

:class:`RequestChecks` is the one place that validates a request (token ids, sampling, capacity, namespace,
retention, request id, callback) and that watches the model's weights: every caller of the engine (the serial calls
of :class:`~prefixcache.engine.runner.PrefixCachingRunner`, :class:`~prefixcache.engine.batching.BatchEngine`, the
server) submits through :meth:`RequestChecks.request`, and the engine core asks :meth:`RequestChecks.namespace_key`
for the tree namespace at every admission, after :meth:`RequestChecks.refresh_weights`.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable
from typing import Any

import xxhash

from prefixcache.cache.pool import KVBlockPool
from prefixcache.cache.radix_cache import check_namespace
from prefixcache.cache.retention import check_retain
from prefixcache.cache.stats import check_request_id
from prefixcache.cache.tokens import TokenIds, as_token_array
from prefixcache.engine.request import EngineRequest, RequestHandle
from prefixcache.engine.results import TokenLogprob
from prefixcache.engine.sampling import SamplingParams
from prefixcache.errors import CapacityError, InvalidArgumentError, InvalidTokensError
from prefixcache.models.base import CausalLM

__all__ = ["RequestChecks", "check_retention"]


class RequestChecks:
    """Validates requests for one model, tokenizer (by name) and pool, and keeps the fingerprint of their namespaces.

    Weight changes.  A model may offer ``weights_version()``: an int that moves whenever a weight changes (ours and
    the Hugging Face adapter sum torch's per-tensor version counters).  :meth:`refresh_weights` reads it, O(parameters)
    integer reads; when it moved, :attr:`fingerprint` changes, so nothing cached with the old weights is ever served.
    :meth:`invalidate` moves it for changes no counter sees.  Thread-safe.
    """

    def __init__(self, model: CausalLM, tokenizer_name: str, pool: KVBlockPool) -> None:
        self.model = model
        self.tokenizer_name = tokenizer_name
        self.pool = pool
        self._epoch = 0
        # One thread at a time checks the weights and moves the fingerprint: a second one must not find the new
        # version stored and go on with the fingerprint of the old weights while the first computes the new one.
        self._weights_lock = threading.Lock()
        self._weights_version = self._read_weights_version()
        self.fingerprint = self._make_fingerprint()
        """Hex xxhash of the model's fingerprint, the tokenizer's name and the invalidation epoch."""

    def request(
        self,
        prompt_ids: TokenIds,
        sampling: SamplingParams | None = None,
        *,
        namespace: str | None = None,
        forced_tokens: TokenIds | None = None,
        return_logits: bool = False,
        recompute_prompt: bool = False,
        request_id: str | None = None,
        priority: int | None = None,
        retain_s: float | None = None,
        on_token: Callable[[int], Any] | None = None,
        on_logprob: Callable[[TokenLogprob], Any] | None = None,
    ) -> EngineRequest:
        """Check a request and make the engine's record of it (not yet queued).  ``forced_tokens`` (teacher forcing)
        replace sampling: the request computes them after its prompt and ends with finish reason ``"forced"``;
        ``return_logits`` asks for the float32 logits of the prompt positions it prefills; ``recompute_prompt``
        matches nothing in the cache, so that it prefills (and, with ``return_logits``, returns the logits of) every
        prompt position, its prompt still cached for later requests (``echo`` with prompt logprobs).  ``on_token`` and
        ``on_logprob`` are the engine's callbacks (see :meth:`~prefixcache.engine.batching.BatchEngine.submit`).

        Raises:
            InvalidTokensError: prompt empty, not integers, or ids outside the model's vocabulary (forced tokens too,
                which may be empty).
            CapacityError: prompt + new tokens exceed the model's positions or the whole pool.
            NamespaceError: a namespace that is not a str or None.
            InvalidArgumentError: ``sampling`` not SamplingParams or with a ``logit_bias`` id outside the model's
                vocabulary, ``on_token`` or ``on_logprob`` not callable, ``request_id`` not a str or None, bad
                retention (see :func:`check_retention`).
        """
        sampling = sampling if sampling is not None else SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise InvalidArgumentError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        for name, callback in (("on_token", on_token), ("on_logprob", on_logprob)):
            if callback is not None and not callable(callback):
                raise InvalidArgumentError(f"{name} must be callable or None, got {type(callback).__name__}")
        if sampling.logit_bias and sampling.logit_bias[-1][0] >= self.model.vocab_size:
            raise InvalidArgumentError(
                f"logit_bias: token id {sampling.logit_bias[-1][0]} is outside the model's vocabulary; allowed ids "
                f"are 0 .. {self.model.vocab_size - 1}"
            )
        check_request_id(request_id)
        if forced_tokens is None and isinstance(prompt_ids, (list, tuple, array)):
            # A prompt too long for the model is refused in O(1), before its ids are converted in O(n): a C loop that
            # holds the GIL (~1 s for 30M ids) and so stalls every other thread, a server's event loop included.
            self.capacity(len(prompt_ids) + sampling.max_new_tokens)
        prompt = self.tokens(prompt_ids, "prompt")
        forced = None if forced_tokens is None else self.tokens(forced_tokens, "forced_tokens", allow_empty=True)
        retention = check_retention(priority, retain_s)
        num_new = len(forced) if forced is not None else sampling.max_new_tokens
        self.capacity(len(prompt) + num_new)
        check_namespace(namespace)
        prompt = array("I", prompt)  # the engine's own copy: the caller may reuse its array
        return EngineRequest(
            prompt=prompt.tolist(),
            prompt_array=prompt,
            sampling=sampling,
            user_namespace=namespace,
            handle=RequestHandle(),
            forced=None if forced is None else forced.tolist(),
            return_logits=bool(return_logits),
            recompute_prompt=bool(recompute_prompt),
            request_id=request_id,
            retention=retention,
            on_token=on_token,
            on_logprob=on_logprob,
        )

    def tokens(self, token_ids: TokenIds, what: str, *, allow_empty: bool = False) -> array:
        """``token_ids`` as the cache stores them (``array('I')``), every id below the model's ``vocab_size``.
        Raises InvalidTokensError naming ``what``."""
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

    def capacity(self, num_tokens: int) -> None:
        """Raises CapacityError when a request of ``num_tokens`` (prompt + new) exceeds the model's positions or the
        whole pool (it could never run, whatever is evicted)."""
        if num_tokens > self.model.max_position:
            raise CapacityError(
                f"prompt + new tokens = {num_tokens} tokens exceed the model's maximum of "
                f"{self.model.max_position} positions"
            )
        pool = self.pool
        if pool.blocks_for_tokens(num_tokens) > pool.num_blocks:
            raise CapacityError(
                f"prompt + new tokens = {num_tokens} tokens exceed the pool's capacity of "
                f"{pool.capacity_tokens} tokens ({pool.num_blocks} blocks of {pool.block_size})"
            )

    def namespace_key(self, namespace: str | None) -> str:
        """The tree namespace for a user namespace: the fingerprint plus the cache salt.  Raises NamespaceError."""
        namespace = check_namespace(namespace)
        return f"{self.fingerprint}:" + ("-" if namespace is None else "=" + namespace)

    def refresh_weights(self) -> None:
        """Move :attr:`fingerprint` if the model's ``weights_version()`` moved since the last call."""
        with self._weights_lock:
            version = self._read_weights_version()
            if version != self._weights_version:
                self._new_epoch()
                self._weights_version = version

    def invalidate(self) -> None:
        """Move :attr:`fingerprint` unconditionally (a weight change no version counter sees)."""
        with self._weights_lock:
            self._new_epoch()

    def _new_epoch(self) -> None:
        self._epoch += 1
        self.fingerprint = self._make_fingerprint()

    def _read_weights_version(self) -> int | None:
        read = getattr(self.model, "weights_version", None)
        return None if read is None else read()

    def _make_fingerprint(self) -> str:
        key = f"{self.model.fingerprint()}|{self.tokenizer_name}"
        if self._epoch:
            key += f"|epoch {self._epoch}"
        return xxhash.xxh64(key.encode()).hexdigest()


def check_retention(priority: int | None, retain_s: float | None) -> tuple[int, float | None] | None:
    """``(priority, retain_s)`` checked, or None without a priority.  Raises InvalidArgumentError: ``retain_s``
    without a priority, a priority that is not an int in 1..2**63 - 1, a ``retain_s`` that is not a positive number of
    seconds (NaN included)."""
    if priority is None:
        if retain_s is not None:
            raise InvalidArgumentError("retain_s needs a priority")
        return None
    check_retain(priority, retain_s)
    return priority, retain_s
