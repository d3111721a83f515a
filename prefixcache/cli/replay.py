"""``prefixcache replay``: replay chat transcripts or traces through the cache and report prefill savings."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path
from typing import Any

from prefixcache.cli.options import QUANTIZE_CHOICES, QUANTIZE_HELP, parse_count, parse_size
from prefixcache.cli.replay_inputs import check_inputs_exist, piped, piped_inputs_as_files
from prefixcache.cli.replay_outputs import check_outputs, write_replay
from prefixcache.cli.tokenizer_choice import (
    DTYPE_HELP,
    MODEL_HELP,
    byte_vocab_warning,
    choose_tokenizer,
    model_source,
)
from prefixcache.errors import InvalidArgumentError, install_command
from prefixcache.replay.endpoint import add_endpoint_arguments

SPECULATE_CHOICES = ("off", "context", "tree")
"""``--speculate``'s choices: :data:`prefixcache.replay.speculate.SPECULATE_MODES` (a test keeps the two equal)."""

KV_DTYPE_CHOICES = ("bf16", "fp16", "fp32", "fp8")
"""The K/V element types a sweep sizes bytes for (prefixcache.replay.sweep_report.KV_DTYPES; kept here so that
``--help`` imports no torch)."""

__all__ = ["DEFAULT_PREFILL_CHUNK", "DEFAULT_STATE_EVERY", "add_parser", "run"]

DEFAULT_PREFILL_CHUNK = 512
"""``--prefill-chunk``'s default: :data:`prefixcache.replay.replayer.DEFAULT_PREFILL_CHUNK_TOKENS` (a test keeps the
two equal), written here so that ``--help`` imports no torch."""

DEFAULT_STATE_EVERY = 16
"""``--state-every``'s default: ``prefixcache.cache.resume.DEFAULT_STATE_INTERVAL_BLOCKS``, the engine's interval
(a test keeps the two equal), written here because importing the cache layer imports torch, and ``--help`` should
not."""


