"""The ``prefixcache`` command line: ``replay``, ``bench``, ``plan`` and ``serve``."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from prefixcache.cache.resume import DEFAULT_STATE_INTERVAL_BLOCKS
from prefixcache.errors import InvalidArgumentError, PrefixCacheError, VerificationError
from prefixcache.replay.audit import add_endpoint_arguments, run_endpoint_replay

logger = logging.getLogger("prefixcache")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "t": 10**12,
    "tb": 10**12,
}
_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
}


def parse_size(text: str) -> int:
    """Bytes from ``"512MiB"``, ``"24GiB"``, ``"1.5GB"`` or a plain number.

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MiB, 24GiB, 1e9)")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not value < 2**63:
        raise argparse.ArgumentTypeError(f"size too large: {text!r}")
    return int(value)


def parse_count(text: str) -> int:
    """A positive token count, also written ``1e6``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 1 <= value < 2**63 or value != int(value):
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text!r}")
    return int(value)


def _version() -> str:
    try:
        return importlib.metadata.version("prefixcache")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    from prefixcache.bench import BENCHMARKS

    parser = argparse.ArgumentParser(prog="prefixcache", description="Exact prefix caching for LLM inference.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    # -v after the subcommand too; its own dest, since a subcommand's namespace would overwrite the one before it.
    after = argparse.ArgumentParser(add_help=False)
    after.add_argument(
        "-v", "--verbose", action="count", default=0, dest="verbose_after", help="log more (-v info, -vv debug)"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    replay = commands.add_parser(
        "replay", parents=[after], help="replay chat transcripts or traces and report prefill savings"
    )
    replay.add_argument(
        "paths", nargs="+", metavar="PATH", help="scenario JSONL files (chat or Mooncake trace), or folders of them"
    )
    replay.add_argument(
        "--model", default="tiny", help="embedded preset tiny (default) or small, or hf:PATH (local HF model folder)"
    )
    replay.add_argument("--model-config", metavar="PATH", help="random-weight HF model built from a config.json")
    replay.add_argument("--layers", type=int, help="with --model-config: keep only the first N layers")
    replay.add_argument("--tokenizer", metavar="PATH", help="local HF tokenizer folder (default: byte tokenizer)")
    replay.add_argument(
        "--chat-template", metavar="FILE", help="Jinja chat template for --tokenizer (instead of the folder's own)"
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
        "is kept (the end of every prompt and answer, before a prompt's last token, every --state-every blocks), "
        "e.g. 37.7MiB",
    )
    recurrent.add_argument(
        "--state-every",
        type=int,
        default=DEFAULT_STATE_INTERVAL_BLOCKS,
        metavar="N",
        help="with --state-bytes: also keep a state every N blocks inside prompts, as the engine does (default 16; "
        "0: only at prompt and answer ends and before a prompt's last token)",
    )
    recurrent.add_argument(
        "--max-state-bytes",
        type=parse_size,
        metavar="BYTES",
        help="with --state-bytes: budget of the kept states, least recently used evicted (default: unlimited)",
    )
    replay.add_argument("--policy", default="lru", choices=["lru", "lfu"], help="eviction policy (default lru)")
    replay.add_argument("--verify", action="store_true", help="check every request against the no-cache reference")
    replay.add_argument(
        "--order",
        default="round-robin",
        choices=["round-robin", "random", "file"],
        help="how conversations interleave: turn by turn (default), seeded random, or each whole in file order",
    )
    replay.add_argument("--seed", type=int, default=0, help="seed of --order random (default 0)")
    replay.add_argument("--limit", type=parse_count, help="only the first N conversations (trace lines) per file")
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
    add_endpoint_arguments(replay)

    # serve joins the list where the server extra is installed (_run_bench adds it); find_spec imports nothing.
    with_serve = all(
        importlib.util.find_spec(m) is not None for m in ("fastapi", "uvicorn", "httpx", "prometheus_client")
    )
    names = ", ".join([*BENCHMARKS, *(["serve"] if with_serve else [])])
    bench = commands.add_parser("bench", parents=[after], help="run benchmarks and print figures")
    bench.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run: {names} (default all)")
    bench.add_argument("--quick", action="store_true", help="small sizes (seconds); figures are not judged")
    bench.add_argument("--json", metavar="OUT", help="write results as JSON")
    bench.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where the engine benchmark runs (default cpu)"
    )

    serve = commands.add_parser("serve", parents=[after], help="an OpenAI-compatible HTTP server over the prefix cache")
    serve.add_argument("--model", default="tiny", help="embedded preset tiny (default) or small, or hf:PATH")
    serve.add_argument("--model-config", metavar="PATH", help="random-weight HF model built from a config.json")
    serve.add_argument("--layers", type=int, help="with --model-config: keep only the first N layers")
    serve.add_argument("--tokenizer", metavar="PATH", help="local HF tokenizer folder (default: byte tokenizer)")
    serve.add_argument(
        "--served-model-name",
        help="the model id clients send (default: the preset, or the name of the hf:PATH or --model-config folder)",
    )
    serve_size = serve.add_mutually_exclusive_group()
    serve_size.add_argument("--cache-tokens", type=parse_count, help="pool capacity in tokens (default 65,536)")
    serve_size.add_argument("--cache-memory", type=parse_size, help="pool capacity in bytes of KV, e.g. 512MiB")
    serve.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    serve.add_argument(
        "--max-batch-tokens",
        type=parse_count,
        default=512,
        help="tokens one batched forward takes: decode rows first, then prefill chunks (vLLM's "
        "--max-num-batched-tokens; default 512)",
    )
    serve.add_argument(
        "--max-running",
        type=parse_count,
        default=32,
        help="requests running at once; more wait in the queue (vLLM's --max-num-seqs; default 32)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this host only)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
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
        help="also save the snapshot every MIN minutes (needs --snapshot)",
    )

    plan = commands.add_parser("plan", parents=[after], help="how many tokens and blocks of KV fit in a memory budget")
    plan.add_argument("--layers", type=int, required=True, help="transformer layers of the model")
    plan.add_argument("--kv-heads", type=int, required=True, help="KV heads per layer (GQA: fewer than query heads)")
    plan.add_argument("--head-dim", type=int, required=True, help="dimension of one attention head")
    plan.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES), help="KV element type (default bf16)")
    plan.add_argument("--memory", type=parse_size, required=True, help="KV budget, e.g. 24GiB")
    plan.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    return parser


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


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before any work, an output that cannot be written: a missing folder, a folder given as the file,
    a plot format matplotlib does not know, two outputs (or an output and an input) on one path."""
    outputs = {"--json": args.json, "--requests-jsonl": args.requests_jsonl, "--plot": args.plot}
    seen: dict[Path, str] = {Path(p).resolve(): "an input" for p in args.paths}
    for folder in (Path(p) for p in args.paths if Path(p).is_dir()):
        seen.update((p.resolve(), "an input") for p in folder.glob("*.jsonl"))  # replayed as inputs too
    for option, value in outputs.items():
        if value is None:
            continue
        if not value.strip():
            raise InvalidArgumentError(f"{option}: empty file name")
        path = Path(value)
        folder = path.parent
        if path.is_dir():
            raise InvalidArgumentError(f"{option} {value}: is a folder; give a file name")
        if not folder.is_dir():
            raise InvalidArgumentError(f"{option} {value}: folder {str(folder)!r} does not exist")
        if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise InvalidArgumentError(f"{option} {value}: not writable")
        if path.resolve() in seen:
            raise InvalidArgumentError(f"{option} {value}: the same file as {seen[path.resolve()]}")
        seen[path.resolve()] = option
    if args.plot:
        from prefixcache.replay.plot import check_plot_path

        check_plot_path(args.plot)


