"""The ``prefixcache`` command line: ``replay``, ``bench``, ``plan`` and ``serve``."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections.abc import Sequence

import torch

from prefixcache.errors import InvalidArgumentError, PrefixCacheError, VerificationError

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixcache", description="Exact prefix caching for LLM inference.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    commands = parser.add_subparsers(dest="command", required=True)

    replay = commands.add_parser("replay", help="replay chat transcripts or traces and report prefill savings")
    replay.add_argument("paths", nargs="+", metavar="PATH", help="scenario JSONL files (chat or Mooncake trace)")
    replay.add_argument(
        "--model", default="tiny", help="embedded preset tiny (default) or small, or hf:PATH (local HF model folder)"
    )
    replay.add_argument("--model-config", metavar="PATH", help="random-weight HF model built from a config.json")
    replay.add_argument("--layers", type=int, help="with --model-config: keep only the first N layers")
    replay.add_argument("--tokenizer", metavar="PATH", help="local HF tokenizer folder (default: byte tokenizer)")
    replay.add_argument("--no-model", action="store_true", help="cache accounting only, no model (fast)")
    replay.add_argument("--block-size", type=int, default=16, help="tokens per KV block (1..256, default 16)")
    size = replay.add_mutually_exclusive_group()
    size.add_argument("--cache-tokens", type=parse_count, help="pool capacity in tokens (default: unlimited)")
    size.add_argument("--cache-memory", type=parse_size, help="pool capacity in bytes of KV, e.g. 512MiB")
    replay.add_argument("--policy", default="lru", choices=["lru", "lfu"], help="eviction policy")
    replay.add_argument("--verify", action="store_true", help="check every request against the no-cache reference")
    replay.add_argument("--order", default="round-robin", choices=["round-robin", "random", "file"])
    replay.add_argument("--seed", type=int, default=0, help="seed of --order random")
    replay.add_argument(
        "--limit", type=parse_count, help="replay only the first N conversations (trace lines) per file"
    )
    replay.add_argument("--format", default="auto", choices=["auto", "chat", "mooncake"], dest="file_format")
    replay.add_argument("--skip-invalid", action="store_true", help="skip bad lines (reported) instead of failing")
    replay.add_argument("--json", metavar="OUT", help="write the report as JSON")
    replay.add_argument("--requests-jsonl", metavar="OUT", help="write one JSON line of usage per request")
    replay.add_argument(
        "--explain", action="store_true", help="show where requests diverge from the cache (token, message, text)"
    )
    replay.add_argument("--plot", metavar="OUT.png", help="draw hit rate vs ideal and pool occupancy (matplotlib)")
    replay.add_argument("--no-progress", action="store_true", help="no progress bar")

    bench = commands.add_parser("bench", help="run benchmarks and print figures")
    bench.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: all)")
    bench.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    bench.add_argument("--json", metavar="OUT", help="write results as JSON")

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server over the prefix cache")
    serve.add_argument("--model", default="tiny", help="embedded preset tiny (default) or small, or hf:PATH")
    serve.add_argument("--model-config", metavar="PATH", help="random-weight HF model built from a config.json")
    serve.add_argument("--tokenizer", metavar="PATH", help="local HF tokenizer folder (default: byte tokenizer)")
    serve.add_argument("--served-model-name", help="the model id clients send (default: the --model value)")
    serve_size = serve.add_mutually_exclusive_group()
    serve_size.add_argument("--cache-tokens", type=parse_count, help="pool capacity in tokens (default 65,536)")
    serve_size.add_argument("--cache-memory", type=parse_size, help="pool capacity in bytes of KV, e.g. 512MiB")
    serve.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this host only)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    serve.add_argument(
        "--api-keys", metavar="FILE", help="one 'KEY [NAMESPACE]' per line; each key gets its own cache namespace"
    )

    plan = commands.add_parser("plan", help="how many tokens and blocks of KV fit in a memory budget")
    plan.add_argument("--layers", type=int, required=True)
    plan.add_argument("--kv-heads", type=int, required=True)
    plan.add_argument("--head-dim", type=int, required=True)
    plan.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    plan.add_argument("--memory", type=parse_size, required=True, help="KV budget, e.g. 24GiB")
    plan.add_argument("--block-size", type=int, default=16)
    return parser


def _progress(quiet: bool):
    if quiet:
        return None
    from tqdm import tqdm

    def bar(items, path: str, total: int):
        return tqdm(items, total=total, desc=path.rsplit("/", 1)[-1], unit="req", leave=False, file=sys.stderr)

    return bar


def _run_replay(args: argparse.Namespace) -> int:
    from prefixcache.models.llama import build_model
    from prefixcache.replay.replayer import Replayer, replay_paths
    from prefixcache.replay.report import format_replay

    if args.plot:
        from prefixcache.replay.plot import require_matplotlib

        require_matplotlib()  # fail before a long replay, not after it
    if args.layers is not None and not args.model_config:
        raise InvalidArgumentError("--layers needs --model-config")
    try:
        tokenizer = None
        if args.tokenizer:
            from prefixcache.chat.hf_tokenizer import HFTokenizer

            tokenizer = HFTokenizer(args.tokenizer)
        if args.no_model:
            model = None
        elif args.model_config:
            from prefixcache.models.hf import random_model_from_config

            model = random_model_from_config(args.model_config, layers=args.layers)
        elif args.model.startswith("hf:"):
            from prefixcache.models.hf import load_hf_model

            model = load_hf_model(args.model[3:])
        else:
            model = build_model(args.model)
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
    )
    report = replay_paths(
        args.paths,
        replayer,
        order=args.order,
        seed=args.seed,
        limit=args.limit,
        skip_invalid=args.skip_invalid,
        file_format=args.file_format,
        progress=_progress(args.no_progress),
        log_requests=True,  # the drift summary below reads it
    )
    if hasattr(model, "name"):
        report.model = model.name
    # Template drift: where a turn's prompt leaves the previous prompt + answer, relative to the latter's end.
    from collections import Counter

    previous_len: dict[tuple[str, str], int] = {}
    drift_offsets: dict[str, Counter[int]] = {}
    for record in report.requests_log:
        key = (record["scenario"], record["conversation_id"])
        if record["drift_at"] is not None and key in previous_len:
            drift_offsets.setdefault(key[0], Counter())[record["drift_at"] - previous_len[key]] += 1
        previous_len[key] = record["usage"]["prompt_tokens"] + record["usage"]["completion_tokens"]
    print(f"tokenizer: {replayer.tokenizer.name}")
    print(format_replay(report))
    for scenario, offsets in drift_offsets.items():
        offset, count = offsets.most_common(1)[0]
        print(
            f"template drift in {scenario}: {offsets.total()} requests do not extend the previous prompt+answer; "
            f"{count} of them diverge {-offset} tokens before its end"
        )
    if args.explain:
        from prefixcache.replay.explain import format_divergences

        for scenario in report.scenarios:
            print()
            print(format_divergences(scenario.scenario, scenario.explain_kinds or {}, scenario.divergences))
    if args.plot:
        from prefixcache.replay.plot import plot_replay

        print(f"plot written to {plot_replay(report, args.plot)}")
    if args.json:
        out_json = report.to_json()
        for scenario, scenario_json in out_json["scenarios"].items():
            offsets = drift_offsets.get(scenario, Counter())
            top = offsets.most_common(1)
            scenario_json["drift"] = {
                "requests": offsets.total(),
                "most_common_offset": top[0][0] if top else None,
                "most_common_offset_requests": top[0][1] if top else 0,
                "offsets": {str(k): v for k, v in offsets.most_common(5)},
            }
        with open(args.json, "w") as out:
            json.dump(out_json, out, indent=2)
    if args.requests_jsonl:
        with open(args.requests_jsonl, "w") as out:
            for record in report.requests_log:
                out.write(json.dumps(record) + "\n")
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    from prefixcache import bench

    extra = {}
    try:
        from prefixcache.serve import bench as serve_bench

        extra["serve"] = serve_bench.run
    except ImportError:  # without the server extra there is no serve benchmark
        pass
    bench.run(args.names or None, quick=args.quick, json_path=args.json, extra=extra)
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    try:
        from prefixcache.serve import ApiKeys, create_app, serve_forever
    except ImportError as error:
        raise InvalidArgumentError(f"{error}; the server needs: pip install 'prefixcache[server]'") from None
    from prefixcache.engine.runner import PrefixCachingRunner
    from prefixcache.models.llama import build_model

    keys = ApiKeys.from_file(args.api_keys) if args.api_keys else None
    try:
        tokenizer = None
        if args.tokenizer:
            from prefixcache.chat.hf_tokenizer import HFTokenizer

            tokenizer = HFTokenizer(args.tokenizer)
        if args.model_config:
            from prefixcache.models.hf import random_model_from_config

            model = random_model_from_config(args.model_config)
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
    name = args.served_model_name or args.model
    app = create_app(runner, model_name=name, api_keys=keys)

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
    print(
        f"bytes per token: {per_token:,} (2 x {args.layers} layers x {args.kv_heads} KV heads x "
        f"{args.head_dim} head_dim x {torch.empty((), dtype=_DTYPES[args.dtype]).element_size()} bytes)"
    )
    print(f"tokens that fit: {tokens:,}")
    print(f"blocks of {args.block_size} tokens: {blocks:,} ({blocks * args.block_size:,} tokens in whole blocks)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 1 verification failed, 2 bad input or other error)."""
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    handlers = {"replay": _run_replay, "bench": _run_bench, "plan": _run_plan, "serve": _run_serve}
    try:
        return handlers[args.command](args)
    except VerificationError as error:
        print(f"VERIFICATION FAILED: {error}", file=sys.stderr)
        return 1
    except (PrefixCacheError, OSError, MemoryError) as error:
        print(f"error: {error or type(error).__name__}", file=sys.stderr)
        return 2
