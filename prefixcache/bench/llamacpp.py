"""The ``llamacpp`` benchmark (``prefixcache bench llamacpp``): prefixcache's server beside llama.cpp's, on the same
GGUF file at the same precision class, the same prompt token ids, the same threads, both started and stopped here.

For each precision (``--precision``, default float32, bfloat16, int8 and int4; :mod:`prefixcache.bench.precision`)
the model's GGUF (``--model``, default ``smollm2``) is rewritten by llama.cpp's ``llama-quantize`` as F32, BF16, Q8_0
or Q4_0 (:mod:`prefixcache.bench.llamacpp_gguf`); llama-server reads that file as it is, ``prefixcache serve`` reads
it dense and applies ``--dtype`` / ``--quantize`` (:mod:`prefixcache.bench.llamacpp_process`: each in a process
group of its own on a free loopback port, :data:`LlamaCppSetup.threads` threads, one slot / one running request, a
context of :attr:`LlamaCppSetup.context` tokens).  Then, through their HTTP APIs
(:mod:`prefixcache.bench.llamacpp_client`), repeats interleaved (the order alternating), medians:

- prefill: a fresh prompt of ``prefill_tokens`` random ids each repeat (uncached on both sides), one token
  generated; prompt tokens per second over the request's time (the time to the first token);
- decode: a prompt of ``decode_context`` random ids (cached after an untimed first request on both sides), then
  a request for ``decode_tokens`` greedy tokens (end of sequence ignored) and one for a single token, back to back;
  ``decode_tokens - 1`` steps over the difference of their times (both servers hold back a token that ends inside
  a UTF-8 character, so a stream's events do not time single steps);
- resident memory of each server's process group (ours: the HTTP process and its engine process) after the decode
  rows, at the same model, precision class and context.

Ratios are ours / llama.cpp: above 1 we are faster (tokens/s), below 1 we hold less (memory).  Where no
``llama-server`` is found (:mod:`prefixcache.bench.llamacpp_find`) the benchmark prints why and returns no table.
The figures are wall time on a machine the two servers share with whatever else runs: the 1-minute load average
before and after is printed with them.  On a machine with more runnable threads than cores, ``--threads 1`` is the
fair setting: llama.cpp's threads meet at a barrier after every operation, and one thread descheduled makes the other
wait out its time slice (on this project's 2-core VM at load 4-5, SmolLM2 Q8_0 at 512 tokens of context decoded at
45-54 tokens/s with one thread and 2.6-16 with two, in the same minute).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from prefixcache.bench.common import BenchResult, Table
from prefixcache.bench.llamacpp_client import LLAMA_CPP, PREFIXCACHE, timed_completion
from prefixcache.bench.llamacpp_find import find_llama_quantize, find_llama_server
from prefixcache.bench.llamacpp_gguf import gguf_of_type
from prefixcache.bench.llamacpp_process import (
    ServerProcess,
    free_port,
    llama_server_command,
    prefixcache_serve_command,
)
from prefixcache.bench.precision import Precision, parse_precision
from prefixcache.errors import InvalidArgumentError

__all__ = ["DEFAULT_PRECISIONS", "FULL", "QUICK", "LlamaCppSetup", "random_prompt", "run"]

DEFAULT_PRECISIONS = ("float32", "bfloat16", "int8", "int4")
FIRST_ID = 256
"""Prompt ids are drawn from ``FIRST_ID`` up to the vocabulary's size: above the special and byte tokens."""


@dataclass(frozen=True, slots=True)
class LlamaCppSetup:
    """Sizes of one run, in tokens: the uncached prompt of the prefill rows, the cached context and the tokens of the
    decode rows, the servers' context (``-c``, ``--cache-tokens``); interleaved ``repeats``; ``threads`` of each
    server."""

    prefill_tokens: int = 1024
    decode_context: int = 2048
    decode_tokens: int = 32
    repeats: int = 3
    threads: int = 2
    context: int = 4096


FULL = LlamaCppSetup()
QUICK = LlamaCppSetup(prefill_tokens=64, decode_context=128, decode_tokens=4, repeats=1, context=512)


def random_prompt(vocab: int, length: int, seed: int) -> list[int]:
    """``length`` ids in ``FIRST_ID .. vocab - 1`` from a generator seeded with ``seed`` (the global RNG untouched).
    Raises InvalidArgumentError for a vocabulary not above :data:`FIRST_ID`."""
    if vocab <= FIRST_ID:
        raise InvalidArgumentError(f"a vocabulary of {vocab} ids leaves none above {FIRST_ID} for the prompts")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ID, vocab, (length,), generator=gen).tolist()


