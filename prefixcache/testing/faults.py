"""Fault injection: a model that fails on a chosen call, and any method made to fail on its k-th call.

:class:`FaultyModel` wraps any :class:`~prefixcache.models.base.CausalLM` and raises on a chosen ``forward_cached``
call (the first call of a request is its prefill, later ones its decode steps), optionally after scribbling garbage
over the K/V slots that call was allowed to write, so that a test can tell whether a half-written block was ever
reused.  :func:`fail_on_call` makes any method of an object raise on its k-th call (``cache._blocks.allocate`` to run
the pool dry at a chosen allocation, ``cache._blocks.insert`` to fail an insert).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from prefixcache.models.base import CausalLM

__all__ = ["GARBAGE", "FaultyModel", "InjectedFault", "fail_on_call"]

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
