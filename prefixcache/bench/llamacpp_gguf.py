"""The GGUF file of each precision class that ``bench llamacpp`` gives both servers: llama.cpp's own ``llama-quantize``
rewrites the model's file as F32, BF16, Q8_0 or Q4_0 (:attr:`~prefixcache.bench.precision.Precision.gguf_type`).

From a quantized file (SmolLM2's is Q4_1) ``--allow-requantize`` dequantizes each block and quantizes it again, so
every class holds the same values up to its own rounding, and both servers read the very same file: llama.cpp as it
is, prefixcache dequantized at load and then in ``--dtype`` / ``--quantize`` (int8 per channel against Q8_0's
per-32 blocks, int4 groups of 32 with an offset against Q4_0's blocks of 32 without one).  llama-quantize chooses
some tensors' types itself (an output or tied embedding whose rows are not a multiple of 256 becomes Q8_0 in a Q4_0
file, as prefixcache's int4 keeps its LM head int8); its log is kept beside the file.

Files are made once into ``cache_dir`` (default ``$TMPDIR/prefixcache-llamacpp``) and reused while newer than the
source.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from prefixcache.errors import InvalidArgumentError

__all__ = ["DEFAULT_CACHE_DIR", "gguf_of_type"]

DEFAULT_CACHE_DIR = Path(tempfile.gettempdir()) / "prefixcache-llamacpp"
QUANTIZE_TIMEOUT_S = 600


def gguf_of_type(source: Path, gguf_type: str, quantize: Path, cache_dir: Path | None = None) -> Path:
    """The file ``source`` rewritten as ``gguf_type`` (``"F32"``, ``"BF16"``, ``"Q8_0"``, ``"Q4_0"``) by the
    ``quantize`` program (``llama-quantize``), made into ``cache_dir`` unless a file newer than ``source`` is
    there; its output goes to ``NAME.log`` beside it.  Written under a temporary name and renamed, so an interrupted
    run leaves no half file.  O(file size).

    Raises InvalidArgumentError when llama-quantize fails (the end of its log in the message) or runs past
    :data:`QUANTIZE_TIMEOUT_S`."""
    folder = DEFAULT_CACHE_DIR if cache_dir is None else cache_dir
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{source.stem}-{gguf_type}.gguf"
    if target.is_file() and target.stat().st_mtime >= source.stat().st_mtime:
        return target
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    log = target.with_suffix(".log")
    command = [str(quantize), "--allow-requantize", str(source), str(partial), gguf_type]
    try:
        with open(log, "w", encoding="utf-8") as out:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=QUANTIZE_TIMEOUT_S)
        if done.returncode != 0 or not partial.is_file():
            tail = log.read_text(encoding="utf-8", errors="replace")[-600:]
            raise InvalidArgumentError(f"llama-quantize to {gguf_type} failed ({done.returncode}): {tail}")
        partial.replace(target)
    except subprocess.TimeoutExpired:
        raise InvalidArgumentError(f"llama-quantize to {gguf_type} ran past {QUANTIZE_TIMEOUT_S} s") from None
    finally:
        partial.unlink(missing_ok=True)
    return target
