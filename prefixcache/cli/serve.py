"""``prefixcache serve``: an OpenAI-compatible HTTP server over the prefix cache (:mod:`prefixcache.serve`)."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import logging
from pathlib import Path
from typing import Any

from prefixcache.cli.options import QUANTIZE_CHOICES, QUANTIZE_HELP, parse_count, parse_size
from prefixcache.cli.tokenizer_choice import (
    DTYPE_HELP,
    MODEL_HELP,
    byte_vocab_warning,
    choose_tokenizer,
    model_source,
)
from prefixcache.errors import InvalidArgumentError, install_command

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "add_parser", "run", "served_runner"]

DEFAULT_MAX_REQUEST_BYTES = 32 << 20
"""``--max-request-bytes``'s default, :data:`prefixcache.serve.jobs.DEFAULT_MAX_REQUEST_BYTES` (a test keeps the two
equal), written here because importing the server imports torch, and ``--help`` should not."""


MIN_SNAPSHOT_EVERY_MIN = 0.1
"""The shortest ``--snapshot-every`` taken, in minutes (6 s)."""


def add_parser(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Add the ``serve`` subcommand to ``commands`` (the subparsers of the ``prefixcache`` parser)."""
    serve = commands.add_parser("serve", parents=parents, help="an OpenAI-compatible HTTP server over the prefix cache")
    serve.add_argument("--model", default="tiny", help=MODEL_HELP)
    serve.add_argument("--dtype", default="auto", metavar="DTYPE", help=DTYPE_HELP)
    serve.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none", help=QUANTIZE_HELP)
    serve.add_argument("--model-config", metavar="PATH", help="random-weight HF model built from a config.json")
    serve.add_argument("--layers", type=int, help="with --model-config: keep only the first N layers")
    serve.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="local HF tokenizer folder or .gguf file (default: the model's own: a GGUF file's, or the model folder's "
        "when it has one; else byte-level)",
    )
    serve.add_argument(
        "--served-model-name",
        help="the model id clients send (default: the preset, smollm2, the GGUF file's name without .gguf, or the "
        "name of the model or --model-config folder)",
    )
    serve_size = serve.add_mutually_exclusive_group()
    serve_size.add_argument(
        "--cache-tokens",
        type=parse_count,
        help="pool capacity in tokens (default: a quarter of the free memory, at most --max-running sessions of the "
        "model's context)",
    )
    serve_size.add_argument("--cache-memory", type=parse_size, help="pool capacity in bytes of KV, e.g. 512MiB")
    serve_size.add_argument(
        "--memory-fraction",
        type=float,
        help="default pool: this share of the memory available after loading the model, for K/V only (default "
        "0.25; unlike vLLM's --gpu-memory-utilization, a share of the total for weights and K/V)",
    )
    serve.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    serve.add_argument(
        "--max-batch-tokens",
        type=parse_count,
        default=512,
        help="tokens one batched forward takes: decode rows first, then prefill chunks (vLLM's "
        "--max-num-batched-tokens; default 512)",
    )
    serve.add_argument(
        "--speculate",
        choices=("off", "tree"),
        default="off",
        help="speculative decoding of greedy requests: 'tree' verifies drafts taken from the request's own context "
        "and the cached sequences of its namespace, several tokens a forward, output unchanged (default off)",
    )
    serve.add_argument(
        "--max-running",
        type=parse_count,
        default=32,
        help="requests running at once; more wait in the queue (vLLM's --max-num-seqs; default 32)",
    )
    serve.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine in a process of its own (the default), so that HTTP and streaming never hold its GIL, "
        "as vLLM's engine core; --no-engine-process: on a thread of the server's process (a second less to start, "
        "one copy of the tokenizer and of torch's memory)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this host only)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    serve.add_argument(
        "--max-request-bytes",
        type=parse_size,
        default=DEFAULT_MAX_REQUEST_BYTES,
        metavar="BYTES",
        help="largest request body read, e.g. 64MiB; a larger one is answered 413 in OpenAI's error shape, unread "
        f"(default {DEFAULT_MAX_REQUEST_BYTES >> 20}MiB)",
    )
    serve.add_argument(
        "--api-keys",
        metavar="FILE",
        help="one 'KEY [NAMESPACE]' per line; each key gets its own cache namespace (/health and /metrics stay open)",
    )
    serve.add_argument(
        "--snapshot",
        metavar="DIR",
        help="restore the cache from this snapshot folder at start (cold if missing or refused, saying why) and "
        "save it there on a clean shutdown (needs prefixcache[snapshot])",
    )
    serve.add_argument(
        "--snapshot-every",
        metavar="MIN",
        type=float,
        help="also save the snapshot every MIN minutes, a number of at least 0.1 (needs --snapshot)",
    )


