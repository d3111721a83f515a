"""Replay requests: a transcript turned into one request per assistant turn, and files turned into request lists.

One request per assistant turn: the prompt is the chat template applied to the history before the turn plus the
generation prompt, and the answer is the transcript's own assistant message, teacher forced, so the next turn's
prompt extends prompt + answer.  :func:`interleave` merges conversations as concurrent users would send them.
A request log or Batch file gives one request per body, its prompt as sent and no answer, in file order
(formats: :mod:`prefixcache.replay.formats`).
"""

from __future__ import annotations

import logging
import random
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from prefixcache.cache.tokens import TOKEN_TYPECODE
from prefixcache.chat.tokenizer import Tokenizer
from prefixcache.errors import InvalidArgumentError, InvalidTokensError, ScenarioError, TemplateError
from prefixcache.replay.formats import FILE_FORMATS, LoggedRequest, input_format, load_request_log, load_sharegpt
from prefixcache.replay.scenarios import Conversation, default_tools_for, iter_mooncake, load_scenario

__all__ = [
    "ORDERS",
    "LoadedFile",
    "Progress",
    "ReplayRequest",
    "conversation_requests",
    "interleave",
    "load_requests",
    "logged_request",
    "read_options",
    "read_requests",
    "smallest_pool_tokens",
]

logger = logging.getLogger(__name__)

ORDERS = ("round-robin", "random", "file")

T = TypeVar("T")
Progress = Callable[[Iterable[T], str, "int | None", str], Iterable[T]]
"""``progress(items, description, total, unit)`` wraps an iterable to show progress (a tqdm bar)."""