def _load_tokenizer(args: argparse.Namespace, progress: _Progress):
    if args.chat_template and not args.tokenizer:
        raise InvalidArgumentError("--chat-template needs --tokenizer (the byte tokenizer has its own ChatML)")
    if not args.tokenizer:
        return None
    progress.step(f"loading tokenizer {args.tokenizer}")
    from prefixcache.chat.hf_tokenizer import HFTokenizer

    template = None
    if args.chat_template:
        try:
            template = Path(args.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise InvalidArgumentError(f"--chat-template {args.chat_template}: cannot read: {error}") from None
    tokenizer = HFTokenizer(args.tokenizer, chat_template=template)
    if not tokenizer.has_chat_template:
        raise InvalidArgumentError(
            f"--tokenizer {args.tokenizer}: the folder has no chat template (no chat_template in "
            "tokenizer_config.json, no chat_template.jinja); give one with --chat-template FILE (a Jinja file)"
        )
    return tokenizer


def _load_model(args: argparse.Namespace, progress: _Progress):
    from prefixcache.models.llama import build_model

    if args.no_model:
        return None
    if args.model_config:
        from prefixcache.models.hf import random_model_from_config

        progress.step(f"building a random-weight model from {args.model_config}")
        return random_model_from_config(args.model_config, layers=args.layers)
    if args.model.startswith("hf:"):
        from prefixcache.models.hf import load_hf_model

        progress.step(f"loading model {args.model[3:]}")
        return load_hf_model(args.model[3:])
    progress.step(f"building model {args.model}")
    return build_model(args.model)


def _run_replay(args: argparse.Namespace) -> int:
    from prefixcache.replay.replayer import Replayer, ReplayInterrupted, check_options, replay_paths

    progress = _Progress(not args.no_progress)
    if args.plot:
        from prefixcache.replay.plot import require_matplotlib

        require_matplotlib()  # fail before a long replay, not after it
    if args.layers is not None and not args.model_config:
        raise InvalidArgumentError("--layers needs --model-config")
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
    _check_outputs(args)
    try:
        tokenizer = _load_tokenizer(args, progress)
        if args.endpoint:
            return run_endpoint_replay(args, tokenizer, progress)
        model = _load_model(args, progress)
    except ImportError as error:
        raise InvalidArgumentError(f"{error}; Hugging Face models need: pip install 'prefixcache[hf]'") from None
    replayer = Replayer(
        model,
        tokenizer,
        block_size=args.block_size,
        cache_tokens=args.cache_tokens,
        cache_memory=args.cache_memory,
        policy=args.policy,
        verify=args.verify,
        explain=args.explain,
        host_cache_tokens=args.host_cache_tokens,
        host_cache_memory=args.host_cache_memory,
        state_bytes=args.state_bytes,
        state_every=args.state_every,
        max_state_bytes=args.max_state_bytes,
    )
    replayer.check_pool_memory()
    try:
        report = replay_paths(
            args.paths,
            replayer,
            order=args.order,
            seed=args.seed,
            limit=args.limit,
            skip_invalid=args.skip_invalid,
            file_format=args.file_format,
            progress=progress,
            log_requests=args.requests_jsonl is not None,
        )
    except ReplayInterrupted as interrupted:
        report = interrupted.report
    if hasattr(model, "name"):
        report.model = model.name
    _write_replay(args, report, replayer.tokenizer.name)
    if report.partial:
        print("interrupted: the report above covers the requests completed before Ctrl-C", file=sys.stderr)
        return 130
    return 0


def _write_replay(args: argparse.Namespace, report, tokenizer_name: str) -> None:
    from prefixcache.replay.report import drift_json, format_drift, format_drift_requests, format_replay

    # The files first: a stdout closed early (`| head`) must not cost them.
    if args.json:
        out_json = report.to_json()
        for scenario in report.scenarios:
            out_json["scenarios"][scenario.scenario]["drift"] = drift_json(scenario)
        with _replacing(args.json) as out:
            json.dump(out_json, out, indent=2)
    if args.requests_jsonl:
        with _replacing(args.requests_jsonl) as out:
            for record in report.requests_log:
                out.write(json.dumps(record) + "\n")
    print(f"tokenizer: {tokenizer_name}")
    print(format_replay(report))
    for scenario in report.scenarios:
        line = format_drift(scenario)
        if line:
            print(line)
    if args.explain:
        from prefixcache.replay.explain import format_divergences

        for scenario in report.scenarios:
            print()
            print(format_divergences(scenario.scenario, scenario.explain_kinds or {}, scenario.divergences))
            if scenario.drifts:
                print(format_drift_requests(scenario))
    if args.plot and report.scenarios:  # last: a plot that cannot be drawn (no requests) costs no other report
        from prefixcache.replay.plot import plot_replay

        with _replacing(args.plot, binary=True) as out:
            plot_replay(report, out, image_format=Path(args.plot).suffix.lstrip(".").lower())
        print(f"plot written to {args.plot}")


@contextlib.contextmanager
def _replacing(name: str, *, binary: bool = False) -> Iterator[IO[Any]]:
    """A text file opened for writing that appears at ``name`` whole or not at all: written beside it under a
    temporary name and renamed over it on success, removed on any error or Ctrl-C, so an old report survives.
    A name that is not a regular file (``/dev/stdout``, a pipe) is written directly."""
    path = Path(name)
    if path.exists() and not path.is_file():
        with open(path, "wb") if binary else open(path, "w", encoding="utf-8") as out:
            yield out
        return
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") if binary else os.fdopen(handle, "w", encoding="utf-8") as out:
            yield out
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~umask)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _run_bench(args: argparse.Namespace) -> int:
    from prefixcache import bench

    extra = {}
    try:
        from prefixcache.serve import bench as serve_bench

        extra["serve"] = serve_bench.run
    except ImportError:  # without the server extra there is no serve benchmark
        pass
    if args.device != "cpu":
        from functools import partial

        from prefixcache.bench import engine

        engine.check_device(args.device)  # before any benchmark runs
        extra["engine"] = partial(engine.run, device=args.device)
    if args.quick:
        print("quick run (--quick): small sizes for a smoke test; the figures are not judged against the goals\n")
    bench.run(args.names or None, quick=args.quick, json_path=args.json, extra=extra)
    return 0