def _vocab_size(gguf: Path) -> int:
    """Tokens in the GGUF's vocabulary (``tokenizer.ggml.tokens``).  Raises InvalidArgumentError where it has none."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).fields.get("tokenizer.ggml.tokens")
    if field is None:
        raise InvalidArgumentError(f"{gguf} holds no tokenizer.ggml.tokens: no vocabulary to draw prompts from")
    return len(field.data)


def _source_gguf(model: str | os.PathLike[str]) -> Path:
    """The GGUF file ``model`` names (``smollm2``, a ``.gguf`` file, a folder holding one).  Raises
    InvalidArgumentError for any other model (llama.cpp reads GGUF only)."""
    from prefixcache.models.sources import resolve_model

    source = resolve_model(str(model))
    if source.kind != "gguf":
        raise InvalidArgumentError(f"bench llamacpp needs a GGUF model (llama.cpp reads no other), got {model!r}")
    return Path(source.location)


def _interleaved(calls: dict[str, object], repeats: int) -> dict[str, list]:
    """Each of ``calls`` (name -> ``fn(rep)``) once per repeat, the order reversed every other repeat."""
    names = list(calls)
    out: dict[str, list] = {name: [] for name in names}
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else reversed(names):
            out[name].append(calls[name](rep))
    return out


def measure_precision(precision: Precision, gguf: Path, server_binary: Path, setup: LlamaCppSetup, logs: Path) -> dict:
    """Both servers on ``gguf`` at ``precision``: the prefill and decode figures of each (medians and every repeat),
    their resident bytes, the llama.cpp server's own timings.  Both servers are stopped on return and on error."""
    vocab = _vocab_size(gguf)
    ports = {PREFIXCACHE: free_port(), LLAMA_CPP: free_port()}
    with contextlib.ExitStack() as stack:
        ours = ServerProcess(
            "prefixcache serve",
            prefixcache_serve_command(gguf, precision, ports[PREFIXCACHE], setup.context),
            ports[PREFIXCACHE],
            logs / f"prefixcache-{precision.name}.log",
            env={"OMP_NUM_THREADS": str(setup.threads)},
        )
        theirs = ServerProcess(
            "llama-server",
            llama_server_command(server_binary, gguf, ports[LLAMA_CPP], setup.threads, setup.context),
            ports[LLAMA_CPP],
            logs / f"llama-server-{precision.name}.log",
        )
        for server in (ours, theirs):
            stack.enter_context(server)
            server.start()
        warm = random_prompt(vocab, 16, seed=10_000)
        for kind in ports:
            timed_completion(kind, ports[kind], warm, 2)  # first-touch costs off the timed rows

        def prefill(kind: str):
            return lambda rep: timed_completion(kind, ports[kind], random_prompt(vocab, setup.prefill_tokens, rep), 1)

        prefills = _interleaved({kind: prefill(kind) for kind in ports}, setup.repeats)
        context = random_prompt(vocab, setup.decode_context, seed=20_000)
        for kind in ports:
            timed_completion(kind, ports[kind], context, 1)  # the context cached on both sides

        def decode(kind: str):
            def pair(_rep: int) -> tuple:
                many = timed_completion(kind, ports[kind], context, setup.decode_tokens)
                return many, timed_completion(kind, ports[kind], context, 1)

            return pair

        decodes = _interleaved({kind: decode(kind) for kind in ports}, setup.repeats)
        resident = {PREFIXCACHE: ours.resident_parts(), LLAMA_CPP: theirs.resident_parts()}
    out: dict = {"precision": precision.name, "gguf_type": precision.gguf_type, "gguf": str(gguf), "sides": {}}
    for kind in ports:
        prefill_tps = [setup.prefill_tokens / c.seconds for c in prefills[kind]]
        steps = setup.decode_tokens - 1
        decode_tps = [steps / max(many.seconds - one.seconds, 1e-9) for many, one in decodes[kind]]
        out["sides"][kind] = {
            "prefill_tokens_per_s": statistics.median(prefill_tps),
            "prefill_runs": prefill_tps,
            "prefill_prompt_tokens": [c.prompt_tokens for c in prefills[kind]],
            "decode_tokens_per_s": statistics.median(decode_tps),
            "decode_runs": decode_tps,
            "decode_cached_tokens": [one.cached_tokens for _many, one in decodes[kind]],
            "resident_bytes": sum(size for _pid, _name, size in resident[kind]) if resident[kind] else None,
            "resident_parts": [{"pid": pid, "name": name, "bytes": size} for pid, name, size in resident[kind]],
            "server_timings": [c.server_timings for c in prefills[kind] if c.server_timings]
            + [many.server_timings for many, _one in decodes[kind] if many.server_timings],
        }
    return out


