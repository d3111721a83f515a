"""Why a request missed the cache: where its tokens leave the closest cached sequence, and what is there.

:func:`explain` walks the radix tree along a prompt without touching it (no access time, no hit count, no
stats) and reports the token index where the prompt and the cache part ways, the cached sequence it came
closest to, and, given a tokenizer, the text on both sides of that point.  Given where the prompt's messages
are (:class:`MessageLocator`, or the spans of :func:`message_spans`), both found on the rendered prompt itself, it
also names the chat message the divergence falls in, which is what turns "hit rate 19%" into "the system prompt
starts with a timestamp", even when the template re-renders earlier turns.

:class:`DivergenceTally` groups explanations of many requests by (token index, message) for the replay's
``--explain`` summary.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from prefixcache.cache.radix_cache import RadixCache, check_namespace
from prefixcache.cache.tokens import TokenIds, as_token_array
from prefixcache.chat.tokenizer import Tokenizer
from prefixcache.errors import InvalidTokensError, TemplateError

__all__ = [
    "DivergencePoint",
    "DivergenceTally",
    "Explanation",
    "MessageLocator",
    "MessageSpan",
    "explain",
    "format_divergences",
    "locate_message",
    "message_spans",
]

KINDS = ("hit", "diverged", "extends", "cold")


class MessageSpan(NamedTuple):
    """Tokens ``[start, end)`` of a prompt that render message ``index`` (with its template markers)."""

    index: int
    role: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Explanation:
    """Where a prompt leaves the cache.

    ``kind`` is ``"hit"`` (the whole prompt is cached), ``"diverged"`` (a cached sequence continues with a
    different token at ``diverge_at``), ``"extends"`` (the prompt runs past the end of a cached sequence: new
    tokens, nothing contradicts them) or ``"cold"`` (nothing is cached in the namespace).  ``diverge_at`` is the
    number of leading prompt tokens the cache holds, token-exact.  ``closest_length`` is the length of the cached
    sequence it came closest to (the most recently used one where several tie; for a hit, the cached sequence
    the prompt is a prefix of); ``closest_ids`` and ``request_ids`` are up to a few ids of each from ``diverge_at``
    on.  The texts are set when a tokenizer is
    given: ``text_before`` ends at the divergence, ``cached_text`` / ``request_text`` start there.  The message
    fields are set when spans are given and the divergence falls inside one.
    """

    kind: str
    num_tokens: int
    diverge_at: int
    closest_length: int
    closest_ids: tuple[int, ...]
    request_ids: tuple[int, ...]
    text_before: str | None = None
    cached_text: str | None = None
    request_text: str | None = None
    message_index: int | None = None
    message_role: str | None = None

    @property
    def where(self) -> str:
        """``"token 46, message 0 (system)"``, or ``"token 46"`` when the message is not known."""
        if self.message_index is None:
            return f"token {self.diverge_at}"
        return f"token {self.diverge_at}, message {self.message_index} ({self.message_role})"

    def summary(self) -> str:
        """One line: what happened, where, and the text around it when known."""
        if self.kind == "hit":
            return f"all {self.num_tokens} tokens cached"
        if self.kind == "cold":
            return "nothing cached in this namespace"
        verb = "diverges from" if self.kind == "diverged" else "extends"
        line = f"{verb} a cached sequence of {self.closest_length} tokens at {self.where}"
        if self.text_before is not None:
            line += f": {snippet(self)}"
        return line


def snippet(explanation: Explanation) -> str:
    """The text around the divergence, backquoted: before it, then what the cache holds (when it diverged) and
    what the request holds after it; newlines are shown as ``\\n``."""
    text = f"`...{_visible(explanation.text_before or '')}`"
    if explanation.kind == "diverged":
        text += f" then cached `{_visible(explanation.cached_text or '')}...`"
    return text + f" vs request `{_visible(explanation.request_text or '')}...`"


def _visible(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("`", "'")


_CONTENT_MARK = "\x00\x00"
"""Appended to one message's content to find where that content ends in a rendered prompt (see
:class:`MessageLocator`); NUL bytes are kept by every template we know and merge with no neighbouring text."""


class MessageLocator:
    """Which chat message a token of a rendered prompt belongs to, computed on that prompt itself.

    ``prompt`` is the rendering of ``messages`` (with ``add_generation_prompt``), the ids the model really saw;
    rendered when not given.  Message ``i`` owns tokens ``[end(i - 1), end(i))``, template markers included,
    where ``end(i)`` is ``len(render(messages[:i + 1]))`` when that partial rendering is a token prefix of the
    prompt.  A template that re-renders history (Qwen3 drops the reasoning of earlier assistant turns) makes
    partial renderings disagree with the prompt; then ``end(i)`` is where message ``i``'s content ends in the
    prompt, found as the first token that changes when that content alone gets a marker appended.  A preamble
    before message 0 (a default system message holding ``tools``) and the generation prompt are in no message.

    Costs one or two renderings per ``end(i)``, memoized: :meth:`locate` is a binary search, O(log n)
    renderings; :meth:`spans` is O(n).  Raises TemplateError as ``render_chat``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        prompt: TokenIds | None = None,
        add_generation_prompt: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.messages = list(messages)
        self.tools = tools
        if prompt is None:
            prompt = tokenizer.render_chat(self.messages, tools, add_generation_prompt=add_generation_prompt)
        self.prompt = as_token_array(prompt)
        self._ends: dict[int, int] = {}
        try:
            preamble = array(self.prompt.typecode, tokenizer.render_chat([], tools, add_generation_prompt=False))
        except TemplateError:
            preamble = array(self.prompt.typecode)  # Hugging Face templates refuse an empty conversation
        self.start = len(preamble) if self.prompt[: len(preamble)] == preamble else 0

    def end(self, index: int) -> int:
        """Token index just past message ``index`` in the prompt; never less than the previous message's end."""
        if index < 0:
            return self.start
        if index not in self._ends:
            self._ends[index] = max(self._own_end(index), self.start)
        return self._ends[index]

    def _own_end(self, index: int) -> int:
        render = self.tokenizer.render_chat
        partial = render(self.messages[: index + 1], self.tools, add_generation_prompt=False)
        partial = array(self.prompt.typecode, partial)
        if self.prompt[: len(partial)] == partial:
            return len(partial)
        marked = [dict(m) for m in self.messages]
        marked[index]["content"] = (marked[index].get("content") or "") + _CONTENT_MARK
        changed = array(self.prompt.typecode, render(marked, self.tools, add_generation_prompt=False))
        return _common_prefix_length(self.prompt, changed)

    def locate(self, position: int) -> MessageSpan | None:
        """The message holding token ``position``, or ``None`` (preamble, generation prompt, past the end)."""
        if not self.messages or position < self.start or position >= self.end(len(self.messages) - 1):
            return None
        lo, hi = 0, len(self.messages) - 1
        while lo < hi:  # the first message whose end lies past the position
            mid = (lo + hi) // 2
            if self.end(mid) > position:
                hi = mid
            else:
                lo = mid + 1
        return self._span(lo)

    def spans(self) -> list[MessageSpan]:
        """Every message's span, in order; sorted and non-overlapping by construction (empty ones included)."""
        ends = [self.end(i) for i in range(len(self.messages))]
        for i in range(1, len(ends)):
            ends[i] = max(ends[i], ends[i - 1])
            self._ends[i] = ends[i]
        return [self._span(i) for i in range(len(self.messages))]

    def _span(self, index: int) -> MessageSpan:
        start = max(self.end(index - 1), self.start) if index else self.start
        return MessageSpan(index, str(self.messages[index]["role"]), start, max(self.end(index), start))