def _default_model_name(args: argparse.Namespace) -> str:
    """The id ``serve`` answers to without ``--served-model-name``: the model's (:attr:`ModelSource.name
    <prefixcache.models.sources.ModelSource.name>`), or for a ``--model-config`` file its folder's name when it is a
    ``config.json``, else its stem."""
    if args.model_config:
        path = Path(args.model_config).resolve()
        if path.name == "config.json":
            return path.parent.name
        return path.stem if path.is_file() else path.name
    return model_source(args).name


def run(args: argparse.Namespace) -> int:
    """Build the model and serve it until interrupted; 0.  Raises InvalidArgumentError for conflicting options, a
    ``--cache-tokens`` below one block, or a missing extra."""
    try:
        from prefixcache.serve import ApiKeys, create_app, serve_forever
    except ImportError as error:
        raise InvalidArgumentError(f"{error}; the server needs: {install_command('server')}") from None
    if args.layers is not None and not args.model_config:
        raise InvalidArgumentError("--layers needs --model-config")
    from prefixcache.cache.pool import check_block_size

    check_block_size(args.block_size)  # first: the advice below names a block size that must itself be valid
    if args.cache_tokens is not None and args.cache_tokens < args.block_size:
        # The pool would round it up to one block: a server holding no useful cache, hard to tell from a typo.
        raise InvalidArgumentError(
            f"--cache-tokens {args.cache_tokens} is less than one block of {args.block_size} tokens (--block-size); "
            f"give at least {args.block_size}"
        )
    if args.max_request_bytes < 1:
        raise InvalidArgumentError(f"--max-request-bytes must be at least 1 byte, got {args.max_request_bytes}")
    if args.snapshot_every is not None and (
        args.snapshot is None or not MIN_SNAPSHOT_EVERY_MIN <= args.snapshot_every < float("inf")
    ):
        raise InvalidArgumentError(
            f"--snapshot-every needs --snapshot and a finite number of minutes, at least {MIN_SNAPSHOT_EVERY_MIN} "
            f"(a save writes every cached block: more often, saving would be all the engine does), got "
            f"{args.snapshot_every}"
        )
    if args.snapshot is not None and importlib.util.find_spec("safetensors") is None:
        raise InvalidArgumentError(f"--snapshot needs safetensors: {install_command('snapshot')}")
    if args.snapshot is not None and Path(args.snapshot).exists() and not Path(args.snapshot).is_dir():
        raise InvalidArgumentError(f"--snapshot {args.snapshot}: is a file; give a folder (made if missing)")
    from prefixcache.models.sources import parse_dtype

    parse_dtype(args.dtype)  # here, not only in an engine process: a typo is one line before anything loads
    source = model_source(args)  # likewise a missing path, an uninstalled smollm2 or extra
    if source is not None and source.kind != "preset":
        from prefixcache.models.loading import require_hf

        require_hf(source)
    keys = ApiKeys.from_file(args.api_keys) if args.api_keys else None
    if args.engine_process:
        from prefixcache.engine.process import EngineProcess

        served: Any = EngineProcess(
            functools.partial(served_runner, args),
            max_batch_tokens=args.max_batch_tokens,
            max_running=args.max_running,
            speculate=args.speculate,
        )
        described = served.note
    else:
        served, described = served_runner(args)
    # What was restored, or why the cache starts cold, is worth a line at the default verbosity.
    logging.getLogger("prefixcache.serve.snapshots").setLevel(logging.INFO)
    name = args.served_model_name or _default_model_name(args)
    every_s = None if args.snapshot_every is None else 60.0 * args.snapshot_every
    app = create_app(
        served,
        model_name=name,
        api_keys=keys,
        snapshot_dir=args.snapshot,
        snapshot_every_s=every_s,
        max_batch_tokens=args.max_batch_tokens,
        max_running=args.max_running,
        speculate=args.speculate,
        max_request_bytes=args.max_request_bytes,
    )

    def announce(url: str) -> None:
        print(f"serving {name!r} at {url}/v1 ({described})", flush=True)

    serve_forever(app, args.host, args.port, log_level="warning" if args.verbose == 0 else "info", announce=announce)
    return 0


