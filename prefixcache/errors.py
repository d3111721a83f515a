"""The exception hierarchy of prefixcache.

Every error the package raises on purpose derives from :class:`PrefixCacheError`, so an embedding framework
can catch one type.  Subclasses also derive from the closest built-in (``ValueError``, ``TypeError``,
``RuntimeError``) so generic handlers keep working.  An operation that raises one of these leaves the cache
as it was before the call: no leaked block, no half-inserted node, no lock left held.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any


class PrefixCacheError(Exception):
    """Base class of every error raised on purpose by prefixcache."""


class InvalidArgumentError(PrefixCacheError, ValueError):
    """A configuration value or call argument is out of its allowed range (block size, budget, sampling...)."""


class InvalidTokensError(PrefixCacheError, ValueError):
    """Token ids are not a non-empty 1-D sequence of non-negative integers below the allowed maximum."""


class NamespaceError(PrefixCacheError, TypeError):
    """A namespace (cache salt) is not ``None`` or a ``str``."""


class OutOfBlocksError(PrefixCacheError, RuntimeError):
    """The block pool cannot supply the blocks asked for, even after evicting every unlocked cached block."""


class CapacityError(OutOfBlocksError):
    """A request needs more blocks (or positions) than the pool or model can ever hold."""


class PoolBusyError(CapacityError):
    """The pool could hold the request, but not now: free plus evictable blocks fall short of what it needs because
    running requests lock or own the rest.  Raised before anything is evicted, so the cache is unchanged; a retry after
    other requests finish can succeed.

    The message and the attributes name the cause, in blocks: ``needed_blocks`` (what the allocation needs),
    ``free_blocks``, ``evictable_blocks``, ``locked_blocks`` (cached blocks locked by running requests' prefixes),
    ``owned_blocks`` (blocks running requests own) and ``pool_blocks``.
    """

    def __init__(
        self,
        needed_blocks: int,
        *,
        free_blocks: int,
        evictable_blocks: int,
        locked_blocks: int,
        owned_blocks: int,
        pool_blocks: int,
        what: str = "",
    ) -> None:
        super().__init__(
            f"{needed_blocks} blocks needed{' for ' + what if what else ''}, only {free_blocks + evictable_blocks} "
            f"can be had now ({free_blocks} free + {evictable_blocks} evictable) of the pool's {pool_blocks} blocks: "
            f"{locked_blocks} cached blocks locked by running requests, {owned_blocks} blocks owned by running "
            f"requests; nothing was evicted"
        )
        self.needed_blocks = needed_blocks
        self.free_blocks = free_blocks
        self.evictable_blocks = evictable_blocks
        self.locked_blocks = locked_blocks
        self.owned_blocks = owned_blocks
        self.pool_blocks = pool_blocks
        self.what = what

    def __reduce__(self) -> tuple[Any, ...]:
        # Its fields are keyword-only, which an exception's default pickling (its args) cannot give back: by name,
        # so that it reaches an engine process's server as itself (a 503, not a 500).
        fields = ("free_blocks", "evictable_blocks", "locked_blocks", "owned_blocks", "pool_blocks", "what")
        return functools.partial(type(self), **{name: getattr(self, name) for name in fields}), (self.needed_blocks,)


class LockError(PrefixCacheError, RuntimeError):
    """A lock handle or block reference was released twice, or used after release."""


class KVEventError(PrefixCacheError, AssertionError):
    """A KV event contradicts the mirror it is applied to (a strict :class:`~prefixcache.cache.events.BlockIndex`):
    a block stored twice, removed while not held, or the cache cleared while blocks are held.  The mirror is left
    as it was.  Also an ``AssertionError``: it means the events and the mirror went out of step."""


class ClosedError(PrefixCacheError, RuntimeError):
    """A KV event publisher was given an event after :meth:`close`; nothing will send it."""


class EngineDeadError(PrefixCacheError, RuntimeError):
    """The engine process (:class:`~prefixcache.engine.process.EngineProcess`) is gone (it exited or was killed, so
    the requests it held failed and no new one can run) or stopped answering.  A server answers 503."""


class SubscriberDeadError(PrefixCacheError, RuntimeError):
    """A KV event subscriber's thread stopped on an error, so its mirror no longer follows the publisher (the error
    that stopped it is the ``__cause__``)."""


class ScenarioError(PrefixCacheError, ValueError):
    """A scenario or trace file has a line that is not a valid conversation/request.

    ``path`` and ``line_no`` (1-based) say where; the message says what was wrong.
    """

    def __init__(self, message: str, path: str | None = None, line_no: int | None = None) -> None:
        where = f"{path}:{line_no}: " if path is not None and line_no is not None else (f"{path}: " if path else "")
        super().__init__(f"{where}{message}")
        self.path = path
        self.line_no = line_no


class TemplateError(PrefixCacheError, ValueError):
    """Chat messages cannot be rendered: unknown role, non-string content, malformed tools."""


class UnsupportedModelError(PrefixCacheError, ValueError):
    """A model architecture or feature (sliding window, recurrent state...) that prefix caching cannot serve exactly."""


class SnapshotError(PrefixCacheError, ValueError):
    """A cache snapshot (:mod:`prefixcache.cache.snapshot`) cannot be saved or loaded; the cache is left as it was."""


class SnapshotNotFoundError(SnapshotError, FileNotFoundError):
    """The folder holds no snapshot (yet): nothing to restore."""


class SnapshotCorruptError(SnapshotError):
    """A snapshot's files are truncated, edited or damaged: a checksum, a size or the format does not hold."""


