"""Where ``bench llamacpp`` finds llama.cpp's programs: ``llama-server`` and, to make a GGUF file of another type,
``llama-quantize``.

``llama-server``: ``--llama-server PATH``, else ``$LLAMA_SERVER``, else ``llama-server`` on ``PATH``.
``llama-quantize``: ``$LLAMA_QUANTIZE``, else beside the server (a llama.cpp build puts both in ``build/bin``), else on
``PATH``.  Neither is part of any Python package this project depends on: llama.cpp builds from the sources vendored in
the ``llama-cpp-python`` sdist (``pip download --no-binary :all: --no-deps llama-cpp-python``, then ``cmake -B build
-DGGML_NATIVE=OFF ... && cmake --build build --target llama-server llama-quantize``; the issue of this benchmark gives
the options that run on each CPU).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SERVER_VARIABLE", "QUANTIZE_VARIABLE", "Found", "find_llama_quantize", "find_llama_server"]

SERVER_VARIABLE = "LLAMA_SERVER"
QUANTIZE_VARIABLE = "LLAMA_QUANTIZE"


@dataclass(frozen=True, slots=True)
class Found:
    """A program looked for: its ``path`` (None where not found) and, where not found, ``reason`` (what was tried)."""

    path: Path | None
    reason: str = ""


def _runnable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_llama_server(explicit: str | os.PathLike[str] | None = None) -> Found:
    """``llama-server``: ``explicit`` (``--llama-server``), else ``$LLAMA_SERVER``, else on ``PATH``.  An explicit or
    environment path that is not an executable file is not found (the reason says which), and ``PATH`` is not tried
    then: the caller asked for that binary.  O(entries of ``PATH``)."""
    for given, where in ((explicit, "--llama-server"), (os.environ.get(SERVER_VARIABLE), f"${SERVER_VARIABLE}")):
        if given:
            path = Path(given).expanduser()
            if _runnable(path):
                return Found(path.resolve())
            return Found(None, f"{where} {str(path)!r} is not an executable file")
    on_path = shutil.which("llama-server")
    if on_path:
        return Found(Path(on_path).resolve())
    return Found(
        None,
        f"no llama-server: give --llama-server PATH or ${SERVER_VARIABLE}, or put it on PATH (it builds from the "
        "llama.cpp sources in the llama-cpp-python sdist: see prefixcache/bench/llamacpp_find.py)",
    )


def find_llama_quantize(server: Path | None) -> Found:
    """``llama-quantize``: ``$LLAMA_QUANTIZE``, else beside ``server``, else on ``PATH``."""
    given = os.environ.get(QUANTIZE_VARIABLE)
    if given:
        path = Path(given).expanduser()
        return (
            Found(path.resolve()) if _runnable(path) else Found(None, f"${QUANTIZE_VARIABLE} {given!r} is not runnable")
        )
    if server is not None and _runnable(server.parent / "llama-quantize"):
        return Found(server.parent / "llama-quantize")
    on_path = shutil.which("llama-quantize")
    if on_path:
        return Found(Path(on_path).resolve())
    return Found(None, f"no llama-quantize beside the server, on PATH or in ${QUANTIZE_VARIABLE}")