def _common_prefix_length(a: array, b: array) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    x = np.frombuffer(a, dtype=np.uint32, count=n)
    y = np.frombuffer(b, dtype=np.uint32, count=n)
    return int(np.flatnonzero(x != y)[0])


def message_spans(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    prompt: TokenIds | None = None,
    add_generation_prompt: bool = False,
) -> list[MessageSpan]:
    """Token spans of each message in ``prompt``, the tokenizer's chat rendering of ``messages`` (see
    :class:`MessageLocator` for how they are found and what they cover).  O(len(messages)) renderings.

    Raises TemplateError as ``render_chat``.
    """
    locator = MessageLocator(tokenizer, messages, tools, prompt=prompt, add_generation_prompt=add_generation_prompt)
    return locator.spans()


def locate_message(spans: Sequence[MessageSpan] | MessageLocator, position: int) -> MessageSpan | None:
    """The span holding token ``position``, or ``None``.  O(log n): spans must be sorted and non-overlapping, as
    :func:`message_spans` returns them; a :class:`MessageLocator` answers by itself."""
    if isinstance(spans, MessageLocator):
        return spans.locate(position)
    i = bisect.bisect_right([s.end for s in spans], position)
    if i < len(spans) and spans[i].start <= position < spans[i].end:
        return spans[i]
    return None


def explain(
    cache: RadixCache,
    token_ids: TokenIds,
    namespace: str | None = None,
    tokenizer: Tokenizer | None = None,
    messages_spans: Sequence[MessageSpan] | MessageLocator | None = None,
    *,
    before_tokens: int = 24,
    after_tokens: int = 12,
) -> Explanation:
    """Explain how much of ``token_ids`` the cache holds and where, and why, it stops.

    Read-only: the tree, its eviction order and its stats are left exactly as they were.  O(depth) dict lookups
    plus O(n) C-speed comparison, plus decoding a few tokens when ``tokenizer`` is given (texts stay ``None``
    when the tokenizer cannot decode the ids).

    Raises:
        InvalidTokensError, NamespaceError: bad input.
    """
    q = as_token_array(token_ids)
    namespace = check_namespace(namespace)
    n = len(q)
    # Friend access to the tree: the walk must not refresh access times the way RadixCache.match does.
    with cache._mutex:
        root = cache._tree.roots.get(namespace)
        if root is None or not root.children:
            return _finish("cold", q, 0, 0, (), tokenizer, messages_spans, before_tokens, after_tokens)
        node, pos, edge_offset = root, 0, 0
        while pos < n:
            child = node.children.get(q[pos])
            if child is None:
                break
            matched = _common_prefix(child.tokens, q, pos)
            node, pos, edge_offset = child, pos + matched, matched
            if matched < len(child.tokens):
                break
        # The closest cached sequence runs on from here: the rest of this edge, or the most recently used child.
        continuation = list(node.tokens[edge_offset : edge_offset + after_tokens])
        if edge_offset == len(node.tokens):
            node = _most_recent_child(node)
            continuation = [] if node is None else list(node.tokens[:after_tokens])
        if node is None:
            kind, length = ("hit" if pos == n else "extends"), pos
        else:
            kind = "hit" if pos == n else "diverged"
            while node.children:
                node = _most_recent_child(node)
                if len(continuation) < after_tokens:
                    continuation.extend(node.tokens[: after_tokens - len(continuation)])
            length = node.start + len(node.tokens)
    return _finish(kind, q, pos, length, tuple(continuation), tokenizer, messages_spans, before_tokens, after_tokens)


