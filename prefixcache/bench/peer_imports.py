"""Importing other systems' prefix caches without their dependencies, for the ``peers`` benchmark.

SGLang and vLLM are serving engines whose packages depend on CUDA kernels, web servers and model libraries.  Their
prefix caches are plain Python over torch, so the benchmark installs each package with ``pip install --no-deps`` and
imports only the cache modules.  What those modules import at module level but never call on the measured path is
replaced by a *stub*: an empty module whose every attribute is an inert placeholder (a class that can be subclassed,
called, used as a decorator or caught, and does nothing).  Each stub below says why it is safe.  The benchmark then
checks every peer's answers (tokens hit per request, nodes, blocks) against ours, so a stub that stood in for code
on the measured path would show up as a wrong answer, not as a silently faster figure.

Stubs are installed only for modules that are not importable here, and third-party stubs are removed from
``sys.modules`` again once the peer is loaded, so nothing else in the process sees them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prefixcache.errors import PrefixCacheError

SGLANG_VERSION = "0.5.23"
VLLM_VERSION = "0.33.0"
INSTALL_HINT = (
    f'pip install -e ".[peers]" && pip install --no-deps sglang=={SGLANG_VERSION}  '
    f"(optionally also: pip install --no-deps vllm=={VLLM_VERSION})"
)

SGLANG_STUBS: dict[str, str] = {
    "sglang.srt.utils": "a 2,000-line hub of helpers (HTTP, process, CUDA queries) importing requests, psutil and "
    "triton; the radix cache uses one helper from it, ceil_align, only in checkpoint(), which the benchmark never "
    "calls",
    "sglang.kernels": "Triton GPU kernels (MLA buffers, paged allocation) imported by mem_cache/utils.py and the "
    "allocators; no kernel runs on the CPU path",
    "sglang.srt.mem_cache.memory_pool": "the GPU KV pools and request-to-token tables; base_prefix_cache imports "
    "ReqToTokenPool only to annotate a parameter the simulated cache leaves None",
    "sglang.srt.observability": "Prometheus metrics collectors; metrics are off (enable_metrics=False)",
    "zmq": "the KV-event publisher's socket library (disaggregation/kv_events.py); KV events are off",
    "psutil": "process and memory queries of the platform probes, run at import but never on the cache path",
}
"""Module (with its submodules) -> why stubbing it cannot change what the benchmark measures."""

VLLM_STUBS: dict[str, str] = {
    "vllm.config": "the engine configuration (pydantic models over transformers); kv_cache_utils imports VllmConfig "
    "only for the pool-sizing functions, which the benchmark does not call",
    "vllm.v1.request": "the engine's Request (sampling, structured output, multimodal inputs); the block pool and the "
    "block hasher only read a few attributes of it, which the benchmark's own request record supplies",
    "vllm.multimodal": "multimodal input processing; its helper runs only for requests with multimodal features",
    "vllm.distributed": "tensor-parallel state and the KV-event publishers; KV events are off",
    "psutil": "memory and process probes in vllm.utils and vllm.platforms, never on the cache path",
    "cpuinfo": "CPU feature probes of vllm.platforms, never on the cache path",
    "prometheus_client": "metrics (vllm.v1.metrics); no metrics collector is given to the block pool",
    "cbor2": "only the sha256_cbor/xxhash_cbor hash variants; the benchmark uses sha256 (pickle), vLLM's default",
    "uvloop": "the API server's event loop, imported by vllm.utils",
    "requests": "HTTP helpers and usage reporting in vllm.utils/vllm.usage; nothing is sent",
    "urllib3": "as requests",
    "zmq": "engine-core messaging, imported by vllm.utils; no socket is opened",
}


class PeerUnavailableError(PrefixCacheError):
    """A peer's package is not installed, or its cache modules could not be imported (the message says which)."""


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        # Used as a bare decorator (``@triton.jit``): hand the function back unchanged.
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return Placeholder

    def __getitem__(cls, item: Any) -> Any:
        return Placeholder

    def __or__(cls, other: Any) -> Any:
        return Placeholder

    def __ror__(cls, other: Any) -> Any:
        return Placeholder


