"""LangChain chat model over an in-process :class:`~prefixcache.PrefixCachingRunner` (extra ``prefixcache[langchain]``).

``ChatHuggingFace`` re-prefills the whole transcript at every agent step and drops tools; :class:`ChatPrefixCache`
renders the same OpenAI-format transcript with the runner's chat template, so each step prefills only what the
previous step did not already compute, and it supports ``bind_tools``, tool calls in ``AIMessage.tool_calls``,
streaming, stop strings, and ``usage_metadata`` with ``input_token_details.cache_read`` (the prompt tokens whose
KV came from the cache).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.utils import convert_to_openai_messages
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field

from prefixcache.chat.template import join_text_parts
from prefixcache.engine.chat import chat_stream
from prefixcache.engine.chat_decoder import ChatCompletion
from prefixcache.engine.results import Usage
from prefixcache.engine.runner import PrefixCachingRunner

__all__ = ["ChatPrefixCache"]


def _usage_metadata(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "output_tokens": usage.generated_tokens,
        "total_tokens": usage.prompt_tokens + usage.generated_tokens,
        "input_token_details": {"cache_read": usage.cached_tokens},
    }


def _tool_choice(choice: Any) -> Any:
    """LangChain's spellings of ``tool_choice`` in OpenAI's: ``"any"``/``True`` -> ``"required"``, a bare tool name ->
    the named-function object."""
    if choice is None or choice in ("auto", "none", "required") or isinstance(choice, dict):
        return choice
    if choice is True or choice == "any":
        return "required"
    if isinstance(choice, str):
        return {"type": "function", "function": {"name": choice}}
    return choice


class ChatPrefixCache(BaseChatModel):
    """A LangChain ``BaseChatModel`` answering with ``runner`` through its prefix cache.

    Fields: ``runner`` (a :class:`PrefixCachingRunner`), ``namespace`` (cache salt of every call), ``max_tokens``
    (default 256), ``temperature`` (0 = greedy), ``top_p``, ``seed``, ``stop`` (default stop strings), ``model_name``.
    Errors are those of :func:`prefixcache.engine.chat.chat_stream` (``TemplateError``, ``InvalidArgumentError``,
    ``CapacityError``...), raised before anything is cached.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    runner: PrefixCachingRunner
    namespace: str | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | None = None
    model_name: str = Field(default="prefixcache")

    @property
    def _llm_type(self) -> str:
        return "prefixcache"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "fingerprint": self.runner.fingerprint, "namespace": self.namespace}

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | bool | dict | None = None,
        **kwargs: Any,
    ) -> Runnable[Any, AIMessage]:
        """Bind tools (LangChain tools, functions, pydantic models or OpenAI schemas); ``tool_choice`` as in
        ``ChatOpenAI`` (``"auto"``, ``"none"``, ``"any"``/``"required"``, or a tool's name)."""
        formatted = [convert_to_openai_tool(tool) for tool in tools]
        return super().bind(tools=formatted, tool_choice=_tool_choice(tool_choice), **kwargs)

    def _start(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]):
        openai_messages = convert_to_openai_messages(messages)
        for message in openai_messages:
            message["content"] = join_text_parts(message.get("content"))
        options = {
            "max_new_tokens": kwargs.pop("max_tokens", self.max_tokens),
            "temperature": kwargs.pop("temperature", self.temperature),
            "top_p": kwargs.pop("top_p", self.top_p),
            "seed": kwargs.pop("seed", self.seed),
        }
        return chat_stream(
            self.runner,
            openai_messages,
            kwargs.pop("tools", None),
            tool_choice=kwargs.pop("tool_choice", None),
            stop=stop if stop is not None else self.stop,
            namespace=self.namespace,
            **options,
            **kwargs,
        )

    def _final_message(self, done: ChatCompletion, chunk: bool) -> AIMessage | AIMessageChunk:
        calls = [
            {"name": c["function"]["name"], "args": json.loads(c["function"]["arguments"]), "id": c["id"]}
            for c in done.tool_calls
        ]
        metadata = {"finish_reason": done.finish_reason, "model_name": self.model_name}
        if chunk:
            call_chunks = [
                {"name": c["name"], "args": json.dumps(c["args"]), "id": c["id"], "index": i}
                for i, c in enumerate(calls)
            ]
            return AIMessageChunk(
                content="",
                tool_call_chunks=call_chunks,
                usage_metadata=_usage_metadata(done.usage),
                response_metadata=metadata,
                chunk_position="last",
            )
        return AIMessage(
            content=done.content or "",
            tool_calls=calls,
            usage_metadata=_usage_metadata(done.usage),
            response_metadata=metadata,
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        steps = self._start(messages, stop, kwargs)
        try:
            while True:
                next(steps)
        except StopIteration as finished:
            done: ChatCompletion = finished.value
        finally:
            steps.close()
        message = self._final_message(done, chunk=False)
        return ChatResult(generations=[ChatGeneration(message=message)], llm_output={"model_name": self.model_name})

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        steps = self._start(messages, stop, kwargs)
        try:
            while True:
                delta = next(steps)
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
                if run_manager is not None:
                    run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk
        except StopIteration as finished:
            done: ChatCompletion = finished.value
        finally:
            steps.close()
        yield ChatGenerationChunk(message=self._final_message(done, chunk=True))
