"""Decoding one chat or completion request's tokens into answer text: stop strings, the tool-call gate, and the
:class:`ChatCompletion` it ends with.

:class:`ChatDecoder` is push-based (tokens in, text deltas and "stop here" out, then the completion), so both drivers
of :mod:`prefixcache.engine.chat` share it: the pull-based ``chat_stream`` and ``submit_chat`` on the batching
engine's per-token callback.  Text is shown only once final: never text a stop string or a tool call later takes
back (:class:`_ToolCallGate` holds what may grow into ``<tool_call>``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefixcache.chat.stop import StopMatcher, TextStream
from prefixcache.chat.tool_calls import TOOL_CALL_OPEN, parse_tool_calls
from prefixcache.engine.results import GenerationResult, TokenLogprob, Usage
from prefixcache.engine.sampling import SamplingParams

__all__ = ["ChatCompletion", "ChatDecoder"]


@dataclass(frozen=True, slots=True)
class ChatCompletion:
    """The outcome of one chat request.

    ``content`` is the answer text (``None`` when the model only called tools), ``tool_calls`` the OpenAI calls
    (``{"id", "type": "function", "function": {"name", "arguments": JSON string}}``), ``finish_reason`` one of
    ``"stop"``, ``"length"``, ``"tool_calls"``; ``token_ids`` the generated ids (a named ``tool_choice`` includes the
    ids it forced).  ``logprobs`` (None unless the sampling asked for them) has a
    :class:`~prefixcache.engine.results.TokenLogprob` for every generated token that is not a stop token, in order:
    the tokens whose text is the answer, the text a stop string cut and a tool call's included (OpenAI gives the
    logprobs of the content tokens; one entry per token kept, not per character shown, is simpler and says what the
    model produced); the ids a ``tool_choice`` forced are prompt, not generated, and have none.
    """

    content: str | None
    tool_calls: tuple[dict[str, Any], ...]
    finish_reason: str
    usage: Usage
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None


class _ToolCallGate:
    """Passes answer text through until ``<tool_call>`` appears, then holds everything for the parser; also holds
    trailing whitespace and any tail that may grow into ``<tool_call>``, since the parsed content drops both."""

    __slots__ = ("_held", "capturing")

    def __init__(self) -> None:
        self._held = ""
        self.capturing = False

    def feed(self, text: str) -> str:
        held = self._held = self._held + text
        if self.capturing:
            return ""
        at = held.find(TOOL_CALL_OPEN)
        if at >= 0:
            self.capturing = True
            cut = len(held[:at].rstrip())
        else:
            cut = len(held)
            for length in range(min(len(TOOL_CALL_OPEN) - 1, len(held)), 0, -1):
                if held.endswith(TOOL_CALL_OPEN[:length]):
                    cut -= length
                    break
            cut = len(held[:cut].rstrip())
        out, self._held = held[:cut], held[cut:]
        return out

    def rest(self) -> str:
        held, self._held = self._held, ""
        return held


class ChatDecoder:
    """Push-based decoding of one request's tokens: :meth:`feed` each generated token, get the text that became final
    (never text a stop string or a tool call later takes back) and whether a stop string ended the answer there;
    :meth:`finish` with the :class:`GenerationResult` gives the held-back tail and the :class:`ChatCompletion`.

    When :attr:`stopped` turns true the caller must end generation before computing that token's K/V (as
    ``runner.stream``'s ``send("stop")`` or the engine's ``on_token`` returning True do), so the turn is cached
    as with a stop token.  Not thread-safe: one request, one thread.  Cost per token: the :class:`TextStream`'s
    decode of a window of at most 16 ids, plus O(held-back text)."""

    __slots__ = (
        "_gate",
        "_hidden",
        "_parse_calls",
        "_pieces",
        "_request_id",
        "_stopper",
        "_text_stream",
        "arguments",
        "forced_ids",
    )

    def __init__(
        self,
        tokenizer: Any,
        stops: tuple[str, ...],
        params: SamplingParams,
        *,
        parse_calls: bool = False,
        forced_text: str = "",
        forced_ids: Sequence[int] = (),
        request_id: str | None = None,
    ) -> None:
        self._text_stream = TextStream(tokenizer, skip=params.stop_token_ids)
        self._hidden = params.stop_token_ids  # no text, and no logprobs entry
        self._stopper = StopMatcher(stops)
        self._gate = _ToolCallGate() if parse_calls else None
        if self._gate is not None and forced_text:
            self._gate.feed(forced_text)
        self._parse_calls = parse_calls
        self._pieces: list[str] = [forced_text]
        self._request_id = request_id
        self.forced_ids = tuple(forced_ids)
        self.arguments = {
            "stops": stops,
            "parse_calls": parse_calls,
            "forced_text": forced_text,
            "forced_ids": self.forced_ids,
            "request_id": request_id,
        }
        """What makes this decoder again over another tokenizer copy (:meth:`from_arguments`; plain data, pickles)."""

    @classmethod
    def from_arguments(cls, tokenizer: Any, params: SamplingParams, arguments: dict[str, Any]) -> ChatDecoder:
        """A fresh decoder equal to the one whose :attr:`arguments` these are (an engine process's copy)."""
        return cls(tokenizer, params=params, **arguments)

    @property
    def stopped(self) -> bool:
        """A stop string was seen: generation must end before the last fed token's K/V are computed."""
        return self._stopper.stopped

    def feed(self, token_id: int) -> str:
        """The text delta that ``token_id`` makes final (may be ``""``)."""
        text = self._stopper.feed(self._text_stream.push(token_id))
        self._pieces.append(text)
        return self._gate.feed(text) if self._gate is not None else text

    def shows_logprob(self, record: TokenLogprob) -> bool:
        """Whether ``record`` is an entry of :attr:`ChatCompletion.logprobs`: its token is not a stop token."""
        return record.token_id not in self._hidden

    def finish(self, result: GenerationResult) -> tuple[str, ChatCompletion]:
        """``(the last text delta, the ChatCompletion)`` once generation ended with ``result``; the tail is ``""``
        when tool calls were parsed (their text is in ``tool_calls``, not in the stream)."""
        stopper = self._stopper
        tail = stopper.feed(self._text_stream.flush())
        tail += stopper.flush()
        self._pieces.append(tail)
        text = "".join(self._pieces)
        # "prefill" (max_new_tokens=0: nothing generated) is the runner's own reason; the budget ended it: "length".
        finish = "stop" if stopper.stopped else "length" if result.finish_reason == "prefill" else result.finish_reason
        salt = self._request_id or uuid.uuid4().hex
        parsed = parse_tool_calls(text, id_salt=salt) if self._parse_calls else None
        if parsed is not None and parsed.tool_calls:
            content, calls, finish, rest = parsed.content, parsed.tool_calls, "tool_calls", ""
        else:
            gate = self._gate
            content, calls = text, ()
            rest = (gate.feed(tail) + gate.rest()) if gate is not None else tail
        logprobs = None if result.logprobs is None else tuple(filter(self.shows_logprob, result.logprobs))
        ids = self.forced_ids + result.token_ids
        return rest, ChatCompletion(content, calls, finish, result.usage, ids, logprobs)