def _default_model_name(args: argparse.Namespace) -> str:
    """The id ``serve`` answers to without ``--served-model-name``: the preset, or the model folder's name (for a
    ``--model-config`` file, its folder's name when it is a ``config.json``, else its stem)."""
    if args.model_config:
        path = Path(args.model_config).resolve()
        if path.name == "config.json":
            return path.parent.name
        return path.stem if path.is_file() else path.name
    if args.model.startswith("hf:"):
        return Path(args.model[3:]).resolve().name
    return args.model


def _run_serve(args: argparse.Namespace) -> int:
    try:
        from prefixcache.serve import ApiKeys, create_app, serve_forever
    except ImportError as error:
        raise InvalidArgumentError(f"{error}; the server needs: pip install 'prefixcache[server]'") from None
    from prefixcache.engine.runner import PrefixCachingRunner
    from prefixcache.models.llama import build_model

    if args.layers is not None and not args.model_config:
        raise InvalidArgumentError("--layers needs --model-config")
    if args.snapshot_every is not None and (args.snapshot is None or not args.snapshot_every > 0):
        raise InvalidArgumentError("--snapshot-every needs --snapshot and a positive number of minutes")
    if args.snapshot is not None and importlib.util.find_spec("safetensors") is None:
        raise InvalidArgumentError("--snapshot needs safetensors: pip install 'prefixcache[snapshot]'")
    if args.snapshot is not None and Path(args.snapshot).exists() and not Path(args.snapshot).is_dir():
        raise InvalidArgumentError(f"--snapshot {args.snapshot}: is a file; give a folder (made if missing)")
    keys = ApiKeys.from_file(args.api_keys) if args.api_keys else None
    try:
        tokenizer = None
        if args.tokenizer:
            from prefixcache.chat.hf_tokenizer import HFTokenizer

            tokenizer = HFTokenizer(args.tokenizer)
        if args.model_config:
            from prefixcache.models.hf import random_model_from_config

            model = random_model_from_config(args.model_config, layers=args.layers)
        elif args.model.startswith("hf:"):
            from prefixcache.models.hf import load_hf_model

            model = load_hf_model(args.model[3:])
        else:
            model = build_model(args.model)
    except ImportError as error:
        raise InvalidArgumentError(f"{error}; Hugging Face models need: pip install 'prefixcache[hf]'") from None
    runner = PrefixCachingRunner(
        model, tokenizer, cache_tokens=args.cache_tokens, cache_memory=args.cache_memory, block_size=args.block_size
    )
    # What was restored, or why the cache starts cold, is worth a line at the default verbosity.
    logging.getLogger("prefixcache.serve.snapshots").setLevel(logging.INFO)
    name = args.served_model_name or _default_model_name(args)
    every_s = None if args.snapshot_every is None else 60.0 * args.snapshot_every
    app = create_app(
        runner,
        model_name=name,
        api_keys=keys,
        snapshot_dir=args.snapshot,
        snapshot_every_s=every_s,
        max_batch_tokens=args.max_batch_tokens,
        max_running=args.max_running,
    )

    def announce(url: str) -> None:
        print(f"serving {name!r} at {url}/v1 ({runner.pool.capacity_tokens:,} tokens of KV)", flush=True)

    serve_forever(app, args.host, args.port, log_level="warning" if args.verbose == 0 else "info", announce=announce)
    return 0