def add_parser(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Add the ``replay`` subcommand to ``commands`` (the subparsers of the ``prefixcache`` parser)."""
    replay = commands.add_parser(
        "replay", parents=parents, help="replay transcripts, request logs or traces and report prefill savings"
    )
    replay.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="input files (chat transcripts, request logs, OpenAI Batch, ShareGPT or Mooncake traces; JSON Lines "
        "or one JSON array; see --format), or folders of *.jsonl files",
    )
    replay.add_argument("--model", default="tiny", help=MODEL_HELP)
    replay.add_argument("--dtype", default="auto", metavar="DTYPE", help=DTYPE_HELP)
    replay.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none", help=QUANTIZE_HELP)
    replay.add_argument("--model-config", metavar="PATH", help="random-weight HF model built from a config.json")
    replay.add_argument("--layers", type=int, help="with --model-config: keep only the first N layers")
    replay.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="local HF tokenizer folder or .gguf file (default: the model's own: a GGUF file's, or the model folder's "
        "when it has one; else byte-level)",
    )
    replay.add_argument(
        "--chat-template", metavar="FILE", help="Jinja chat template for the HF tokenizer (instead of the folder's own)"
    )
    replay.add_argument("--no-model", action="store_true", help="cache accounting only, no model (fast)")
    replay.add_argument("--block-size", type=int, default=16, help="tokens per KV block (1..256, default 16)")
    size = replay.add_mutually_exclusive_group()
    size.add_argument("--cache-tokens", type=parse_count, help="pool capacity in tokens (default: unlimited)")
    size.add_argument("--cache-memory", type=parse_size, help="pool capacity in bytes of KV, e.g. 512MiB")
    host = replay.add_mutually_exclusive_group()
    host.add_argument(
        "--host-cache-tokens", type=parse_count, help="host-memory tier in tokens for evicted blocks (default none)"
    )
    host.add_argument("--host-cache-memory", type=parse_size, help="host-memory tier in bytes of KV, e.g. 4GiB")
    recurrent = replay.add_argument_group("recurrent models (with --no-model)")
    recurrent.add_argument(
        "--state-bytes",
        type=parse_size,
        metavar="BYTES",
        help="model a hybrid/recurrent model whose state snapshot costs BYTES: a prefix resumes only where a state "
        "is kept (the end of every prompt and answer, before a prompt's last token, every --state-every blocks, and "
        "where an earlier request parted from a cached prompt), e.g. 37.7MiB",
    )
    recurrent.add_argument(
        "--state-every",
        type=int,
        default=DEFAULT_STATE_EVERY,
        metavar="N",
        help="with --state-bytes: also keep a state every N blocks inside prompts, as the engine does (default 16; "
        "0: only at prompt and answer ends, before a prompt's last token and at branch points)",
    )
    recurrent.add_argument(
        "--max-state-bytes",
        type=parse_size,
        metavar="BYTES",
        help="with --state-bytes: budget of the kept states, those of least value evicted: tokens resumed per byte, "
        "uses and recency (default: unlimited)",
    )
    replay.add_argument("--policy", default="lru", choices=["lru", "lfu"], help="eviction policy (default lru)")
    replay.add_argument("--verify", action="store_true", help="check every request against the no-cache reference")
    replay.add_argument(
        "--prefill-chunk",
        type=int,
        default=DEFAULT_PREFILL_CHUNK,
        metavar="TOKENS",
        help="with a model: tokens per prefill forward, the bar showing each and Ctrl-C acting between them "
        f"(default {DEFAULT_PREFILL_CHUNK}, as serve's --max-batch-tokens; 0: a whole prompt per forward)",
    )
    replay.add_argument(
        "--no-baseline",
        action="store_true",
        help="with a model: skip timing each prompt's prefill without the cache (half the time; no speed-up)",
    )
    replay.add_argument(
        "--order",
        default="round-robin",
        choices=["round-robin", "random", "file"],
        help="how conversations interleave: turn by turn (default), seeded random, or each whole in file order",
    )
    replay.add_argument("--seed", type=int, default=0, help="seed of --order random (default 0)")
    replay.add_argument(
        "--limit", type=parse_count, help="replay only the first N conversations (trace lines) per file"
    )
    replay.add_argument(
        "--format",
        default="auto",
        choices=["auto", "chat", "requests", "batch", "sharegpt", "mooncake"],
        dest="file_format",
        help="file format (default auto: told from the first line; requests: a chat-completions body per line)",
    )
    replay.add_argument("--skip-invalid", action="store_true", help="skip bad lines (reported) instead of failing")
    replay.add_argument("--json", metavar="OUT", help="write the report as JSON")
    replay.add_argument("--requests-jsonl", metavar="OUT", help="write one JSON line of usage per request")
    replay.add_argument(
        "--explain", action="store_true", help="show where requests diverge from the cache (token, message, text)"
    )
    replay.add_argument("--plot", metavar="OUT.png", help="draw hit rate vs ideal and pool occupancy (matplotlib)")
    replay.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    replay.add_argument(
        "--wide", action="store_true", help="every column of the table (default: a compact one within 120 columns)"
    )
    speculate = replay.add_argument_group("speculative decoding drafted from the cache (recorded answers)")
    speculate.add_argument(
        "--speculate",
        choices=SPECULATE_CHOICES,
        help="predict decoding with drafts from each request's context, then the cache's blocks (tree), from the "
        "context only (context), or not (off); default tree with --no-model, off with a model",
    )
    speculate.add_argument(
        "--verify-cost",
        metavar="C1,C2,...",
        help="cost of verifying 1, 2, ... draft tokens in decode steps (a longer draft costs the last; 1: as cheap "
        "as a decode step); default measured on the small preset at 2k context on a 2-core CPU",
    )
    sweep = replay.add_argument_group("every cache size in one pass (--sweep)")
    sweep.add_argument(
        "--sweep",
        action="store_true",
        help="LRU hit rate at every cache size in one pass (stack distances), Belady's bound and the knee",
    )
    sweep.add_argument(
        "--sweep-at",
        type=parse_count,
        action="append",
        metavar="TOKENS",
        help="with --sweep: also the hit rate at a pool of TOKENS (rounded up to whole blocks), e.g. 8192; "
        "repeat for more sizes (the table and --json hold them)",
    )
    sweep.add_argument(
        "--kv-dtype",
        choices=KV_DTYPE_CHOICES,
        default="bf16",
        help="with --model-config: KV element type for bytes (default bf16)",
    )
    sweep.add_argument("--no-belady", action="store_true", help="skip Belady's bound (one simulation per size)")
    sweep.add_argument(
        "--check-knee", action="store_true", help="also replay the radix tree at the knee's size (exact figure)"
    )
    sweep.add_argument(
        "--no-token-cache", action="store_true", help="tokenize again instead of reading the stored tokens"
    )
    add_endpoint_arguments(replay)


class _Progress:
    """Progress on stderr from the first second: a line per loading step, a tqdm bar per phase of each file."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def step(self, message: str) -> None:
        if self.enabled:
            print(f"{message} ...", file=sys.stderr, flush=True)

    def __call__(self, items, description: str, total: int | None, unit: str):
        if not self.enabled:
            return items
        from tqdm import tqdm

        return tqdm(items, total=total, desc=description, unit=unit, leave=False, file=sys.stderr, mininterval=0.2)


def _load_tokenizer(args: argparse.Namespace, progress: _Progress):
    """The Hugging Face tokenizer to replay with (:func:`~prefixcache.cli.tokenizer_choice.choose_tokenizer`:
    ``--tokenizer``, else the ``--model hf:PATH`` folder's own), or None for the byte tokenizer.

    Raises:
        InvalidArgumentError: ``--chat-template`` without a Hugging Face tokenizer, an unreadable template file, or
            a tokenizer without a chat template.
    """
    choice = choose_tokenizer(args.tokenizer, model_source(args))
    if args.chat_template and choice.path is None:
        raise InvalidArgumentError(
            "--chat-template needs --tokenizer or a --model with a tokenizer (a GGUF file, smollm2, or an hf:PATH "
            "folder holding one; the byte tokenizer has its own ChatML)"
        )
    if choice.path is None:
        return None
    progress.step(f"loading tokenizer {choice.describe()}")
    from prefixcache.chat.hf_tokenizer import HFTokenizer

    template = None
    if args.chat_template:
        try:
            template = Path(args.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise InvalidArgumentError(f"--chat-template {args.chat_template}: cannot read: {error}") from None
    tokenizer = HFTokenizer(choice.path, chat_template=template)
    if not tokenizer.has_chat_template:
        given = (
            f"--model {args.model}: the model folder's tokenizer"
            if choice.from_model_folder
            else (f"--tokenizer {args.tokenizer}: the folder")
        )
        raise InvalidArgumentError(
            f"{given} has no chat template (no chat_template in tokenizer_config.json, no chat_template.jinja); "
            "give one with --chat-template FILE (a Jinja file)"
        )
    return tokenizer


def _load_model(args: argparse.Namespace, progress: _Progress):
    if args.no_model:
        return None
    if args.model_config:
        from prefixcache.models.hf import random_model_from_config
        from prefixcache.models.sources import parse_dtype

        progress.step(f"building a random-weight model from {args.model_config}")
        dtype = parse_dtype(args.dtype)
        model = random_model_from_config(args.model_config, layers=args.layers, **({"dtype": dtype} if dtype else {}))
        if args.quantize != "none":
            model.quantize(args.quantize)
        return model
    from prefixcache.models.loading import load_source

    source = model_source(args)
    progress.step(f"loading model {source.describe()}" if source.kind != "preset" else f"building model {args.model}")
    return load_source(source, args.dtype, quantize=args.quantize)


def run(args: argparse.Namespace) -> int:
    """The ``replay`` command: a sweep of every cache size with ``--sweep``
    (:mod:`prefixcache.replay.sweep_cli`), an audit of a server's cache with ``--endpoint``
    (:mod:`prefixcache.replay.audit`), else a replay."""
    from prefixcache.replay.sweep_cli import or_sweep

    if args.sweep_at and not args.sweep:
        raise InvalidArgumentError("--sweep-at needs --sweep")
    if args.sweep and (args.speculate is not None or args.verify_cost is not None):
        option = "--speculate" if args.speculate is not None else "--verify-cost"
        raise InvalidArgumentError(f"{option} predicts a replay's decoding; --sweep sizes the cache only: drop one")
    if args.no_model and not args.endpoint and (args.dtype != "auto" or args.quantize != "none"):
        option = f"--dtype {args.dtype}" if args.dtype != "auto" else f"--quantize {args.quantize}"
        raise InvalidArgumentError(f"{option} sets a model's precision: drop it with --no-model")
    piped_at = piped(args.paths)
    if piped_at and (args.endpoint or args.sweep):
        option = "--endpoint" if args.endpoint else "--sweep"
        raise InvalidArgumentError(f"{option} reads files only; save {args.paths[piped_at[0]]} to a file first")
    if args.endpoint:
        return _replay(args)
    return or_sweep(_replay, _load_tokenizer, _Progress)(args)


def _replay(args: argparse.Namespace) -> int:
    """Replay ``args.paths`` and print (and write) the report; 0, or 130 when interrupted with a partial report."""
    from prefixcache.replay.replayer import check_options

    progress = _Progress(not args.no_progress)
    if args.plot:
        from prefixcache.replay.plot import require_matplotlib

        require_matplotlib()  # fail before a long replay, not after it
    if args.layers is not None and not args.model_config:
        raise InvalidArgumentError("--layers needs --model-config")
    if not args.no_model and not args.endpoint:
        from prefixcache.models.sources import parse_dtype

        parse_dtype(args.dtype)  # a typo is one line before a model loads
    if args.prefill_chunk < 0:
        raise InvalidArgumentError(f"--prefill-chunk must be 0 (whole prompts) or more, got {args.prefill_chunk}")
    check_options(
        has_model=not args.no_model,
        cache_memory=args.cache_memory,
        verify=args.verify,
        host_cache_memory=args.host_cache_memory,
        state_bytes=args.state_bytes,
        state_every=args.state_every,
        max_state_bytes=args.max_state_bytes,
        host_tier=args.host_cache_tokens is not None or args.host_cache_memory is not None,
    )
    check_outputs(args)
    if args.speculate is None:  # recurrent models never speculate: their state cannot be rolled back
        args.speculate = "tree" if args.no_model and args.state_bytes is None else "off"
    elif args.speculate != "off" and args.state_bytes is not None:
        raise InvalidArgumentError(
            "--speculate models drafts a recurrent model never verifies: drop it with --state-bytes"
        )
    if args.verify_cost is not None and args.speculate == "off":
        raise InvalidArgumentError("--verify-cost needs --speculate context or tree")
    with piped_inputs_as_files(args):  # after the checks above: a long stdin is copied only for a run that goes on
        return _checked_replay(args, progress)


def _checked_replay(args: argparse.Namespace, progress: _Progress) -> int:
    """:func:`_replay` once its options are checked and its inputs are files."""
    from prefixcache.replay.replayer import Replayer, ReplayInterrupted, replay_paths
    from prefixcache.replay.requests import read_options
    from prefixcache.replay.speculate import parse_verify_cost

    check_inputs_exist(args.paths)
    if args.no_model or args.endpoint:  # no model runs here: nothing imports torch
        context: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    else:
        from prefixcache.models.loading import loading

        context = loading(model_source(args))
    try:
        with context:
            tokenizer = _load_tokenizer(args, progress)
            model = None if args.endpoint else _load_model(args, progress)
        if args.endpoint:
            from prefixcache.replay.audit import run_endpoint_replay

            return run_endpoint_replay(args, tokenizer, progress)
    except ImportError as error:
        raise InvalidArgumentError(f"{error}; Hugging Face models need: {install_command('hf')}") from None
    if model is not None and tokenizer is None:
        preset = not args.model_config and model_source(args).kind == "preset"
        warning = byte_vocab_warning(args.model, preset, args.model_config, model.vocab_size)
        if warning:
            logging.getLogger(__name__).warning(warning)
    replayer = Replayer(
        model,
        tokenizer,
        block_size=args.block_size,
        cache_tokens=args.cache_tokens,
        cache_memory=args.cache_memory,
        policy=args.policy,
        verify=args.verify,
        measure_uncached=not args.no_baseline,
        prefill_chunk_tokens=args.prefill_chunk or None,
        explain=args.explain,
        host_cache_tokens=args.host_cache_tokens,
        host_cache_memory=args.host_cache_memory,
        state_bytes=args.state_bytes,
        state_every=args.state_every,
        max_state_bytes=args.max_state_bytes,
        speculate=args.speculate,
        verify_cost=parse_verify_cost(args.verify_cost) if args.verify_cost is not None else None,
    )
    replayer.check_pool_memory()
    try:
        report = replay_paths(
            args.paths, replayer, **read_options(args, progress), log_requests=args.requests_jsonl is not None
        )
    except ReplayInterrupted as interrupted:
        report = interrupted.report
    names = getattr(args, "piped_names", {})  # a piped input is reported by its name, not its temporary copy's path
    for scenario in report.scenarios:
        scenario.scenario = names.get(scenario.scenario, scenario.scenario)
    for record in report.requests_log:
        record["scenario"] = names.get(record.get("scenario"), record.get("scenario"))
    if hasattr(model, "name"):
        report.model = model.name
    write_replay(args, report, replayer.tokenizer.name)
    if report.partial:
        print("interrupted: the report above covers the requests completed before Ctrl-C", file=sys.stderr)
        return 130
    return 0
