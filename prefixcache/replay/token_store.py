"""Tokenized replay inputs kept on disk, so that a rerun on the same file does not tokenize it again.

An entry is keyed by the xxh3-128 digest of the file's bytes, the tokenizer's ``name`` (which identifies the tokenizer
*and* its chat template, see :class:`~prefixcache.chat.tokenizer.Tokenizer`) and every option that changes the
request list (format, order, seed, limit, skip-invalid), so an edited file or another tokenizer never hits a stale
entry.  It holds the requests' token ids (one ``uint32`` array, with offsets; a prompt as the length it shares with
the previous turn of its conversation and the tokens after it) and their ids, turns and drift marks in one ``.npz``
file, written beside its final name and renamed over it when complete; an entry that cannot be read is
ignored (tokenized again and rewritten).  Restored requests carry no transcript (``conversation`` is None): enough
for cache accounting, not for ``--explain``.

Where: ``$PREFIXCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/prefixcache``, else ``~/.cache/prefixcache``, in a
``tokens`` folder.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from array import array
from pathlib import Path

import numpy as np
import xxhash

from prefixcache.cache.tokens import TOKEN_TYPECODE
from prefixcache.chat.tokenizer import Tokenizer
from prefixcache.replay.requests import Progress, ReplayRequest, load_requests

__all__ = ["cache_dir", "entry_path", "load_requests_cached"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 4
"""Bumped whenever the stored layout or the way requests are built changes, so older entries stop matching.  3: an
empty file is refused whatever the format (an older entry of no requests for an empty file read with a forced
``--format`` would replay nothing).  4: so is a file whose every line ``--skip-invalid`` skipped (an older entry of
no requests would replay nothing)."""


def cache_dir() -> Path:
    """The folder of the stored entries (see the module docstring); not created here."""
    root = os.environ.get("PREFIXCACHE_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = str(Path(xdg) / "prefixcache") if xdg else str(Path.home() / ".cache" / "prefixcache")
    return Path(root) / "tokens"


def file_digest(path: str | Path) -> str:
    """xxh3-128 of the file's bytes, read in 1 MiB chunks.  O(file size).  Raises OSError: unreadable."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def entry_path(path: str | Path, tokenizer_name: str, directory: Path | None = None, **options: object) -> Path:
    """The entry file for ``path`` tokenized by ``tokenizer_name`` with ``options`` (the :func:`load_requests`
    keywords that change the request list).  O(file size) for the digest."""
    key = json.dumps([FORMAT_VERSION, file_digest(path), tokenizer_name, sorted(options.items())], default=str).encode()
    return (directory if directory is not None else cache_dir()) / f"{xxhash.xxh3_128_hexdigest(key)}.npz"


def load_requests_cached(
    path: str | Path,
    tokenizer: Tokenizer,
    *,
    use_cache: bool = True,
    directory: Path | None = None,
    order: str = "round-robin",
    seed: int = 0,
    limit: int | None = None,
    skip_invalid: bool = False,
    file_format: str = "auto",
    progress: Progress | None = None,
) -> tuple[list[ReplayRequest], int, bool]:
    """:func:`~prefixcache.replay.requests.load_requests`, from the stored entry when there is one; returns
    ``(requests, skipped, from_store)``.  A missed entry is written after tokenizing (a folder that cannot be written
    is logged and skipped).  ``use_cache=False`` reads and writes nothing.  O(tokens) to read or write an entry.

    Raises:
        As :func:`~prefixcache.replay.requests.load_requests` (ScenarioError, InvalidArgumentError).
    """
    options = {"order": order, "seed": seed, "limit": limit, "skip_invalid": skip_invalid, "format": file_format}
    kwargs = {"order": order, "seed": seed, "limit": limit, "skip_invalid": skip_invalid}
    if not use_cache:
        requests, skipped = load_requests(path, tokenizer, file_format=file_format, progress=progress, **kwargs)
        return requests, skipped, False
    try:
        entry = entry_path(path, tokenizer.name, directory, **options)
    except OSError:
        entry = None  # unreadable: load_requests says so with the file's name
    if entry is not None and entry.exists():
        try:
            requests, skipped = _read(entry, str(path))
            logger.info("%s: %d requests from the token store (%s)", path, len(requests), entry)
            return requests, skipped, True
        except Exception as error:  # noqa: BLE001 - empty (EOFError), an .npy, a meta of other types (TypeError), ...
            logger.warning("ignoring unreadable token store entry %s: %s: %s", entry, type(error).__name__, error)
    requests, skipped = load_requests(path, tokenizer, file_format=file_format, progress=progress, **kwargs)
    if entry is not None:
        try:
            _write(entry, requests, skipped)
        except OSError as error:
            logger.warning("could not store the tokenized %s in %s: %s", path, entry.parent, error)
    return requests, skipped, False