def _no_progress(items: Iterable[T], description: str, total: int | None, unit: str) -> Iterable[T]:
    return items


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One request of a replay: where it comes from, its prompt and teacher-forced answer token ids.

    ``drift_at`` is set when the prompt is not a token-level extension of the previous turn's prompt + answer of
    the same conversation: the token index where the two first differ (template drift).  ``conversation`` is the
    transcript it comes from (``None`` for traces), which ``--explain`` uses to name messages.
    """

    scenario: str
    conversation_id: str
    turn: int
    prompt: array
    answer: array
    drift_at: int | None = None
    conversation: Conversation | None = field(default=None, compare=False, repr=False)


def conversation_requests(conversation: Conversation, tokenizer: Tokenizer, scenario: str) -> list[ReplayRequest]:
    """The requests of one conversation, in turn order, with template drift marked.

    Raises TemplateError if a message cannot be rendered.
    """
    requests: list[ReplayRequest] = []
    previous: array | None = None
    for turn in conversation.assistant_turns:
        history = conversation.messages[:turn]
        prompt = array(TOKEN_TYPECODE, tokenizer.render_chat(history, conversation.tools, add_generation_prompt=True))
        full = array(
            TOKEN_TYPECODE,
            tokenizer.render_chat(conversation.messages[: turn + 1], conversation.tools, add_generation_prompt=False),
        )
        start = len(prompt) if full[: len(prompt)] == prompt else _common_prefix(full, prompt)
        answer = full[start:]
        drift_at = None
        if previous is not None and prompt[: len(previous)] != previous:
            drift_at = _common_prefix(prompt, previous)
        requests.append(ReplayRequest(scenario, conversation.id, turn, prompt, answer, drift_at, conversation))
        previous = prompt + answer
    return requests


def _common_prefix(a: array, b: array) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def interleave(per_conversation: Sequence[Sequence[ReplayRequest]], order: str, seed: int) -> list[ReplayRequest]:
    """Merge conversations' request lists, keeping each conversation's turn order.

    ``round-robin``: first turns of all conversations, then second turns, ...; ``random``: a seeded random
    conversation takes its next turn each step; ``file``: each conversation whole, in file order.

    Raises:
        InvalidArgumentError: unknown order.
    """
    if order == "file":
        return [r for requests in per_conversation for r in requests]
    if order == "round-robin":
        out = []
        depth = max((len(r) for r in per_conversation), default=0)
        for i in range(depth):
            out.extend(requests[i] for requests in per_conversation if i < len(requests))
        return out
    if order == "random":
        rng = random.Random(seed)
        queues = [list(reversed(r)) for r in per_conversation if r]
        out = []
        while queues:
            i = rng.randrange(len(queues))
            out.append(queues[i].pop())
            if not queues[i]:
                queues[i] = queues[-1]
                queues.pop()
        return out
    raise InvalidArgumentError(f"unknown order {order!r}; choose one of {ORDERS}")


@dataclass(frozen=True, slots=True)
class LoadedFile:
    """One input file read into replay requests: its format (a key of
    :data:`~prefixcache.replay.formats.FILE_FORMATS`, as detected or forced), the requests in replay order, and how
    many bad lines were skipped; for a request log or Batch file, ``logged`` holds its parsed records (their bodies,
    for a caller that sends them on)."""

    path: str
    file_format: str
    requests: list[ReplayRequest]
    skipped: int
    logged: list[LoggedRequest] = field(default_factory=list)


def logged_request(request: LoggedRequest, tokenizer: Tokenizer, scenario: str) -> ReplayRequest:
    """The replay request of one logged request: its messages rendered with the chat template and the generation
    prompt (its ``turn`` is the number of messages, where the answer would go), or its completions prompt encoded
    as plain text (or its token ids as given; ``turn`` 0).  No answer: nothing is teacher forced.

    Raises TemplateError if the messages cannot be rendered, InvalidTokensError if a token id is not below the
    tokenizer's vocabulary size.
    """
    empty = array(TOKEN_TYPECODE)
    if request.messages is None:
        if isinstance(request.prompt, str):
            return ReplayRequest(
                scenario, request.id, 0, array(TOKEN_TYPECODE, tokenizer.encode(request.prompt)), empty
            )
        given = request.prompt or ()
        if given and max(given) >= tokenizer.vocab_size:  # checked before the array, which holds no id >= 2**32
            raise InvalidTokensError(
                f"prompt token id {max(given)} is not below the vocabulary size {tokenizer.vocab_size:,} of "
                f"{tokenizer.name} (--tokenizer names the tokenizer the ids are from)"
            )
        return ReplayRequest(scenario, request.id, 0, array(TOKEN_TYPECODE, given), empty)
    extra = {"template_kwargs": request.template_kwargs} if request.template_kwargs else {}
    prompt = array(
        TOKEN_TYPECODE, tokenizer.render_chat(request.messages, request.tools, add_generation_prompt=True, **extra)
    )
    # --explain names the messages of the prompt; it renders them without template variables, so only without any.
    transcript = None
    if not request.template_kwargs:
        transcript = Conversation(request.id, request.messages, request.tools, scenario, request.line_no)
    return ReplayRequest(scenario, request.id, len(request.messages), prompt, empty, None, transcript)


def read_requests(
    path: str | Path,
    tokenizer: Tokenizer,
    *,
    order: str = "round-robin",
    seed: int = 0,
    limit: int | None = None,
    skip_invalid: bool = False,
    file_format: str = "auto",
    progress: Progress | None = None,
) -> LoadedFile:
    """Read any replay input file (``file_format`` ``"auto"``: told from its first record; or one of
    :data:`~prefixcache.replay.formats.FILE_FORMATS`) into replay requests.

    ``limit`` keeps the first ``limit`` conversations (or, for one-request-per-line formats, lines).  Transcripts
    (chat, ShareGPT) interleave by ``order``; request logs, Batch files and Mooncake traces keep the file's order and
    have no answer tokens.  ``progress`` sees the conversations as they are rendered and tokenized (the slow part with
    a Hugging Face tokenizer), or the lines as they are read.  O(file size + prompt tokens).

    Raises:
        InvalidArgumentError: an unknown ``file_format``.
        ScenarioError: a file of no known format (naming the line and the formats accepted), a bad line (unless
            ``skip_invalid``, which also skips bad lines before the first usable one), a conversation or request the
            tokenizer's chat template cannot render or whose token ids it does not have (same), a file that is
            missing, unreadable or empty whatever the format (:func:`~prefixcache.replay.formats.input_lines`), a
            file whose every line ``skip_invalid`` skipped (no valid request).
    """
    if file_format != "auto" and file_format not in FILE_FORMATS:
        raise InvalidArgumentError(f"unknown format {file_format!r}; choose auto, {', '.join(FILE_FORMATS)}")
    path = Path(path)
    name = str(path)
    progress = progress or _no_progress
    fmt = input_format(path, file_format, skip_invalid=skip_invalid)
    if fmt == "mooncake":
        empty = array(TOKEN_TYPECODE)
        skipped: list[ScenarioError] = []
        on_error = skipped.append if skip_invalid else None
        lines = progress(iter_mooncake(path, limit=limit, on_error=on_error), f"read {path.name}", limit, "req")
        requests = [
            ReplayRequest(name, f"line{i + 1}", 0, array(TOKEN_TYPECODE, r.token_ids), empty)
            for i, r in enumerate(lines)
        ]
        for error in skipped:
            logger.warning("skipped %s", error)
        return _some_valid(LoadedFile(name, fmt, requests, len(skipped)), limit)
    if fmt in ("requests", "batch"):
        log = load_request_log(path, file_format=fmt, limit=limit, skip_invalid=skip_invalid, progress=progress)
        skipped = list(log.skipped)
        requests = []
        for logged in progress(log.requests, f"tokenize {path.name}", len(log.requests), "req"):
            try:
                requests.append(logged_request(logged, tokenizer, name))
            except (TemplateError, InvalidTokensError) as error:
                problem = ScenarioError(f"request {logged.id!r}: {error}", name, logged.line_no)
                if not skip_invalid:
                    raise problem from None
                skipped.append(problem)
        for error in skipped:
            logger.warning("skipped %s", error)
        return _some_valid(LoadedFile(name, fmt, requests, len(skipped), list(log.requests)), limit)
    if fmt == "sharegpt":
        scenario = load_sharegpt(path, skip_invalid=skip_invalid, progress=progress)
    else:
        scenario = load_scenario(path, tools=default_tools_for(path), skip_invalid=skip_invalid, progress=progress)
    skipped = list(scenario.skipped)
    for error in skipped:
        logger.warning("skipped %s", error)
    conversations = scenario.conversations[:limit] if limit is not None else scenario.conversations
    per_conversation = []
    for conversation in progress(conversations, f"tokenize {path.name}", len(conversations), "conv"):
        try:
            per_conversation.append(conversation_requests(conversation, tokenizer, name))
        except TemplateError as error:
            # The line is valid JSON and a valid transcript, but this tokenizer's template refuses it: say where.
            problem = ScenarioError(f"conversation {conversation.id!r}: {error}", name, conversation.line_no)
            if not skip_invalid:
                raise problem from None
            logger.warning("skipped %s", problem)
            skipped.append(problem)
    return _some_valid(LoadedFile(name, fmt, interleave(per_conversation, order, seed), len(skipped)))


def _some_valid(loaded: LoadedFile, line_limit: int | None = None) -> LoadedFile:
    """``loaded``, unless ``skip_invalid`` skipped every line of it (of its first ``line_limit`` lines, for the
    formats whose ``--limit`` counts lines): a report of nothing would look like a success.

    Raises:
        ScenarioError: no request was read and at least one line was skipped.
    """
    if not loaded.requests and loaded.skipped:
        lines = "1 invalid line" if loaded.skipped == 1 else f"{loaded.skipped} invalid lines"
        within = "" if line_limit is None else f" in the first {line_limit} lines (--limit counts lines in this format)"
        raise ScenarioError(
            f"no valid request found{within} ({loaded.file_format} format); {lines} skipped (--skip-invalid)",
            loaded.path,
        )
    return loaded


def load_requests(
    path: str | Path,
    tokenizer: Tokenizer,
    *,
    order: str = "round-robin",
    seed: int = 0,
    limit: int | None = None,
    skip_invalid: bool = False,
    file_format: str = "auto",
    progress: Progress | None = None,
) -> tuple[list[ReplayRequest], int]:
    """:func:`read_requests` as ``(requests, skipped)``, for callers that need not know the format; same arguments
    and errors."""
    loaded = read_requests(
        path,
        tokenizer,
        order=order,
        seed=seed,
        limit=limit,
        skip_invalid=skip_invalid,
        file_format=file_format,
        progress=progress,
    )
    return loaded.requests, loaded.skipped


def smallest_pool_tokens(requests: Iterable[ReplayRequest], block_size: int) -> tuple[int, ReplayRequest | None]:
    """The smallest pool (tokens, whole blocks) that replays ``requests`` one at a time, and the request that
    needs it (``None`` for no requests).  A request holds the blocks of its prompt and answer at once; everything
    else in the pool can be evicted meanwhile.  O(len(requests))."""
    largest, need = None, 0
    for request in requests:
        tokens = -(-(len(request.prompt) + len(request.answer)) // block_size) * block_size
        if tokens > need:
            largest, need = request, tokens
    return need, largest


def read_options(args: Any, progress: Progress | None) -> dict[str, Any]:
    """The keywords of :func:`read_requests` (and of the functions that pass them on: :func:`load_requests`,
    ``replay_paths``, ``audit_requests``, ``load_requests_cached``) that a replay command line sets: ``order``,
    ``seed``, ``limit``, ``skip_invalid``, ``file_format`` from the parsed ``args``, and ``progress``."""
    return {
        "order": args.order,
        "seed": args.seed,
        "limit": args.limit,
        "skip_invalid": args.skip_invalid,
        "file_format": args.file_format,
        "progress": progress,
    }