def served_runner(args: argparse.Namespace) -> tuple[Any, str]:
    """The runner ``serve`` serves, built from its options (model, tokenizer, pool size), and the start line's
    description of its pool and tokenizer.  Module-level so that an engine process (``serve``'s default) builds it
    there (the options are pickled).  Raises InvalidArgumentError for a missing extra or a pool too large for
    memory."""
    from prefixcache.engine.pool_size import (
        DEFAULT_MEMORY_FRACTION,
        check_default_pool,
        default_pool_size,
        describe_pool,
    )
    from prefixcache.engine.runner import PrefixCachingRunner

    source = model_source(args)
    try:
        tokenizer, choice, model = _load(args, source)
    except ImportError as error:
        raise InvalidArgumentError(f"{error}; Hugging Face models need: {install_command('hf')}") from None
    if tokenizer is None:
        preset = source is not None and source.kind == "preset"
        warning = byte_vocab_warning(args.model, preset, args.model_config, model.vocab_size)
        if warning:
            logging.getLogger(__name__).warning(warning)
    cache_tokens, bound = args.cache_tokens, "--cache-tokens" if args.cache_memory is None else "--cache-memory"
    if cache_tokens is None and args.cache_memory is None:
        fraction = DEFAULT_MEMORY_FRACTION if args.memory_fraction is None else args.memory_fraction
        sized = default_pool_size(model, args.block_size, memory_fraction=fraction, sessions=args.max_running)
        pool_warning = check_default_pool(sized, args.block_size)
        if pool_warning:
            logging.getLogger(__name__).warning(pool_warning)
        by_memory = sized.bound == "memory"
        bound = f"{fraction:g} of the free memory" if by_memory else f"{args.max_running} x the model's context"
        cache_tokens = sized.num_tokens
    try:
        runner = PrefixCachingRunner(
            model, tokenizer, cache_tokens=cache_tokens, cache_memory=args.cache_memory, block_size=args.block_size
        )
    except (MemoryError, RuntimeError) as error:  # torch's allocators raise RuntimeError (OutOfMemoryError on CUDA)
        if not isinstance(error, MemoryError) and "allocat" not in str(error) and "out of memory" not in str(error):
            raise
        raise InvalidArgumentError(
            f"the KV pool does not fit in memory ({bound}): {str(error).splitlines()[0]}; give a smaller "
            "--cache-tokens or --cache-memory"
        ) from None
    described = describe_pool(runner.pool, model.max_position, bound)
    return runner, f"{_describe_model(source, model, runner.pool)}; {described}; tokenizer {choice.describe()}"


def _describe_model(source: Any, model: Any, pool: Any) -> str:
    """The start line's model part: where it came from and the dtypes of its weights and of the K/V pool, e.g.
    ``GGUF PATH, weights bfloat16, K/V bfloat16``, or ``weights int8 (per channel) over float32, K/V float32`` for a
    quantized model (``--quantize``)."""
    origin = "random weights of --model-config" if source is None else source.describe()
    quantized = getattr(model, "quantization", None)
    weights = _name(model.dtype) if quantized is None else f"{quantized.describe()} over {_name(model.dtype)}"
    return f"{origin}, weights {weights}, K/V {_name(pool.dtype)}"


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _load(args: argparse.Namespace, source: Any) -> tuple[Any, Any, Any]:
    """The tokenizer (None: the byte tokenizer), its :class:`TokenizerChoice` and the model ``serve`` runs."""
    choice = choose_tokenizer(args.tokenizer, source)
    if not args.model_config:
        from prefixcache.engine.runner import load_pretrained

        model, tokenizer = load_pretrained(source, dtype=args.dtype, tokenizer=choice.path, quantize=args.quantize)
        return tokenizer, choice, model
    import torch

    from prefixcache.models.hf import random_model_from_config
    from prefixcache.models.sources import parse_dtype

    model = random_model_from_config(
        args.model_config, layers=args.layers, dtype=parse_dtype(args.dtype) or torch.float32
    )
    if args.quantize != "none":
        model.quantize(args.quantize)
    if choice.path is None:
        return None, choice, model
    from prefixcache.chat.hf_tokenizer import HFTokenizer

    return HFTokenizer(choice.path), choice, model