class SnapshotMismatchError(SnapshotError):
    """A sound snapshot of something else: another model or tokenizer fingerprint, KV dtype, block size, KV shape or
    format version.  Loading it would serve K/V computed by another model, so it is refused."""


class SnapshotWriteError(SnapshotError, OSError):
    """Saving a snapshot failed on the file system (a write, fsync, folder or rename); the previous version stays
    current.  Also an ``OSError``: ``errno`` is the operating system's."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.args[0], self.errno)  # OSError's own pickling would drop errno


class EndpointError(PrefixCacheError, RuntimeError):
    """An endpoint audited by ``replay --endpoint`` cannot be reached, answers with an HTTP error, or answers in a
    shape that is not OpenAI's; the message names the URL and, for a request, where in the input it comes from."""


class VerificationError(PrefixCacheError, AssertionError):
    """Cached output differed from the uncached reference beyond tolerance (``--verify``)."""


def install_command(extra: str) -> str:
    """The command that installs the optional extra ``extra`` (``"server"``, ``"hf"``...) for the copy of prefixcache
    that runs, for the messages that name a missing one.  From a source checkout (an editable install or a clone on
    ``sys.path``: the ``pyproject.toml`` of project ``prefixcache`` beside the package folder) it is ``pip install -e
    ".[server]"``, the checkout's path in place of ``.`` when the current folder is not the checkout; prefixcache is
    not on the package index, so ``pip install 'prefixcache[server]'`` fails there.  Installed from a wheel, it is
    ``pip install 'prefixcache[server]'``, which adds the extra's packages to the installed distribution."""
    root = _source_checkout()
    if root is None:
        return f"pip install 'prefixcache[{extra}]'"
    try:
        here = Path.cwd().resolve() == root
    except OSError:  # the current folder was removed
        here = False
    return f'pip install -e ".[{extra}]"' if here else f'pip install -e "{root}[{extra}]"'


@functools.cache
def _source_checkout() -> Path | None:
    """The folder of the checkout the package runs from, or None (a wheel's install in site-packages)."""
    root = Path(os.path.realpath(__file__)).parent.parent
    try:
        project = (root / "pyproject.toml").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return root if 'name = "prefixcache"' in project else None
