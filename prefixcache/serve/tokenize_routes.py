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
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from prefixcache.serve.protocol import BadRequest, parse_chat_request, parse_completion_request
from prefixcache.serve.responses_routes import AppHooks

__all__ = ["add_tokenize_routes"]

_TEXT = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
_TEMPLATE = ("chat_template_kwargs", "reasoning_effort")
_CHAT = frozenset(
    {"model", "messages", "tools", "add_generation_prompt", "add_special_tokens", "return_token_strs", *_TEMPLATE}
)


def _json(body: Any) -> Response:
    data = json.dumps(body, ensure_ascii=False).encode("utf-8", "backslashreplace")
    return Response(data, media_type="application/json")


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be a boolean, got {value!r}", name)
    return value


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    return body


def add_tokenize_routes(hooks: AppHooks, runner: Any) -> None:
    """Add the three routes to the app ``hooks.route`` adds to, over ``runner``'s tokenizer; each is O(length of the
    text or ids) and raises :class:`BadRequest` (400, or 404 for another model's name) naming the parameter."""
    route, tokenizer = hooks.route, runner.tokenizer

    def check(body: Mapping[str, Any], allowed: frozenset[str]) -> None:
        for name in body:
            if name not in allowed:
                raise BadRequest(f"unsupported parameter: {name}; this form takes {', '.join(sorted(allowed))}", name)
        if body.get("model") is not None:
            hooks.check_model(body["model"])

    @route("/tokenize", "POST")
    async def tokenize(request: Request) -> Response:
        hooks.authenticate(request)
        body = _object(await hooks.read_json(request))
        if "messages" in body:
            check(body, _CHAT)
            fields = {name: body[name] for name in ("messages", "tools", *_TEMPLATE) if name in body}
            chat = parse_chat_request({"model": body.get("model") or "-", **fields})
            kwargs = {"template_kwargs": chat.template_kwargs} if chat.template_kwargs else {}
            generation = _flag(body, "add_generation_prompt", True)
            ids = tokenizer.render_chat(chat.messages, chat.tools, add_generation_prompt=generation, **kwargs)
        else:
            check(body, _TEXT)
            if not isinstance(body.get("prompt"), str):
                raise BadRequest("give prompt (a string) or messages", "prompt")
            ids = tokenizer.encode(body["prompt"])
        _flag(body, "add_special_tokens", True)  # checked only: encode adds none, as /v1/completions runs the text
        strings = [tokenizer.decode([token]) for token in ids] if _flag(body, "return_token_strs", False) else None
        return _json({"count": len(ids), "max_model_len": None, "tokens": ids, "token_strs": strings})

    @route("/detokenize", "POST")
    async def detokenize(request: Request) -> Response:
        hooks.authenticate(request)
        body = _object(await hooks.read_json(request))
        check(body, frozenset({"model", "tokens"}))
        if "tokens" not in body:
            raise BadRequest("tokens (a list of token ids) is required", "tokens")
        try:
            ids = parse_completion_request({"model": "-", "prompt": body["tokens"]}, tokenizer.vocab_size).prompt
        except BadRequest as wrong:
            raise BadRequest(str(wrong).replace("prompt", "tokens"), "tokens") from None
        if isinstance(ids, str):
            raise BadRequest("tokens must be a list of token ids", "tokens")
        return _json({"prompt": tokenizer.decode(ids)})

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
