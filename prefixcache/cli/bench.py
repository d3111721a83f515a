"""``prefixcache bench``: run the benchmarks (:mod:`prefixcache.bench`, and ``serve`` where the server extra is
installed) and print their figures."""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

__all__ = ["BENCHMARK_NAMES", "add_parser", "run"]

BENCHMARK_NAMES = (
    "tree",
    "peers",
    "evict",
    "memory",
    "runner",
    "policy",
    "trace",
    "engine",
    "agent",
    "route",
    "snapshot",
    "llamacpp",
)
"""The names of :data:`prefixcache.bench.BENCHMARKS`, in its order, for ``--help`` (a test keeps the two equal):
importing the benchmarks imports torch, and ``--help`` should not."""

PRECISION_NAMES = ("float32", "bfloat16", "int8", "int4", "bfloat16+int8", "bfloat16+int4")
""":data:`prefixcache.bench.precision.PRECISION_NAMES`, for ``--help`` without torch (a test keeps the two equal)."""


def add_parser(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Add the ``bench`` subcommand to ``commands`` (the subparsers of the ``prefixcache`` parser)."""
    # serve joins the list where the server extra is installed (run adds it); find_spec imports nothing.
    with_serve = all(
        importlib.util.find_spec(m) is not None for m in ("fastapi", "uvicorn", "httpx", "prometheus_client")
    )
    names = ", ".join([*BENCHMARK_NAMES, *(["serve"] if with_serve else [])])
    bench = commands.add_parser("bench", parents=parents, help="run benchmarks and print figures")
    bench.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run: {names} (default all)")
    bench.add_argument("--quick", action="store_true", help="small sizes (seconds); figures are not judged")
    bench.add_argument("--json", metavar="OUT", help="write results as JSON")
    bench.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where the engine benchmark runs (default cpu)"
    )
    bench.add_argument(
        "--precision",
        action="append",
        choices=PRECISION_NAMES,
        help="precision of engine's floor rows (default float32) and of llamacpp's runs (default float32, bfloat16, "
        "int8, int4); int8 / int4: weight-only, float32 activations; repeat the flag for several",
    )
    bench.add_argument(
        "--llama-server",
        metavar="PATH",
        help="llama.cpp's llama-server for the llamacpp benchmark (default $LLAMA_SERVER, else PATH; none: skipped)",
    )
    bench.add_argument(
        "--model", default="smollm2", help="the llamacpp benchmark's GGUF: smollm2 (default) or a .gguf file"
    )
    bench.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="threads of each server in the llamacpp benchmark (default 2; 1 on a machine busier than its cores)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmarks ``args.names`` (all by default) and print their tables; 0.  Raises InvalidArgumentError for
    an unknown name, for ``serve`` without the server extra and for a benchmark of Hugging Face models without the
    hf extra (saying what to install)."""
    from prefixcache import bench

    extra = {}
    try:
        extra["serve"] = importlib.import_module("prefixcache.bench.serve").run
    except ImportError as error:  # without the server extra there is no serve benchmark
        if "serve" in (args.names or ()):
            from prefixcache.errors import InvalidArgumentError, install_command

            raise InvalidArgumentError(
                f"the serve benchmark needs the server extra: {install_command('server')} ({error})"
            ) from error
    from functools import partial

    from prefixcache.bench import engine, llamacpp

    precisions = tuple(args.precision) if args.precision else None
    if args.device != "cpu" or precisions:
        engine.check_device(args.device)  # before any benchmark runs
        extra["engine"] = partial(engine.run, device=args.device, precisions=precisions or ("float32",))
    extra["llamacpp"] = partial(
        llamacpp.run, llama_server=args.llama_server, model=args.model, precisions=precisions, threads=args.threads
    )
    if args.quick:
        print("quick run (--quick): small sizes for a smoke test; the figures are not judged against the goals\n")
    try:
        bench.run(args.names or None, quick=args.quick, json_path=args.json, extra=extra)
    except ModuleNotFoundError as error:  # a benchmark of Hugging Face models (agent, engine's 24 layers) without hf
        from prefixcache.errors import InvalidArgumentError, install_command

        extra_name = "hf" if error.name in ("transformers", "tokenizers", "gguf", "accelerate") else None
        if extra_name is None:
            raise
        raise InvalidArgumentError(f"this benchmark needs {error.name}: {install_command(extra_name)}") from None
    return 0
