"""What this machine can read and compute: the rates under ``bench engine``'s floor (:mod:`prefixcache.bench.floor`),
measured with torch at the caller's thread count, best of several repeats, on
:func:`~prefixcache.bench.device_clock.clock`:

- memory read bandwidth (bytes/s): the faster of two reads of a float32 tensor many times the last-level cache
  (512 MiB; 64 MiB with ``--quick``), so every byte comes from DRAM, as a decode step's weights do: ``sum()``
  (STREAM's read kernel, in torch) and a matrix-vector product of the same bytes viewed ``[rows, 4096]`` by a
  vector of ones (the BLAS kernel a decode step runs).  Which is faster depends on the CPU: on an AMD EPYC host of
  this project's the sum read 34 GB/s against the product's 18-24; on an Intel Xeon host, with two threads, the sum
  17-20 GB/s and the product 23-30, so a floor from the sum alone sat below what the model's own products reached
  (decode / floor 0.91 on the embedded 4-layer shape) and was no floor;
- float32 matrix throughput (FLOP/s): a square ``2048 x 2048`` product (``2 n^3`` FLOPs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from prefixcache.bench.device_clock import clock
from prefixcache.errors import InvalidArgumentError

__all__ = ["GEMV_COLUMNS", "MachineFloor", "RateProbe", "measure_gemm", "measure_machine", "measure_read_bandwidth"]


@dataclass(frozen=True, slots=True)
class MachineFloor:
    """This machine's measured rates: read bandwidth (bytes/s) over ``buffer_bytes`` by ``torch.sum`` and by
    ``torch.mv`` (:func:`measure_read_bandwidth`), float32 GEMM (FLOP/s) of ``gemm_size``-square matrices, best of
    ``repeats``, at ``threads`` torch threads."""

    sum_read_bytes_per_s: float
    gemv_read_bytes_per_s: float
    gemm_flops_per_s: float
    threads: int
    buffer_bytes: int
    gemm_size: int
    repeats: int

    @property
    def read_bytes_per_s(self) -> float:
        """The floor's read bandwidth: the faster of the two reads."""
        return max(self.sum_read_bytes_per_s, self.gemv_read_bytes_per_s)

    def as_dict(self) -> dict:
        """The fields and :attr:`read_bytes_per_s`, as ``measure_floor`` returns them."""
        return {**dataclasses.asdict(self), "read_bytes_per_s": self.read_bytes_per_s}

    def best(self, other: MachineFloor) -> MachineFloor:
        """The higher of each rate of two measurements of the same sizes (a busy moment only lowers a rate)."""
        return dataclasses.replace(
            self,
            sum_read_bytes_per_s=max(self.sum_read_bytes_per_s, other.sum_read_bytes_per_s),
            gemv_read_bytes_per_s=max(self.gemv_read_bytes_per_s, other.gemv_read_bytes_per_s),
            gemm_flops_per_s=max(self.gemm_flops_per_s, other.gemm_flops_per_s),
            repeats=self.repeats + other.repeats,
        )


def _best(fn: Callable[[], object], repeats: int) -> float:
    """Fewest :func:`clock` seconds of ``repeats`` calls of ``fn`` after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


GEMV_COLUMNS = 4096
"""Columns of the matrix view of the read buffer in :func:`measure_read_bandwidth`'s product (16 KiB rows)."""


def measure_read_bandwidth(num_bytes: int, repeats: int) -> tuple[float, float]:
    """Bytes per second reading a float32 tensor of ``num_bytes`` (rounded down to whole rows of
    :data:`GEMV_COLUMNS`), best of ``repeats`` each: ``(torch.sum, torch.mv of [rows, GEMV_COLUMNS] by ones)``.
    The vector and the output (a few KiB) are left out of the bytes.  Raises InvalidArgumentError below one row."""
    return RateProbe(num_bytes, None, repeats).read_rates()


def measure_gemm(size: int, repeats: int) -> float:
    """FLOP/s of a float32 ``size x size`` by ``size x size`` product (``2 * size**3`` FLOPs, best of ``repeats``)."""
    return RateProbe(None, size, repeats).gemm_flops_per_s()


class RateProbe:
    """The machine's two rates measured on demand, its buffers allocated once: the reads of
    :func:`measure_read_bandwidth` over ``read_bytes`` and the GEMM of :func:`measure_gemm` of ``gemm_size``-square
    matrices, best of ``repeats`` after one untimed call (None: that rate is not measured, and asking for it raises
    InvalidArgumentError).

    :func:`~prefixcache.bench.floor.measure_model` reads both next to every timed run: on a shared machine the memory
    bandwidth left to us drifts over seconds (on this project's Intel host, 24-31 GB/s from one minute to the next),
    so a run is held against the rate of its own moment, not of the start of a minutes-long benchmark.  A probe takes
    0.2-0.5 s (best of 2 after an untimed call: six reads of 512 MiB, or three 2048-square products).  Raises
    InvalidArgumentError for a read buffer under one row of :data:`GEMV_COLUMNS`.
    """

    def __init__(self, read_bytes: int | None, gemm_size: int | None, repeats: int) -> None:
        self.repeats = repeats
        self._data = self._matrix = self._ones = self._out = None
        if read_bytes is not None:
            rows = read_bytes // (4 * GEMV_COLUMNS)
            if rows < 1:
                raise InvalidArgumentError(
                    f"the read buffer must hold at least {4 * GEMV_COLUMNS} bytes, got {read_bytes}"
                )
            self._data = torch.ones(rows * GEMV_COLUMNS, dtype=torch.float32)
            self._matrix, self._ones = self._data.view(rows, GEMV_COLUMNS), torch.ones(GEMV_COLUMNS)
            self._out = torch.empty(rows)
        self._gemm = None
        if gemm_size is not None:
            gen = torch.Generator().manual_seed(0)
            a, b = torch.randn(gemm_size, gemm_size, generator=gen), torch.randn(gemm_size, gemm_size, generator=gen)
            self._gemm = (a, b, torch.empty(gemm_size, gemm_size))

    def read_rates(self) -> tuple[float, float]:
        """``(torch.sum, torch.mv)`` bytes per second over the buffer."""
        if self._data is None:
            raise InvalidArgumentError("this probe measures no read (read_bytes None)")
        size = self._data.numel() * 4
        by_sum = size / _best(self._data.sum, self.repeats)
        return by_sum, size / _best(lambda: torch.mv(self._matrix, self._ones, out=self._out), self.repeats)

    def read_bytes_per_s(self) -> float:
        """The faster of the two reads (the floor's bandwidth)."""
        return max(self.read_rates())

    def gemm_flops_per_s(self) -> float:
        """FLOP/s of the square product (``2 * size**3`` FLOPs)."""
        if self._gemm is None:
            raise InvalidArgumentError("this probe measures no GEMM (gemm_size None)")
        a, b, out = self._gemm
        return 2 * a.shape[0] ** 3 / _best(lambda: torch.mm(a, b, out=out), self.repeats)


def measure_machine(quick: bool, repeats: int = 5) -> MachineFloor:
    """Both rates at the current torch thread count (512 MiB read, 2048-square GEMM; quick: 64 MiB, 512); the read
    bandwidth is the faster of :func:`measure_read_bandwidth`'s two reads."""
    buffer_bytes, size = (64 << 20, 512) if quick else (512 << 20, 2048)
    by_sum, by_gemv = measure_read_bandwidth(buffer_bytes, repeats)
    return MachineFloor(
        by_sum, by_gemv, measure_gemm(size, repeats), torch.get_num_threads(), buffer_bytes, size, repeats
    )
