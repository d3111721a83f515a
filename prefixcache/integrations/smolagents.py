"""smolagents model over an in-process :class:`~prefixcache.PrefixCachingRunner` (extra ``prefixcache[smolagents]``).

smolagents' ``TransformersModel`` calls ``model.generate`` on the whole transcript at every agent step, recomputing
the system prompt, the tools and every earlier step.  :class:`PrefixCacheModel` renders the same transcript with the
runner's chat template and generates through the prefix cache, so a step prefills only what the previous step had
not already computed.  Tool calls come back as ``ChatMessage.tool_calls``; token counts as ``TokenUsage``; the
OpenAI-shaped response (with ``usage.prompt_tokens_details.cached_tokens``) as ``ChatMessage.raw``.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from smolagents.models import (
    ChatMessage,
    ChatMessageStreamDelta,
    ChatMessageToolCall,
    ChatMessageToolCallFunction,
    ChatMessageToolCallStreamDelta,
    MessageRole,
    Model,
)
from smolagents.monitoring import TokenUsage

from prefixcache.chat.template import join_text_parts
from prefixcache.engine.chat import chat_stream
from prefixcache.engine.chat_decoder import ChatCompletion
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.errors import InvalidArgumentError

__all__ = ["PrefixCacheModel"]


def _raw(done: ChatCompletion, model_id: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": done.content}
    if done.tool_calls:
        message["tool_calls"] = [dict(call) for call in done.tool_calls]
    return {
        "model": model_id,
        "choices": [{"index": 0, "message": message, "finish_reason": done.finish_reason}],
        "usage": done.usage.to_openai(),
    }


class PrefixCacheModel(Model):
    """A smolagents ``Model`` answering with ``runner`` through its prefix cache.

    ``namespace`` salts every call's cache; ``max_tokens`` (default 256), ``temperature`` (0 = greedy), ``top_p`` and
    ``seed`` are the sampling defaults (a call's ``max_tokens``, ``temperature``, ``top_p`` or ``seed`` overrides
    them).  Other keyword arguments go to ``smolagents.Model``.  Errors are those of
    :func:`prefixcache.engine.chat.chat_stream` (an unsupported option, ``response_format`` included, is an
    ``InvalidArgumentError``), raised before anything is cached.
    """

    def __init__(
        self,
        runner: PrefixCachingRunner,
        *,
        namespace: str | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        model_id: str = "prefixcache",
        **kwargs: Any,
    ) -> None:
        super().__init__(model_id=model_id, **kwargs)
        self.runner = runner
        self.namespace = namespace
        self.sampling = {"max_new_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}

    @property
    def supports_stop_parameter(self) -> bool:
        return True

    def _start(self, messages, stop_sequences, response_format, tools_to_call_from, kwargs):
        if response_format is not None:
            raise InvalidArgumentError("PrefixCacheModel does not support response_format (structured generation)")
        request = self._prepare_completion_kwargs(
            messages=messages, stop_sequences=stop_sequences, tools_to_call_from=tools_to_call_from, **kwargs
        )
        chat_messages = [
            {**m, "role": getattr(m["role"], "value", m["role"]), "content": join_text_parts(m["content"])}
            for m in request.pop("messages")
        ]
        sampling = dict(self.sampling)
        for ours, theirs in (("max_new_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
            if theirs in request:
                sampling[ours] = request.pop(theirs)
        for name in ("max_new_tokens", "seed"):
            if name in request:
                sampling[name] = request.pop(name)
        # What is left (a call's or the model's extra kwargs) goes on as sampling: an unknown one is an
        # InvalidArgumentError rather than silently dropped.
        return chat_stream(
            self.runner,
            chat_messages,
            request.pop("tools", None),
            tool_choice=request.pop("tool_choice", None),
            stop=request.pop("stop", None),
            namespace=self.namespace,
            **sampling,
            **request,
        )

    def _message(self, done: ChatCompletion) -> ChatMessage:
        calls = [
            ChatMessageToolCall(
                function=ChatMessageToolCallFunction(name=c["function"]["name"], arguments=c["function"]["arguments"]),
                id=c["id"],
                type="function",
            )
            for c in done.tool_calls
        ]
        return ChatMessage(
            role=MessageRole.ASSISTANT,
            content=done.content,
            tool_calls=calls or None,
            raw=_raw(done, self.model_id or "prefixcache"),
            token_usage=TokenUsage(input_tokens=done.usage.prompt_tokens, output_tokens=done.usage.generated_tokens),
        )

    def generate(
        self,
        messages: list[ChatMessage | dict],
        stop_sequences: list[str] | None = None,
        response_format: dict[str, str] | None = None,
        tools_to_call_from: list[Any] | None = None,
        **kwargs: Any,
    ) -> ChatMessage:
        """Answer ``messages``; tool calls (with ``tools_to_call_from``) in ``ChatMessage.tool_calls``."""
        steps = self._start(messages, stop_sequences, response_format, tools_to_call_from, kwargs)
        try:
            while True:
                next(steps)
        except StopIteration as finished:
            return self._message(finished.value)
        finally:
            steps.close()

    def generate_stream(
        self,
        messages: list[ChatMessage | dict],
        stop_sequences: list[str] | None = None,
        response_format: dict[str, str] | None = None,
        tools_to_call_from: list[Any] | None = None,
        **kwargs: Any,
    ) -> Generator[ChatMessageStreamDelta]:
        """Stream the answer as ``ChatMessageStreamDelta``s: text as it is final, then the tool calls and the usage."""
        steps = self._start(messages, stop_sequences, response_format, tools_to_call_from, kwargs)
        try:
            while True:
                yield ChatMessageStreamDelta(content=next(steps))
        except StopIteration as finished:
            done: ChatCompletion = finished.value
        finally:
            steps.close()
        yield ChatMessageStreamDelta(
            content="",
            tool_calls=[
                ChatMessageToolCallStreamDelta(
                    index=i,
                    id=c["id"],
                    type="function",
                    function=ChatMessageToolCallFunction(
                        name=c["function"]["name"], arguments=c["function"]["arguments"]
                    ),
                )
                for i, c in enumerate(done.tool_calls)
            ]
            or None,
            token_usage=TokenUsage(input_tokens=done.usage.prompt_tokens, output_tokens=done.usage.generated_tokens),
        )