def _most_recent_child(node):
    return max(node.children.values(), key=lambda c: c.last_access, default=None)


def _common_prefix(edge: array, q: array, pos: int) -> int:
    n = min(len(edge), len(q) - pos)
    if edge[:n] == q[pos : pos + n]:
        return n
    a = np.frombuffer(edge, dtype=np.uint32, count=n)
    b = np.frombuffer(q, dtype=np.uint32, count=n, offset=4 * pos)
    return int(np.flatnonzero(a != b)[0])


def _finish(
    kind: str,
    q: array,
    pos: int,
    length: int,
    closest_ids: tuple[int, ...],
    tokenizer: Tokenizer | None,
    spans: Sequence[MessageSpan] | MessageLocator | None,
    before_tokens: int,
    after_tokens: int,
) -> Explanation:
    request_ids = tuple(q[pos : pos + after_tokens])
    texts: dict[str, Any] = {}
    if tokenizer is not None:
        try:
            texts["text_before"] = tokenizer.decode(q[max(0, pos - before_tokens) : pos])
            texts["cached_text"] = tokenizer.decode(closest_ids)
            texts["request_text"] = tokenizer.decode(request_ids)
        except InvalidTokensError:
            texts.clear()  # ids from another vocabulary (a synthetic trace): positions only, no text
    span = locate_message(spans, pos) if spans is not None and kind != "hit" else None
    if span is not None:
        texts["message_index"] = span.index
        texts["message_role"] = span.role
    return Explanation(kind, len(q), pos, length, closest_ids, request_ids, **texts)


@dataclass(frozen=True, slots=True)
class DivergencePoint:
    """``count`` of ``requests`` requests diverged from the cache at ``token_index`` inside message
    ``message_index`` (``None``: outside every message); ``example`` is the first of them."""

    token_index: int
    message_index: int | None
    message_role: str | None
    count: int
    requests: int
    example: Explanation

    @property
    def fraction(self) -> float:
        return self.count / self.requests if self.requests else 0.0

    def summary(self) -> str:
        """``"75% of requests (9/12) diverge at token 46, message 0 (system): `...`"``."""
        line = f"{100 * self.fraction:.0f}% of requests ({self.count}/{self.requests}) diverge at {self.example.where}"
        if self.example.text_before is not None:
            line += f": {snippet(self.example)}"
        return line


class DivergenceTally:
    """Counts explanations by (divergence token, message); only ``"diverged"`` ones are grouped, all count as
    requests."""

    def __init__(self) -> None:
        self.requests = 0
        self.kinds: dict[str, int] = dict.fromkeys(KINDS, 0)
        self._groups: dict[tuple[int, int | None], list] = {}

    def add(self, explanation: Explanation) -> None:
        self.requests += 1
        self.kinds[explanation.kind] += 1
        if explanation.kind != "diverged":
            return
        key = (explanation.diverge_at, explanation.message_index)
        group = self._groups.get(key)
        if group is None:
            self._groups[key] = [1, explanation]
        else:
            group[0] += 1

    def top(self, k: int = 3) -> list[DivergencePoint]:
        """The ``k`` most frequent divergence points, most frequent first (ties: earlier token first)."""
        ranked = sorted(self._groups.items(), key=lambda item: (-item[1][0], item[0][0]))
        return [
            DivergencePoint(at, message, example.message_role, count, self.requests, example)
            for (at, message), (count, example) in ranked[:k]
        ]


def format_divergences(scenario: str, kinds: Mapping[str, int], points: Sequence[DivergencePoint]) -> str:
    """The ``--explain`` block of one scenario: how its requests met the cache, then the top divergence points."""
    total = sum(kinds.values())
    lines = [
        f"{scenario}: {total} requests, each compared with the cache just before it ran: "
        f"{kinds.get('diverged', 0)} diverged from a cached sequence, {kinds.get('extends', 0)} extended one, "
        f"{kinds.get('hit', 0)} fully cached, {kinds.get('cold', 0)} met an empty cache"
    ]
    lines += [f"  {point.summary()}" for point in points] or ["  no request diverged from a cached sequence"]
    return "\n".join(lines)
