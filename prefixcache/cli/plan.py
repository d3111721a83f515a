"""``prefixcache plan``: how many tokens and blocks of KV fit in a memory budget.  Pure arithmetic: imports no torch."""

from __future__ import annotations

import argparse
from typing import Any

from prefixcache.cli.options import parse_size
from prefixcache.errors import InvalidArgumentError

__all__ = ["ELEMENT_BYTES", "add_parser", "run"]

ELEMENT_BYTES = {
    "fp32": 4,
    "float32": 4,
    "fp16": 2,
    "float16": 2,
    "bf16": 2,
    "bfloat16": 2,
    "fp8": 1,
}
"""Bytes of one KV element per ``--dtype`` name (torch's ``element_size()`` of float32, float16, bfloat16 and
float8_e4m3fn), so that planning needs no torch."""


def add_parser(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Add the ``plan`` subcommand to ``commands`` (the subparsers of the ``prefixcache`` parser)."""
    plan = commands.add_parser("plan", parents=parents, help="how many tokens and blocks of KV fit in a memory budget")
    plan.add_argument("--layers", type=int, required=True, help="transformer layers of the model")
    plan.add_argument("--kv-heads", type=int, required=True, help="KV heads per layer (GQA: fewer than query heads)")
    plan.add_argument("--head-dim", type=int, required=True, help="dimension of one attention head")
    plan.add_argument("--dtype", default="bf16", choices=sorted(ELEMENT_BYTES), help="KV element type (default bf16)")
    plan.add_argument("--memory", type=parse_size, required=True, help="KV budget, e.g. 24GiB")
    plan.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")


def run(args: argparse.Namespace) -> int:
    """Print bytes per token, tokens and whole blocks that fit; 0.  Raises InvalidArgumentError for a dimension
    below 1 or a budget that holds no block."""
    if min(args.layers, args.kv_heads, args.head_dim, args.block_size) < 1:
        raise InvalidArgumentError("--layers, --kv-heads, --head-dim and --block-size must be positive")
    element = ELEMENT_BYTES[args.dtype]
    # The formula of prefixcache.cache.pool.kv_bytes_per_token (K and V of one token), without importing torch.
    per_token = 2 * args.layers * args.kv_heads * args.head_dim * element
    tokens = args.memory // per_token
    blocks = tokens // args.block_size
    if blocks < 1:
        raise InvalidArgumentError(
            f"--memory {args.memory:,} bytes holds no block of {args.block_size} tokens "
            f"({per_token * args.block_size:,} bytes at {per_token:,} bytes per token)"
        )
    print(
        f"bytes per token: {per_token:,} (2 x {args.layers} layers x {args.kv_heads} KV heads x "
        f"{args.head_dim} head_dim x {element} bytes)"
    )
    print(f"tokens that fit: {tokens:,}")
    print(f"blocks of {args.block_size} tokens: {blocks:,} ({blocks * args.block_size:,} tokens in whole blocks)")
    return 0
