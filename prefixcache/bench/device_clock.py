"""The clock of ``bench engine`` and its kin: the calling thread's CPU time with torch held to one intra-op thread, or
GPU wall time after a synchronize on CUDA; and the device a run asks for, checked.

On the CPU of a small shared machine a second torch thread makes every op wait for a descheduled peer, and wall time
counts other processes' time slices; on CUDA the CPU only launches kernels, so its CPU time would miss the work.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.engine.sampling import SamplingParams
from prefixcache.errors import InvalidArgumentError

__all__ = ["DEVICES", "TORCH_THREADS", "check_device", "clock", "device_clock", "one_torch_thread", "timed_runner_call"]

TORCH_THREADS = 1
DEVICES = ("cpu", "cuda")

_now: Callable[[], float] = time.thread_time


def clock() -> float:
    """Seconds on the benchmarks' clock: CPU time of the calling thread, or GPU wall time inside :func:`device_clock`
    for CUDA."""
    return _now()


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
    launches kernels there, so its CPU time would miss the work); the thread's CPU time otherwise."""
    global _now
    before = _now
    _now = _cuda_wall_clock if device.type == "cuda" else time.thread_time
    try:
        yield
    finally:
        _now = before


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Hold torch to ``TORCH_THREADS`` intra-op threads inside the block (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
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