def _write(entry: Path, requests: list[ReplayRequest], skipped: int) -> None:
    # A turn's prompt mostly repeats the previous turn of its conversation: store the length it shares with that
    # turn's prompt + answer and only the tokens after it (tau-bench, bytes: 19 MB for 51M tokens; a Mooncake trace,
    # whose requests have no conversation, is stored whole: 245 MB for the synthetic one).
    last: dict[str, int] = {}
    refs = np.full(len(requests), -1, dtype=np.int64)
    shared = np.zeros(len(requests), dtype=np.int64)
    parts: list[np.ndarray] = []
    lengths = np.zeros(2 * len(requests), dtype=np.int64)
    for i, r in enumerate(requests):
        prompt = np.frombuffer(r.prompt, dtype=np.uint32) if len(r.prompt) else np.zeros(0, np.uint32)
        ref = last.get(r.conversation_id)
        if ref is not None:
            before = requests[ref]
            base = np.frombuffer(before.prompt + before.answer, dtype=np.uint32)
            n = min(len(base), len(prompt))
            differ = np.flatnonzero(base[:n] != prompt[:n])
            refs[i], shared[i] = ref, int(differ[0]) if len(differ) else n
        parts.append(prompt[shared[i] :])
        parts.append(np.frombuffer(r.answer, dtype=np.uint32) if len(r.answer) else np.zeros(0, np.uint32))
        lengths[2 * i], lengths[2 * i + 1] = len(parts[-2]), len(parts[-1])
        last[r.conversation_id] = i
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
    meta = {
        "skipped": skipped,
        "ids": [r.conversation_id for r in requests],
        "turns": [r.turn for r in requests],
        "drift": [r.drift_at for r in requests],
    }
    entry.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=entry.parent, prefix=entry.stem, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as handle:
            np.savez(
                handle,
                tokens=tokens,
                lengths=lengths,
                refs=refs,
                shared=shared,
                meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
            )
        os.replace(temp, entry)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _read(entry: Path, scenario: str) -> tuple[list[ReplayRequest], int]:
    with np.load(entry, allow_pickle=False) as stored:
        tokens, lengths, refs, shared = stored["tokens"], stored["lengths"], stored["refs"], stored["shared"]
        meta = json.loads(stored["meta"].tobytes().decode())
    ids, turns, drift = meta["ids"], meta["turns"], meta["drift"]
    n = len(ids)
    if not 2 * n == len(lengths) == 2 * len(refs) == 2 * len(shared) == 2 * len(turns) == 2 * len(drift):
        raise ValueError("inconsistent entry")
    if int(lengths.sum()) != len(tokens) or (refs >= np.arange(n)).any():
        raise ValueError("inconsistent entry")
    bounds = np.concatenate(([0], np.cumsum(lengths))).tolist()
    data = tokens.astype(np.uint32, copy=False).tobytes()
    requests: list[ReplayRequest] = []
    for i in range(n):
        prompt = array(TOKEN_TYPECODE, data[bounds[2 * i] * 4 : bounds[2 * i + 1] * 4])
        answer = array(TOKEN_TYPECODE, data[bounds[2 * i + 1] * 4 : bounds[2 * i + 2] * 4])
        if refs[i] >= 0:
            before = requests[refs[i]]
            base = before.prompt + before.answer
            if shared[i] > len(base):
                raise ValueError("inconsistent entry")
            prompt = base[: shared[i]] + prompt
        requests.append(ReplayRequest(scenario, ids[i], turns[i], prompt, answer, drift[i]))
    return requests, int(meta["skipped"])
