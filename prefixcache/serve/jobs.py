"""What the server's routes share about engine jobs: the callbacks that turn a request's tokens into stream events, the
event a finished request ends with, and ``n`` > 1 — several samples of one prompt, each its own engine request.

``n`` samples are submitted together: the first prefills the prompt and, under prefix-aware admission, the others
wait for it and then find it cached (each computes only the prompt's last position again), so the prompt is
prefilled once.  Sample i uses ``seed + i`` when a seed is given, so it is exactly what a request of that seed alone
returns; without a seed each sample draws from its own unseeded generator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from typing import Any

__all__ = ["deliveries", "ending", "merged_choices", "sample_request_id", "sample_seed"]


def deliveries(on_delta: Callable[[Any], None] | None, logprobs: int | None) -> dict[str, Any]:
    """:func:`submit_chat`'s callbacks for a job whose events go to ``on_delta``: each text delta as ``(text, the
    logprob records of the tokens since the previous delta)`` (``()`` when not asked).  On the engine thread."""
    if on_delta is None:
        return {}
    if logprobs is None:
        return {"on_delta": lambda text: on_delta((text, ()))}
    pending: list[Any] = []

    def delta(text: str) -> None:
        records = tuple(pending)
        pending.clear()
        on_delta((text, records))

    return {"on_delta": delta, "on_logprob": pending.append}


def ending(future: Future[Any]) -> tuple[str, Any]:
    """A finished request's event: ``("done", value)``, ``("error", exception)`` or ``("cancelled", None)``."""
    error = future.exception()
    if isinstance(error, CancelledError):
        return "cancelled", None
    return ("error", error) if error is not None else ("done", future.result())


def sample_seed(seed: int | None, sample: int) -> int | None:
    """The seed of sample ``sample`` (0 for the first) of a request of ``seed``: ``seed + sample``; None without one."""
    return None if seed is None else seed + sample


def sample_request_id(request_id: str, sample: int) -> str:
    """The engine request id of sample ``sample``: the request's for the first, ``"{request_id}-{sample}"`` after it,
    so that the samples' shared prompt counts as cache hits, not as one request's own retries (self-hits)."""
    return request_id if sample == 0 else f"{request_id}-{sample}"


def merged_choices(bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One response of ``n`` choices from the responses of its ``n`` samples (each with one choice): choice i is sample
    i's, ``index`` i; the usage counts the prompt once (sample 0's prompt and cached tokens) and the completion tokens
    of all samples."""
    body = dict(bodies[0])
    body["choices"] = [{**sample["choices"][0], "index": i} for i, sample in enumerate(bodies)]
    usage = body.get("usage")
    if usage is not None:
        generated = sum(sample["usage"]["completion_tokens"] for sample in bodies)
        body["usage"] = {**usage, "completion_tokens": generated, "total_tokens": usage["prompt_tokens"] + generated}
    return body
