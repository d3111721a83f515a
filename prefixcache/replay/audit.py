"""``replay FILE --endpoint URL``: audit any OpenAI-compatible server's prefix cache on a replay's requests.

The replay's requests, in the replay's order (:func:`audit_requests`), go to the endpoint as it would get them from
users: a transcript's turn as a chat completion of the history before it (with the conversation's tools), a request
log's line as its own body's messages (or completions prompt), a trace's token ids as a completions prompt.  The
endpoint writes its own answers, so nothing is teacher forced: the simulation beside it (prefixcache's radix tree at
the same capacity, ``--cache-tokens``) and the ideal (an infinite cache) replay the prompts alone, in the same order.

The endpoint's cache is whatever it holds when the audit starts: audit a freshly started server for figures from
cold (the report says so when the endpoint hit more than an infinite cache could).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from prefixcache.cache.tokens import TOKEN_TYPECODE
from prefixcache.chat.tokenizer import ByteTokenizer, Tokenizer
from prefixcache.errors import CapacityError, InvalidArgumentError
from prefixcache.replay.audit_report import AuditReport, RequestFigures, audit_json, format_audit
from prefixcache.replay.endpoint import (
    EndpointCall,
    add_endpoint_arguments,
    api_key_from_env,
    base_url,
    fetch_model,
    send_all,
)
from prefixcache.replay.formats import FILE_FORMATS, LoggedRequest
from prefixcache.replay.requests import Progress, ReplayRequest, read_options, read_requests, smallest_pool_tokens
from prefixcache.replay.scenarios import expand_paths

__all__ = [
    "AuditRequest",
    "add_endpoint_arguments",
    "audit_requests",
    "run_audit",
    "run_endpoint_replay",
]

# Replay options that need a local model or answer another question than the endpoint's hit rate.
_REFUSED_OPTIONS = {
    "model_config": "--model-config",
    "verify": "--verify",
    "explain": "--explain",
    "plot": "--plot",
    "cache_memory": "--cache-memory",
    "host_cache_tokens": "--host-cache-tokens",
    "host_cache_memory": "--host-cache-memory",
    "state_bytes": "--state-bytes",
    "sweep": "--sweep",
}


@dataclasses.dataclass(frozen=True, slots=True)
class AuditRequest:
    """One request of an audit: the replay's request with no answer (its prompt tokenized by the replay's tokenizer)
    and the call that sends the same prompt to the endpoint."""

    request: ReplayRequest
    call: EndpointCall


def _chat_body(messages: Iterable[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [dict(m) for m in messages]}
    if tools:
        body["tools"] = [dict(t) for t in tools]
    return body


def _logged_call(logged: LoggedRequest) -> tuple[str, dict[str, Any]]:
    if logged.messages is None:
        prompt = logged.prompt if isinstance(logged.prompt, str) else list(logged.prompt or ())
        return "/completions", {"prompt": prompt}
    body = _chat_body(logged.messages, logged.tools)
    if logged.template_kwargs:
        body["chat_template_kwargs"] = dict(logged.template_kwargs)
    return "/chat/completions", body


def audit_requests(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    order: str = "round-robin",
    seed: int = 0,
    limit: int | None = None,
    skip_invalid: bool = False,
    file_format: str = "auto",
    progress: Progress | None = None,
) -> tuple[list[AuditRequest], dict[str, str]]:
    """Every file's requests in the order the replay sends them (files one after another), each with its endpoint
    call, and each file's format.  Arguments and errors as :func:`~prefixcache.replay.requests.read_requests`."""
    out: list[AuditRequest] = []
    formats: dict[str, str] = {}
    empty = array(TOKEN_TYPECODE)
    for path in expand_paths(paths):
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
        formats[loaded.path] = loaded.file_format
        bodies = {logged.id: _logged_call(logged) for logged in loaded.logged}
        for request in loaded.requests:
            if request.conversation_id in bodies:
                endpoint_path, body = bodies[request.conversation_id]
            elif request.conversation is not None:  # a transcript's turn: the history before it
                conversation = request.conversation
                endpoint_path, body = (
                    "/chat/completions",
                    _chat_body(conversation.messages[: request.turn], conversation.tools),
                )
            else:  # a trace: its token ids
                endpoint_path, body = "/completions", {"prompt": list(request.prompt)}
            where = f"{Path(loaded.path).name}: conversation {request.conversation_id} turn {request.turn}"
            call = EndpointCall(endpoint_path, body, f"{loaded.path}\0{request.conversation_id}", where)
            out.append(AuditRequest(dataclasses.replace(request, answer=empty, drift_at=None), call))
    return out, formats


