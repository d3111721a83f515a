"""The benchmarks' clock, in one place: the calling thread's CPU time while torch runs one intra-op thread, wall time
while it runs more, or GPU wall time after a synchronize inside :func:`device_clock` for CUDA; the torch thread count a
run holds; and the device a run asks for, checked.

On the CPU of a small shared machine a second torch thread makes every op wait for a descheduled peer, and wall time
counts other processes' time slices, so the rows of ``bench engine``, ``bench agent`` and ``bench runner`` hold torch
to :data:`TORCH_THREADS`; a row that runs more threads (``bench engine``'s floor) is timed on wall time, since the
calling thread's CPU time would miss its peers' work.  On CUDA the CPU only launches kernels, so its CPU time would
miss the work.  The cache benchmarks (``bench tree``, ``evict``, ``peers``) time pure-Python loops on
:func:`now_ns`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.engine.sampling import SamplingParams
from prefixcache.errors import InvalidArgumentError

__all__ = [
    "DEVICES",
    "TORCH_THREADS",
    "check_device",
    "clock",
    "device_clock",
    "now_ns",
    "timed_runner_call",
    "torch_threads",
]

TORCH_THREADS = 1
"""Intra-op threads while measuring: one keeps the figures reproducible on a small shared machine (two made the tiny
model's 1 ms question prefill take 170-240 ms whenever anything else ran), and every compared path runs the same way."""
DEVICES = ("cpu", "cuda")


def _cpu_clock() -> float:
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


_now: Callable[[], float] = _cpu_clock


def clock() -> float:
    """Seconds on the benchmarks' clock: CPU time of the calling thread while torch runs one intra-op thread, wall
    time (``time.perf_counter``) while it runs more, or GPU wall time inside :func:`device_clock` for CUDA."""
    return _now()


def now_ns() -> int:
    """CPU time of the calling thread, in ns: the clock of the cache benchmarks' single-threaded pure-Python loops.

    On an idle machine this is wall time; on a busy one (a shared CI runner, a laptop compiling) it leaves out the
    time other processes hold the core, which would otherwise inflate the figures by whole scheduler time slices.
    Read once per timed loop, never per call (each read is a system call).
    """
    return time.thread_time_ns()


def check_device(device: str) -> torch.device:
    """``device`` as a torch device when this machine has it.

    Raises:
        InvalidArgumentError: not one of :data:`DEVICES`, or ``cuda`` without a CUDA device.
    """
    if device not in DEVICES:
        raise InvalidArgumentError(f"device must be one of {list(DEVICES)}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    return torch.device(device)


def _cuda_wall_clock() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


@contextlib.contextmanager
def device_clock(device: torch.device) -> Iterator[None]:
    """Make :func:`clock` the device's clock inside the block: wall time after a synchronize on CUDA (the CPU only
    launches kernels there, so its CPU time would miss the work); the CPU clock otherwise."""
    global _now
    before = _now
    _now = _cuda_wall_clock if device.type == "cuda" else _cpu_clock
    try:
        yield
    finally:
        _now = before


@contextlib.contextmanager
def torch_threads(threads: int = TORCH_THREADS) -> Iterator[None]:
    """Hold torch to ``threads`` intra-op threads inside the block (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def timed_runner_call(runner: PrefixCachingRunner, prompt: list[int], params: SamplingParams):
    """``(ttft_s, total_s, result)`` of one runner request on :func:`clock`; the first token's time is taken when
    the runner yields it."""
    first: list[float] = []
    start = clock()
    steps = runner.stream(prompt, params, on_token=lambda _token: first.append(clock()) if not first else None)
    try:
        while True:
            next(steps)
    except StopIteration as done:
        result = done.value
    total = clock() - start
    return (first[0] - start if first else total), total, result
