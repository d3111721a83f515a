"""The request bodies the server accepts, declared once as pydantic models: what is checked and what
``/openapi.json`` publishes.

Each model states a body's fields, their JSON types, the values OpenAI documents for them and the ranges that hold
whatever the model (``temperature`` in [0, 2], ``n`` in 1 .. 16, ...).  Unknown fields are refused
(``extra="forbid"``: a field the server cannot honour is a 400 naming it, never silently ignored) and nothing is
coerced (``strict``: ``"1"`` is not a number, ``true`` not an integer).  Checks that join fields, or need the model
(``logit_bias`` ids below the vocabulary, a ``response_format`` schema that compiles, ``top_logprobs`` needing
``logprobs``) stay in :mod:`prefixcache.serve.protocol` and :mod:`prefixcache.serve.responses`, which validate a body
here first (:func:`validate_body`); the sampling fields' ranges are
:class:`~prefixcache.engine.sampling.SamplingParams`'s, their one definition.

Validation is O(size of the body); fields the chat template reads (``messages``, tool ``parameters``) are kept as
the JSON objects they were (``dict``), so no deep copy is made.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from prefixcache.engine.sampling import MAX_LOGPROBS

__all__ = [
    "MAX_CHOICES",
    "BODY_MODELS",
    "ChatCompletionBody",
    "CompletionBody",
    "DetokenizeBody",
    "PrefillBody",
    "ResponsesBody",
    "TokenizeChatBody",
    "TokenizePromptBody",
    "BodyError",
    "validate_body",
]

MAX_CHOICES = 16
"""The most samples (``n``) one request may ask for: each is an engine request of its own."""

_SEED_LIMIT = 2**63

NonNegativeInt = Annotated[int, Field(ge=0)]
Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(gt=0, le=1)]
Seed = Annotated[int, Field(ge=0, lt=_SEED_LIMIT)]
Alternatives = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
Text = Annotated[str, Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _Open(BaseModel):
    """An object the server reads a few fields of and passes on whole (tool definitions): other fields pass."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(None, description="vLLM's: every chunk carries the usage so far")


class _Sampling(_Strict):
    """The fields chat and completions share: model, streaming, stop strings and sampling."""

    model: Text
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description="any number of stop strings (vLLM has no limit)")
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    max_tokens: NonNegativeInt | None = None
    logit_bias: dict[str, float] | None = Field(None, description="token ids (decimal strings) to biases")
    top_k: int | None = Field(None, description="vLLM's; -1 or 0: off")
    min_p: float | None = Field(None, description="vLLM's")
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(None, description="vLLM's")
    min_tokens: NonNegativeInt | None = Field(None, description="vLLM's")
    ignore_eos: bool | None = Field(None, description="vLLM's")
    response_format: dict[str, Any] | None = Field(None, description="text, json_object or json_schema")
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    service_tier: str | None = None


class ToolFunction(_Open):
    name: Text
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema object")
    strict: bool | None = None


class ChatTool(_Open):
    type: Literal["function"] = "function"
    function: ToolFunction


class Prediction(_Strict):
    type: Literal["content"]
    content: str | list[dict[str, Any]]


class ChatCompletionBody(_Sampling):
    """``POST /v1/chat/completions``: OpenAI's body, plus vLLM's sampling fields and ``chat_template_kwargs``."""

    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_completion_tokens: NonNegativeInt | None = None
    logprobs: bool | None = None
    top_logprobs: Alternatives | None = None
    echo: Literal[False] | None = Field(None, description="completions only")
    prompt_cache_key: str | None = Field(None, description="a routing hint; changes no answer")
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: list[Literal["text"]] | None = None
    prediction: Prediction | None = Field(None, description="a predicted output; changes no answer")
    reasoning_effort: ReasoningEffort | None = Field(None, description="passed to the chat template")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM's: chat-template variables")