def _simulate(
    requests: Sequence[ReplayRequest], tokenizer: Tokenizer, block_size: int, cache_tokens: int | None, policy: str
) -> list[dict[str, Any]]:
    """Per request (the replay's ``--requests-jsonl`` records): prefixcache's cache-only replay of ``requests`` in
    one cache, as the endpoint gets them.

    Raises:
        CapacityError: ``cache_tokens`` cannot hold the longest prompt.
    """
    from prefixcache.replay.replayer import Replayer  # torch: only once an audit runs

    need, largest = smallest_pool_tokens(requests, block_size)
    if cache_tokens is not None and largest is not None and need > -(-cache_tokens // block_size) * block_size:
        raise CapacityError(
            f"--cache-tokens {cache_tokens:,} is too small for this input: {largest.scenario}: conversation "
            f"{largest.conversation_id} turn {largest.turn} holds {len(largest.prompt):,} tokens; the whole input "
            f"replays with --cache-tokens {need} or more"
        )
    replayer = Replayer(None, tokenizer, block_size=block_size, cache_tokens=cache_tokens, policy=policy)
    log: list[dict[str, Any]] = []
    replayer.replay("endpoint audit", requests, log=log)
    return log


def run_audit(
    url: str,
    requests: Sequence[AuditRequest],
    *,
    tokenizer: Tokenizer | None = None,
    model: str | None = None,
    api_key: str | None = None,
    concurrency: int = 1,
    max_tokens: int = 1,
    stream: bool = True,
    block_size: int = 16,
    cache_tokens: int | None = None,
    policy: str = "lru",
    on_done: Callable[[int], None] | None = None,
) -> AuditReport:
    """Send ``requests`` to the endpoint at ``url`` (:func:`~prefixcache.replay.endpoint.send_all`) and put its
    figures beside the simulation at ``cache_tokens`` (``None``: unlimited) and the ideal.  ``model`` ``None``: the
    first the endpoint lists; ``stream`` ``False``: whole responses (for a server whose streams carry no usage).

    Raises:
        InvalidArgumentError: a bad URL, ``concurrency`` or ``max_tokens``; httpx is not installed.
        CapacityError: ``cache_tokens`` cannot hold the longest prompt (before anything is sent).
        EndpointError: the endpoint is unreachable or answered a request with an error.
    """
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    url = base_url(url)
    model = model or fetch_model(url, api_key)  # an unreachable endpoint fails first, before any work
    simulated = _simulate([r.request for r in requests], tokenizer, block_size, cache_tokens, policy)
    results = send_all(
        url,
        [r.call for r in requests],
        model=model,
        api_key=api_key,
        concurrency=concurrency,
        max_tokens=max_tokens,
        stream=stream,
        on_done=on_done,
    )
    capacity = None if cache_tokens is None else -(-cache_tokens // block_size) * block_size
    report = AuditReport(url, model, concurrency, max_tokens, tokenizer.name, block_size, policy, capacity, stream)
    for audit_request, result, record in zip(requests, results, simulated, strict=True):
        request = audit_request.request
        report.requests.append(
            RequestFigures(
                request.scenario,
                request.conversation_id,
                request.turn,
                result,
                len(request.prompt),
                record["usage"]["prompt_tokens_details"]["cached_tokens"],
                record["ideal_cached_tokens"],
            )
        )
    return report


def run_endpoint_replay(args: argparse.Namespace, tokenizer: Tokenizer | None, progress: Progress) -> int:
    """``prefixcache replay PATH... --endpoint URL``: the audit, its table on stdout, ``--json`` and
    ``--requests-jsonl`` written; returns the exit status (0).  The output paths are checked before (by the command
    line).

    Raises:
        InvalidArgumentError: an option the audit does not take, a missing API key variable, a bad URL.
        EndpointError, CapacityError, ScenarioError: as :func:`run_audit` and :func:`audit_requests`.
    """
    refused = [flag for name, flag in _REFUSED_OPTIONS.items() if getattr(args, name, None) not in (None, False)]
    if refused:
        raise InvalidArgumentError(f"--endpoint audits a server's cache; it does not take {', '.join(refused)}")
    api_key = api_key_from_env(args.api_key_env)
    url = base_url(args.endpoint)
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    requests, formats = audit_requests(args.paths, tokenizer, **read_options(args, progress))
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="endpoint", unit="req", leave=False, file=sys.stderr, mininterval=0.2)
    try:
        report = run_audit(
            url,
            requests,
            tokenizer=tokenizer,
            model=args.endpoint_model,
            api_key=api_key,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            stream=not args.no_stream,
            block_size=args.block_size,
            cache_tokens=args.cache_tokens,
            policy=args.policy,
            on_done=None if bar is None else lambda _index: bar.update(1),
        )
    finally:
        if bar is not None:
            bar.close()
    report.input_formats = formats
    if args.json:
        _write_text(args.json, json.dumps(audit_json(report), indent=2))
    if args.requests_jsonl:
        _write_text(args.requests_jsonl, "".join(json.dumps(f.to_json()) + "\n" for f in report.requests))
    print(f"tokenizer: {tokenizer.name}")
    for name, fmt in formats.items():
        print(f"input: {FILE_FORMATS.get(fmt, fmt)}: {name}")
    print(format_audit(report))
    return 0


def _write_text(name: str, text: str) -> None:
    """Write ``text`` to ``name`` whole or not at all (a temporary file beside it, renamed over it)."""
    path = Path(name)
    if path.exists() and not path.is_file():  # /dev/stdout, a pipe
        path.write_text(text, encoding="utf-8")
        return
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        temporary.write_text(text, encoding="utf-8")
        temporary.replace(path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