class Placeholder(Exception, metaclass=_PlaceholderMeta):
    """Every attribute of a stub module: subclassable, callable, indexable, catchable; it does nothing."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        pass


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: list[str]) -> None:
        self.roots = roots
        self.created: list[str] = []

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if any(name == root or name.startswith(root + ".") for root in self.roots):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        self.created.append(spec.name)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@contextmanager
def _stubbed(package: str, stubs: dict[str, str]) -> Iterator[list[str]]:
    """Load ``package`` as a bare namespace (its ``__init__`` pulls in the whole engine) with ``stubs`` in place."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PeerUnavailableError(f"{package} is not installed; {INSTALL_HINT}")
    shell = types.ModuleType(package)
    shell.__path__ = list(spec.submodule_search_locations)
    shell.__spec__ = spec
    sys.modules[package] = shell
    own = [name for name in stubs if name.startswith(package + ".")]
    third_party = [name for name in stubs if not name.startswith(package + ".")]
    finder = _StubFinder(own + [name for name in third_party if importlib.util.find_spec(name) is None])
    sys.meta_path.insert(0, finder)
    try:
        yield finder.created
    finally:
        sys.meta_path.remove(finder)
        for name in list(sys.modules):
            if any(name == root or name.startswith(root + ".") for root in third_party):
                if isinstance(sys.modules[name], _StubModule):
                    del sys.modules[name]


@dataclass(frozen=True, slots=True)
class Peer:
    """An imported peer: its name, package version, the loaded modules and the stubs that were needed."""

    name: str
    version: str
    modules: dict[str, types.ModuleType]
    stubs: tuple[str, ...]


def load_sglang() -> Peer:
    """SGLang's ``RadixCache`` (``sglang/srt/mem_cache/radix_cache.py``) and its parameter records.

    Raises:
        PeerUnavailableError: ``sglang`` is not installed or its cache modules do not import.
    """
    version = _installed("sglang")
    if version is None:
        raise PeerUnavailableError(f"sglang is not installed; {INSTALL_HINT}")
    try:
        with _stubbed("sglang", SGLANG_STUBS) as created:
            radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
            base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
    except PeerUnavailableError:
        raise
    except Exception as exc:
        raise PeerUnavailableError(
            f"sglang {version} is installed but its radix cache did not import ({type(exc).__name__}: {exc}); "
            f"the benchmark was written against sglang {SGLANG_VERSION}"
        ) from exc
    roots = sorted({root for root in SGLANG_STUBS for name in created if name == root or name.startswith(root + ".")})
    return Peer("SGLang", version, {"radix_cache": radix, "base_prefix_cache": base}, tuple(roots))


def load_vllm() -> Peer:
    """vLLM's v1 ``BlockPool`` (``vllm/v1/core/block_pool.py``), its prefix-cache hashing
    (``vllm/v1/core/kv_cache_utils.py``) and hash functions (``vllm/utils/hashing.py``).

    Raises:
        PeerUnavailableError: ``vllm`` is not installed or its block pool does not import.
    """
    version = _installed("vllm")
    if version is None:
        raise PeerUnavailableError(f"vllm is not installed (pip install --no-deps vllm=={VLLM_VERSION})")
    try:
        with _stubbed("vllm", VLLM_STUBS) as created:
            modules = {
                "block_pool": importlib.import_module("vllm.v1.core.block_pool"),
                "kv_cache_utils": importlib.import_module("vllm.v1.core.kv_cache_utils"),
                "hashing": importlib.import_module("vllm.utils.hashing"),
            }
    except PeerUnavailableError:
        raise
    except Exception as exc:
        raise PeerUnavailableError(
            f"vllm {version} is installed but its block pool did not import ({type(exc).__name__}: {exc}); "
            f"the benchmark was written against vllm {VLLM_VERSION}"
        ) from exc
    roots = sorted({root for root in VLLM_STUBS for name in created if name == root or name.startswith(root + ".")})
    return Peer("vLLM", version, modules, tuple(roots))