class CompletionBody(_Sampling):
    """``POST /v1/completions``: one prompt, as text or token ids (or a list of one such)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Alternatives | Literal[False] | None = None
    echo: bool | None = None


class PrefillBody(_Strict):
    """``POST /v1/cache/prefill``: warm the cache with ``messages`` (and ``tools``) or a ``prompt``, optionally
    retained (``priority``, ``retain_s`` seconds)."""

    model: Text | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    priority: Annotated[int, Field(ge=1, le=2**63 - 1)] | None = None
    retain_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None


class Reasoning(_Strict):
    effort: ReasoningEffort | None = None
    summary: None = Field(None, description="reasoning summaries are not produced")
    generate_summary: None = None


class TextOptions(_Strict):
    format: dict[str, Any] | None = Field(None, description="text, json_object or json_schema")
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesBody(_Strict):
    """``POST /v1/responses``: OpenAI's Responses body, function tools only."""

    model: Text
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = None
    stream_options: dict[str, bool] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    reasoning: Reasoning | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    background: Literal[False] | None = Field(None, description="accepted only as false")
    max_tool_calls: None = Field(None, description="accepted only as null")
    top_logprobs: None = Field(None, description="accepted only as null")


class _TokenizeOptions(_Strict):
    model: Text | None = None
    add_special_tokens: bool | None = Field(None, description="checked only: no special tokens are added")
    return_token_strs: bool | None = None


class TokenizePromptBody(_TokenizeOptions):
    """``POST /tokenize`` of a text (vLLM's): its ids as ``/v1/completions`` runs them."""

    prompt: str


class TokenizeChatBody(_TokenizeOptions):
    """``POST /tokenize`` of messages (vLLM's): the ids ``/v1/chat/completions`` runs for them."""

    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    tools: list[ChatTool] | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None


class DetokenizeBody(_Strict):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model: Text | None = None
    tokens: list[int]


BODY_MODELS: dict[str, tuple[type[BaseModel], ...]] = {
    "/v1/chat/completions": (ChatCompletionBody,),
    "/v1/completions": (CompletionBody,),
    "/v1/responses": (ResponsesBody,),
    "/v1/cache/prefill": (PrefillBody,),
    "/tokenize": (TokenizePromptBody, TokenizeChatBody),
    "/detokenize": (DetokenizeBody,),
}
"""The body models of each POST route (one of them, where several), for ``/openapi.json``."""


ModelT = TypeVar("ModelT", bound=BaseModel)
_BRANCH_TAGS = frozenset({"str", "int", "float", "bool", "none"})
"""Union branch tags pydantic puts in error locations that read like field names."""


class BodyError(ValueError):
    """A body its model refuses: ``message`` says what, ``param`` names the field (``tools[0]``, ``stream_options``;
    None for the body itself)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def _path(location: tuple[Any, ...]) -> str | None:
    """A field path as OpenAI names parameters (``tools[0].function.name``), up to the first union branch tag
    pydantic inserts (``str``, ``list[int]``, ...), which is no field of the body."""
    path = ""
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in _BRANCH_TAGS:
            path += f".{part}" if path else part
        else:
            break
    return path or None


def validate_body(model: type[ModelT], body: Any) -> ModelT:
    """``body`` (parsed JSON) checked against ``model``.  O(size of the body).

    Raises:
        BodyError: the first thing wrong, naming the field: ``unsupported parameter: NAME`` for an unknown field.
    """
    if not isinstance(body, dict):
        raise BodyError("the request body must be a JSON object", None)
    # Unknown names first: pydantic reads keys as str and cannot name one holding a lone surrogate (JSON's \ud800).
    unknown = next((name for name in body if name not in model.model_fields), None)
    if unknown is not None:
        raise BodyError(f"unsupported parameter: {unknown}", unknown)
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        location = tuple(first["loc"])
        path = _path(location)
        head = 1  # the field, with the index of the element the error is inside (tools[0]), not of a wrong item
        while head + 1 < len(location) and isinstance(location[head], int):
            head += 1
        param = _path(location[:head])
        if first["type"] == "extra_forbidden":
            if len(location) == 1:
                raise BodyError(f"unsupported parameter: {location[0]}", param) from None
            raise BodyError(f"unsupported field: {path}", param) from None
        if first["type"] == "missing":
            raise BodyError(f"{path} is required", param) from None
        raise BodyError(f"{path}: {first['msg']}, got {first.get('input')!r:.80}", param) from None