def _run_plan(args: argparse.Namespace) -> int:
    from prefixcache.cache.pool import kv_bytes_per_token

    if min(args.layers, args.kv_heads, args.head_dim, args.block_size) < 1:
        raise InvalidArgumentError("--layers, --kv-heads, --head-dim and --block-size must be positive")
    per_token = kv_bytes_per_token(args.layers, args.kv_heads, args.head_dim, _DTYPES[args.dtype])
    tokens = args.memory // per_token
    blocks = tokens // args.block_size
    if blocks < 1:
        raise InvalidArgumentError(
            f"--memory {args.memory:,} bytes holds no block of {args.block_size} tokens "
            f"({per_token * args.block_size:,} bytes at {per_token:,} bytes per token)"
        )
    print(
        f"bytes per token: {per_token:,} (2 x {args.layers} layers x {args.kv_heads} KV heads x "
        f"{args.head_dim} head_dim x {torch.empty((), dtype=_DTYPES[args.dtype]).element_size()} bytes)"
    )
    print(f"tokens that fit: {tokens:,}")
    print(f"blocks of {args.block_size} tokens: {blocks:,} ({blocks * args.block_size:,} tokens in whole blocks)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 1 verification failed, 2 bad input or other error, 130 Ctrl-C,
    141 stdout closed by its reader)."""
    args = build_parser().parse_args(argv)
    args.verbose += args.verbose_after
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    handlers = {"replay": _run_replay, "bench": _run_bench, "plan": _run_plan, "serve": _run_serve}
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout closed by its reader (`| head`): end quietly, as a program killed by SIGPIPE would.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush fails silently
        return 141
    except VerificationError as error:
        print(f"VERIFICATION FAILED: {error}", file=sys.stderr)
        return 1
    except (PrefixCacheError, OSError, MemoryError) as error:
        print(f"error: {error or type(error).__name__}", file=sys.stderr)
        return 2
