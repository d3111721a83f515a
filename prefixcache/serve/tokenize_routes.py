"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``.

A client that counts or builds token ids itself asks the server for them instead of loading the model's tokenizer
from a hub: lm-eval's ``local-completions`` finds ``/tokenizer_info`` and ``/tokenize`` and then tokenizes through them
(its "remote" tokenizer), which is the only way it can score a model served with the embedded byte tokenizer.  The
ids are exactly what ``/v1/completions`` runs for the same text (no special tokens added, a special token's name in
the text encoded as plain text) and ``/v1/chat/completions`` for the same messages, so a client's counts match the
usage the server reports.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response

from prefixcache.errors import TemplateError
from prefixcache.serve.protocol import BadRequest, parse_chat_request
from prefixcache.serve.replies import json_response
from prefixcache.serve.schemas import (
    BodyError,
    DetokenizeBody,
    TokenizeChatBody,
    TokenizePromptBody,
    validate_body,
)
from prefixcache.serve.state import server_state

__all__ = ["add_tokenize_routes", "detokenize", "tokenize", "tokenizer_info"]

ModelT = TypeVar("ModelT")
_TEMPLATE = ("chat_template_kwargs", "reasoning_effort")


def _checked(model: type[ModelT], body: Any) -> ModelT:
    try:
        return validate_body(model, body)
    except BodyError as error:
        raise BadRequest(str(error), error.param) from None


def _checked_tokenize(body: Any) -> TokenizePromptBody | TokenizeChatBody:
    chat_form = isinstance(body, Mapping) and "messages" in body
    return _checked(TokenizeChatBody if chat_form else TokenizePromptBody, body)


def _tokenized(tokenizer: Any, body: Any, checked: TokenizePromptBody | TokenizeChatBody) -> Response:
    """The answer of ``/tokenize``: on the worker thread, where every request's tokenizing runs (a Hugging Face
    tokenizer must not be used by two threads at once; see :mod:`prefixcache.serve.offload`), its JSON too (a
    million ids take the event loop ~0.2 s to write)."""
    if isinstance(checked, TokenizeChatBody):
        fields = {name: body[name] for name in ("messages", "tools", *_TEMPLATE) if name in body}
        chat = parse_chat_request({"model": checked.model or "-", **fields})
        kwargs = {"template_kwargs": chat.template_kwargs} if chat.template_kwargs else {}
        generation = checked.add_generation_prompt is not False
        try:
            ids = tokenizer.render_chat(chat.messages, chat.tools, add_generation_prompt=generation, **kwargs)
        except TemplateError as error:  # a message the template refuses, as /v1/chat/completions answers it
            raise BadRequest(str(error), "messages") from None
    else:
        ids = tokenizer.encode(checked.prompt)
    # add_special_tokens is checked only: encode adds none, as /v1/completions runs the text.
    strings = [tokenizer.decode([token]) for token in ids] if checked.return_token_strs else None
    return json_response({"count": len(ids), "max_model_len": None, "tokens": ids, "token_strs": strings})


def _detokenized(tokenizer: Any, tokens: list[int]) -> Response:
    if not all(0 <= token < tokenizer.vocab_size for token in tokens):
        message = f"tokens must be a list of token ids in [0, {tokenizer.vocab_size})"
        raise BadRequest(message, "tokens")
    return json_response({"prompt": tokenizer.decode(tokens)})


def _info(tokenizer: Any) -> dict[str, Any]:
    # A Hugging Face tokenizer names its own tokens and template; the byte tokenizer's EOS is <|endoftext|> (the
    # lower of its two end ids) and its ChatML template is code, not Jinja.
    hf = getattr(tokenizer, "tokenizer", None)
    eos = getattr(hf, "eos_token", None) or tokenizer.decode([min(tokenizer.eos_token_ids)])
    info = {"tokenizer_class": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eos_token": eos}
    for name in ("bos_token", "pad_token", "chat_template"):
        value = getattr(hf, name, None)
        info[name] = value if isinstance(value, str) else None
    return info


async def tokenize(request: Request) -> Response:
    """``POST /tokenize``: a prompt's ids (or rendered messages'), their count and, when asked, their strings.  O(the
    text's length); raises BadRequest (400, or 404 for another model's name) naming the parameter."""
    state = server_state(request)
    state.authenticate(request)
    body = await state.work.read_json(request)
    checked = await state.work.call(request, _checked_tokenize, body)
    if checked.model is not None:
        state.check_model(checked.model)
    return await state.work.tokenizing(_tokenized, state.tokenizer, body, checked)


async def detokenize(request: Request) -> Response:
    """``POST /detokenize``: the text of token ids.  O(the ids' number); raises BadRequest (400 for an id outside the
    vocabulary, or 404 for another model's name) naming the parameter."""
    state = server_state(request)
    state.authenticate(request)
    checked = await state.work.call(request, _checked, DetokenizeBody, await state.work.read_json(request))
    if checked.model is not None:
        state.check_model(checked.model)
    return await state.work.tokenizing(_detokenized, state.tokenizer, checked.tokens)


async def tokenizer_info(request: Request) -> Response:
    """``GET /tokenizer_info``: the tokenizer's class, vocabulary size, special tokens and chat template."""
    state = server_state(request)
    state.authenticate(request)
    return json_response(_info(state.tokenizer))


def add_tokenize_routes(app: FastAPI) -> None:
    """Add the three tokenizer routes to ``app``."""
    app.add_route("/tokenize", tokenize, methods=["POST"])
    app.add_route("/detokenize", detokenize, methods=["POST"])
    app.add_route("/tokenizer_info", tokenizer_info, methods=["GET"])
