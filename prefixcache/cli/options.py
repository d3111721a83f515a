"""What the commands' parsers share: sizes and counts as the user writes them, and the ``-v`` after a subcommand.

Nothing here imports torch (nor any layer that does), so ``prefixcache --help`` and ``prefixcache plan`` start fast.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re

__all__ = ["QUANTIZE_CHOICES", "QUANTIZE_HELP", "parse_count", "parse_size", "verbose_parent", "version"]

QUANTIZE_CHOICES = ("none", "int8", "int4")
"""``--quantize``'s values: :data:`prefixcache.models.quantize.QUANTIZE_MODES` (a test keeps the two equal), written
here because that module imports torch."""

QUANTIZE_HELP = (
    "weight-only quantization of the linear layers on the CPU: int8 (per output channel) or int4 (groups of 32 along "
    "the input, LM head int8); activations stay in --dtype, rounded to bfloat16 at each quantized layer (default none)"
)

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
    """A positive token count, also written ``1e6``.

    Raises:
        argparse.ArgumentTypeError: not a positive whole number.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 1 <= value < 2**63 or value != int(value):
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text!r}")
    return int(value)


def version() -> str:
    """The installed package's version, or a note that it is not installed."""
    try:
        return importlib.metadata.version("prefixcache")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def verbose_parent() -> argparse.ArgumentParser:
    """A parent parser giving a subcommand its own ``-v``; its dest is ``verbose_after``, since a subcommand's
    namespace would overwrite the ``verbose`` of the options before it."""
    after = argparse.ArgumentParser(add_help=False)
    after.add_argument(
        "-v", "--verbose", action="count", default=0, dest="verbose_after", help="log more (-v info, -vv debug)"
    )
    return after
