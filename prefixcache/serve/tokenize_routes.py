"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``.

A client that counts or builds token ids itself asks the server for them instead of loading the model's tokenizer
from a hub: lm-eval's ``local-completions`` finds ``/tokenizer_info`` and ``/tokenize`` and then tokenizes through them
(its "remote" tokenizer), which is the only way it can score a model served with the embedded byte tokenizer.  The
ids are exactly what ``/v1/completions`` runs for the same text (no special tokens added, a special token's name in
the text encoded as plain text) and ``/v1/chat/completions`` for the same messages, so a client's counts match the
usage the server reports.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response

from prefixcache.serve.protocol import BadRequest, parse_chat_request
from prefixcache.serve.responses_routes import AppHooks
from prefixcache.serve.schemas import (
    BodyError,
    DetokenizeBody,
    TokenizeChatBody,
    TokenizePromptBody,
    validate_body,
)

__all__ = ["add_tokenize_routes"]

ModelT = TypeVar("ModelT")
_TEMPLATE = ("chat_template_kwargs", "reasoning_effort")


def _json(body: Any) -> Response:
    data = json.dumps(body, ensure_ascii=False).encode("utf-8", "backslashreplace")
    return Response(data, media_type="application/json")


def _checked(model: type[ModelT], body: Any) -> ModelT:
    try:
        return validate_body(model, body)
    except BodyError as error:
        raise BadRequest(str(error), error.param) from None


def add_tokenize_routes(hooks: AppHooks, runner: Any) -> None:
    """Add the three routes to the app ``hooks.route`` adds to, over ``runner``'s tokenizer; each is O(length of the
    text or ids) and raises :class:`BadRequest` (400, or 404 for another model's name) naming the parameter."""
    route, tokenizer = hooks.route, runner.tokenizer

    def checked_tokenize(body: Any) -> TokenizePromptBody | TokenizeChatBody:
        chat_form = isinstance(body, Mapping) and "messages" in body
        return _checked(TokenizeChatBody if chat_form else TokenizePromptBody, body)

    def tokenized(body: Any, checked: TokenizePromptBody | TokenizeChatBody) -> Response:
        """The answer of ``/tokenize``: on the worker thread, where every request's tokenizing runs (a Hugging Face
        tokenizer must not be used by two threads at once; see :mod:`prefixcache.serve.offload`), its JSON too (a
        million ids take the event loop ~0.2 s to write)."""
        if isinstance(checked, TokenizeChatBody):
            fields = {name: body[name] for name in ("messages", "tools", *_TEMPLATE) if name in body}
            chat = parse_chat_request({"model": checked.model or "-", **fields})
            kwargs = {"template_kwargs": chat.template_kwargs} if chat.template_kwargs else {}
            generation = checked.add_generation_prompt is not False
            ids = tokenizer.render_chat(chat.messages, chat.tools, add_generation_prompt=generation, **kwargs)
        else:
            ids = tokenizer.encode(checked.prompt)
        # add_special_tokens is checked only: encode adds none, as /v1/completions runs the text.
        strings = [tokenizer.decode([token]) for token in ids] if checked.return_token_strs else None
        return _json({"count": len(ids), "max_model_len": None, "tokens": ids, "token_strs": strings})

    @route("/tokenize", "POST")
    async def tokenize(request: Request) -> Response:
        hooks.authenticate(request)
        body = await hooks.read_json(request)
        checked = await hooks.off_loop(request, checked_tokenize, body)
        if checked.model is not None:
            hooks.check_model(checked.model)
        return await hooks.tokenizing(tokenized, body, checked)

    def detokenized(tokens: list[int]) -> Response:
        if not all(0 <= token < tokenizer.vocab_size for token in tokens):
            message = f"tokens must be a list of token ids in [0, {tokenizer.vocab_size})"
            raise BadRequest(message, "tokens")
        return _json({"prompt": tokenizer.decode(tokens)})

    @route("/detokenize", "POST")
    async def detokenize(request: Request) -> Response:
        hooks.authenticate(request)
        checked = await hooks.off_loop(request, _checked, DetokenizeBody, await hooks.read_json(request))
        if checked.model is not None:
            hooks.check_model(checked.model)
        return await hooks.tokenizing(detokenized, checked.tokens)

    # A Hugging Face tokenizer names its own tokens and template; the byte tokenizer's EOS is <|endoftext|> (the
    # lower of its two end ids) and its ChatML template is code, not Jinja.
    hf = getattr(tokenizer, "tokenizer", None)
    eos = getattr(hf, "eos_token", None) or tokenizer.decode([min(tokenizer.eos_token_ids)])
    info = {"tokenizer_class": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eos_token": eos}
    for name in ("bos_token", "pad_token", "chat_template"):
        value = getattr(hf, name, None)
        info[name] = value if isinstance(value, str) else None

    @route("/tokenizer_info", "GET")
    async def tokenizer_info(request: Request) -> Response:
        hooks.authenticate(request)
        return _json(info)
