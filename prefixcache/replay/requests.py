"""Replay requests: a transcript turned into one request per assistant turn, and files turned into request lists.

One request per assistant turn: the prompt is the chat template applied to the history before the turn plus the
generation prompt, and the answer is the transcript's own assistant message, teacher forced, so the next turn's
prompt extends prompt + answer.  :func:`interleave` merges conversations as concurrent users would send them.
"""

from __future__ import annotations

import logging
import random
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from prefixcache.cache.tokens import TOKEN_TYPECODE
from prefixcache.chat.tokenizer import Tokenizer
from prefixcache.errors import InvalidArgumentError, ScenarioError, TemplateError
from prefixcache.replay.scenarios import Conversation, default_tools_for, detect_format, iter_mooncake, load_scenario

__all__ = [
    "ORDERS",
    "Progress",
    "ReplayRequest",
    "conversation_requests",
    "interleave",
    "load_requests",
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
    """Read a scenario (chat JSONL) or a Mooncake trace into replay requests; returns ``(requests, skipped)``.

    ``limit`` keeps the first ``limit`` conversations (or trace lines).  Mooncake requests have no answer tokens
    and keep the trace's order.  ``progress`` sees the conversations as they are rendered and tokenized (the slow
    part with a Hugging Face tokenizer), or the trace lines as they are read.

    Raises:
        ScenarioError: a bad line (unless ``skip_invalid``, which also skips bad lines before the first usable one),
            a conversation the tokenizer's chat template cannot render (same), or an unreadable file.
    """
    path = Path(path)
    name = str(path)
    progress = progress or _no_progress
    fmt = detect_format(path, skip_invalid=skip_invalid) if file_format == "auto" else file_format
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
        return requests, len(skipped)
    if fmt != "chat":
        raise InvalidArgumentError(f"unknown format {file_format!r}; choose auto, chat or mooncake")
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
    return interleave(per_conversation, order, seed), len(skipped)


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
