"""Helpers for testing code that drives a prefix cache, a module per job; every name is importable from here.

- :mod:`~prefixcache.testing.faults`: :class:`FaultyModel` raises on a chosen ``forward_cached`` call (optionally
  scribbling over the K/V it wrote), :func:`fail_on_call` makes any method raise on its k-th call.
- :mod:`~prefixcache.testing.cache_state`: :func:`snapshot` records what a rejected call must not change,
  :func:`assert_quiescent` checks a cache no request is using.
- :mod:`~prefixcache.testing.reference`: :func:`greedy_reference`, the uncached oracle.
- :mod:`~prefixcache.testing.models`: :class:`ScriptedModel` (greedy output that follows a script, read back from the
  pool) and :class:`ShiftedLogits` (logits a verification must reject).
- :mod:`~prefixcache.testing.runners`: :func:`tiny_runner`, the same runner in a test and in an engine process.
- :mod:`~prefixcache.testing.extras`: :func:`require_extra` and :func:`require_smollm2` skip a test module without
  its optional dependency, except in CI.
"""

from __future__ import annotations

from prefixcache.testing.cache_state import CacheSnapshot, assert_engine_quiescent, assert_quiescent, snapshot
from prefixcache.testing.extras import require_extra, require_smollm2
from prefixcache.testing.faults import FaultyModel, InjectedFault, fail_on_call
from prefixcache.testing.models import ScriptedModel, ShiftedLogits
from prefixcache.testing.reference import greedy_reference
from prefixcache.testing.runners import tiny_runner

__all__ = [
    "CacheSnapshot",
    "FaultyModel",
    "InjectedFault",
    "ScriptedModel",
    "ShiftedLogits",
    "assert_engine_quiescent",
    "assert_quiescent",
    "fail_on_call",
    "greedy_reference",
    "require_extra",
    "require_smollm2",
    "snapshot",
    "tiny_runner",
]
