"""Which option combinations a replay accepts, checked before a model is loaded (the CLI calls it first)."""

from __future__ import annotations

from prefixcache.cache.resume import DEFAULT_STATE_INTERVAL_BLOCKS
from prefixcache.errors import InvalidArgumentError

__all__ = ["check_options"]


def check_options(
    *,
    has_model: bool,
    cache_memory: int | None,
    verify: bool,
    host_cache_memory: int | None = None,
    state_bytes: int | None = None,
    state_every: int = DEFAULT_STATE_INTERVAL_BLOCKS,
    max_state_bytes: int | None = None,
    host_tier: bool = False,
) -> None:
    """Refuse option combinations that need a model (or, for recurrent-state modelling, none), before one is loaded.

    Raises:
        InvalidArgumentError: ``cache_memory``, ``host_cache_memory`` or ``verify`` without a model;
            ``state_bytes`` with a model or a host tier, or not a non-negative int; ``state_every`` or
            ``max_state_bytes`` without ``state_bytes``, or negative.
    """
    if state_bytes is None:
        if state_every != DEFAULT_STATE_INTERVAL_BLOCKS:
            raise InvalidArgumentError("--state-every needs --state-bytes (recurrent-state modelling)")
        if max_state_bytes is not None:
            raise InvalidArgumentError("--max-state-bytes needs --state-bytes (recurrent-state modelling)")
    else:
        if has_model:
            raise InvalidArgumentError("--state-bytes models a recurrent model's cache without one: add --no-model")
        if host_tier:
            raise InvalidArgumentError("--state-bytes cannot be combined with a host tier (host blocks keep no state)")
        for name, value in (("--state-bytes", state_bytes), ("--max-state-bytes", max_state_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise InvalidArgumentError(f"{name} must be a non-negative number of bytes, got {value!r}")
        if isinstance(state_every, bool) or not isinstance(state_every, int) or state_every < 0:
            raise InvalidArgumentError(f"--state-every must be a non-negative number of blocks, got {state_every!r}")
    if not has_model and cache_memory is not None:
        raise InvalidArgumentError("--cache-memory needs a model (bytes per token); use --cache-tokens")
    if not has_model and host_cache_memory is not None:
        raise InvalidArgumentError("--host-cache-memory needs a model (bytes per token); use --host-cache-tokens")
    if not has_model and verify:
        raise InvalidArgumentError("--verify needs a model; drop --no-model")