def _rows(result: dict, setup: LlamaCppSetup) -> list[tuple]:
    ours, theirs = result["sides"][PREFIXCACHE], result["sides"][LLAMA_CPP]
    label = f"{result['precision']} / {result['gguf_type']}"
    rows = []
    for measure, key in (
        (f"prefill {setup.prefill_tokens:,} (tokens/s)", "prefill_tokens_per_s"),
        (f"decode at {setup.decode_context:,} (tokens/s)", "decode_tokens_per_s"),
    ):
        rows.append((label, measure, f"{ours[key]:.1f}", f"{theirs[key]:.1f}", f"{ours[key] / theirs[key]:.2f}"))
    a, b = ours["resident_bytes"], theirs["resident_bytes"]
    if a is not None and b is not None:
        parts = " + ".join(f"{part['bytes'] / 2**20:,.0f}" for part in ours["resident_parts"])
        ours_cell = f"{a / 2**20:,.0f} ({parts})" if len(ours["resident_parts"]) > 1 else f"{a / 2**20:,.0f}"
        rows.append((label, "resident memory (MiB)", ours_cell, f"{b / 2**20:,.0f}", f"{a / b:.2f}"))
    return rows


def _skipped(reason: str) -> BenchResult:
    print(f"llamacpp: skipped: {reason}", end="\n\n", flush=True)
    return BenchResult("llamacpp", (), {"skipped": reason})


def run(
    quick: bool = False,
    llama_server: str | os.PathLike[str] | None = None,
    model: str | os.PathLike[str] = "smollm2",
    precisions: tuple[str, ...] | None = None,
    cache_dir: Path | None = None,
    threads: int | None = None,
) -> BenchResult:
    """Measure both servers at each of ``precisions`` (default :data:`DEFAULT_PRECISIONS`) on ``model``'s GGUF and
    tabulate; without a ``llama-server`` (``llama_server``, ``$LLAMA_SERVER``, ``PATH``) or ``llama-quantize``, print
    why and return no table.  ``cache_dir``: where the GGUF of each class is made (:func:`gguf_of_type`);
    ``threads``: of each server (default :attr:`LlamaCppSetup.threads`).

    Raises InvalidArgumentError: an unknown precision, threads below 1, a model that is no GGUF, a server that does
    not start or a request it refuses (both servers are stopped first)."""
    chosen = tuple(parse_precision(name) for name in (precisions or DEFAULT_PRECISIONS))
    setup = QUICK if quick else FULL
    if threads is not None:
        if threads < 1:
            raise InvalidArgumentError(f"threads must be >= 1, got {threads}")
        setup = replace(setup, threads=threads)
    server = find_llama_server(llama_server)
    if server.path is None:
        return _skipped(server.reason)
    quantize = find_llama_quantize(server.path)
    if quantize.path is None:
        return _skipped(f"{quantize.reason} (it writes the GGUF file of each precision class)")
    source = _source_gguf(model)
    load_before = os.getloadavg()[0]
    results, rows = [], []
    with tempfile.TemporaryDirectory(prefix="prefixcache-llamacpp-logs-") as logs:
        for precision in chosen:
            gguf = gguf_of_type(source, precision.gguf_type, quantize.path, cache_dir)
            results.append(measure_precision(precision, gguf, server.path, setup, Path(logs)))
            rows += _rows(results[-1], setup)
    load_after = os.getloadavg()[0]
    table = Table(
        title=(
            f"llamacpp: prefixcache serve vs llama.cpp's llama-server ({server.path.name}), {source.name} rewritten "
            f"per precision class, {setup.threads} threads each, {'quick' if quick else 'full'}"
        ),
        headers=("precision (ours / llama.cpp file)", "measure", "ours", "llama.cpp", "ours / llama.cpp"),
        rows=tuple(rows),
        notes=(
            f"wall time on the client, medians of {setup.repeats} interleaved repeats; prefill: a fresh prompt of "
            "random ids each repeat, one token, prompt tokens / request time; decode: requests of "
            f"{setup.decode_tokens} and of 1 greedy token behind the same cached context (end of sequence ignored), "
            f"{setup.decode_tokens - 1} / the difference of their times",
            "resident memory: each server's process group after the decode rows (ours: the sum, then the server's and "
            "its engine process's), "
            f"context {setup.context:,} tokens on both (llama.cpp's K/V in f16, ours in the precision's dtype); "
            "ratios: tokens/s above 1 = ours faster, memory below 1 = ours smaller",
            f"1-minute load average {load_before:.2f} before, {load_after:.2f} after",
        ),
    )
    data = {"setup": asdict(setup), "server": str(server.path), "source": str(source), "results": results}
    data["load_average"] = [load_before, load_after]
    return BenchResult("llamacpp", (table,), data)
