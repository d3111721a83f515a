"""Linear layers of a few rows as tall-skinny products, for decode on the CPU.

A decode step multiplies a handful of rows (one per running request) by every weight of the model.  On the CPU,
MKL runs ``x @ W.T`` (what ``torch.nn.functional.linear`` computes) for a few rows against a large weight slower
than the same product written ``W @ x.T``: measured on this project's 2-core machine with one torch thread, 8 rows
through Qwen2.5-0.5B's 151,936 x 896 LM head take 234 ms one way and 152 ms the other (one row: 60 ms either way),
through its MLP projections 5-10% less; against small weights ``F.linear`` is the faster (see
:data:`LARGE_WEIGHT`), and from some tens of rows on the two are alike.  The results equal ``F.linear``'s up to
float rounding (another summation order).

:func:`project` is that product; :func:`tall_skinny_linears` routes a model's ``nn.Linear`` layers through it for
the duration of one of our own forwards, so the user's model object is left as it was outside them.

:class:`WeightPacks` goes further for the largest weight, the LM head: oneDNN's matmul on a copy of the weight
reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what torch.compile's CPU
"freezing" uses for linear layers), instead of MKL repacking the weight on every call.  Measured with one torch
thread on this project's 2-core machine, Qwen2.5-0.5B's LM head for 8 rows: ``F.linear`` 123 ms, ``W @ x.T`` 95 ms,
packed 51 ms; for 2-4 rows 39-77 ms -> 43-44 ms; for one row ``F.linear`` stays the fastest (37 ms, packed 42), so
one row is never routed there.  The copy costs the weight's size in memory again, made on the first forward of
2 .. :data:`TALL_SKINNY_ROWS` rows and renewed when the weight is written or rebound.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from prefixcache.models.quantize import QuantizedWeight

__all__ = [
    "TALL_SKINNY_ROWS",
    "LARGE_WEIGHT",
    "PACK_ROWS",
    "WeightPacks",
    "linear",
    "project",
    "tall_skinny_linears",
    "large_cpu_linears",
    "one_row_onednn",
    "one_row_layout",
    "lay_out_for_decode",
]

TALL_SKINNY_ROWS = 64
"""Rows (tokens of a forward, all batch rows together) up to which :func:`project` computes ``W @ x.T``."""


PACK_ROWS = 8
"""The row count oneDNN's blocked layout is chosen for by :class:`WeightPacks` (the products of any other count of
rows use it too, correctly; 8 is a decode batch of this project's benchmarks)."""


class _Pack(NamedTuple):
    weight: weakref.ref
    data_ptr: int
    version: int
    packed: torch.Tensor


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of ``weight[V, H]`` for :data:`PACK_ROWS` rows; raises RuntimeError where unsupported."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


class WeightPacks:
    """oneDNN-packed copies of CPU float32 linear weights, each made on first use and made again when its weight
    changes (another tensor, another storage, or an in-place write: its version counter moved).

    :meth:`get` returns the packed ``weight`` for :func:`project`, or None where packing does not apply (not the CPU,
    not float32, an inference-mode tensor, which keeps no version counter, a torch without oneDNN's linear ops, or a
    packing that failed once: then never tried again).  Holds no reference to a weight, only the copy, which is
    dropped when its weight is freed.  :meth:`clear` drops every copy (after a write no version counter sees: through
    ``tensor.data`` or outside torch).  ``copy``, ``deepcopy`` and pickling give an empty one (oneDNN's tensors
    have no storage to copy).  Not thread-safe for one weight packed from two threads at once (both pack; one copy
    wins).
    """

    def __init__(self) -> None:
        self._packs: dict[int, _Pack] = {}
        self._self_ref = weakref.ref(self)
        self._broken = not (
            torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        )

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of ``weight[V, H]`` (an opaque oneDNN tensor), or None (see the class)."""
        if (
            self._broken
            or weight.device.type != "cpu"
            or weight.dtype != torch.float32
            or weight.dim() != 2
            or weight.is_inference()
        ):
            return None
        entry = self._packs.get(id(weight))
        if (
            entry is not None
            and entry.weight() is weight
            and entry.data_ptr == weight.data_ptr()
            and entry.version == weight._version
        ):
            return entry.packed
        try:
            packed = _reorder(weight)
        except RuntimeError:
            self._broken = True
            self._packs.clear()
            return None
        key, owner = id(weight), self._self_ref
        ref = weakref.ref(weight, lambda dead: _forget(owner, key, dead))
        self._packs[key] = _Pack(ref, weight.data_ptr(), weight._version, packed)
        return packed

    def clear(self) -> None:
        """Drop every copy; each is made again on its weight's next packed product."""
        self._packs.clear()

    def __len__(self) -> int:
        """Copies held."""
        return len(self._packs)

    def __reduce__(self) -> tuple[type[WeightPacks], tuple[()]]:
        return (WeightPacks, ())


def _forget(owner: weakref.ref, key: int, dead: weakref.ref) -> None:
    """Weak-reference callback: drop the copy of a freed weight (unless ``key`` already holds another weight's)."""
    packs = owner()
    entry = packs._packs.get(key) if packs is not None else None
    if entry is not None and entry.weight is dead:
        packs._packs.pop(key, None)


def _packed_product(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packs: WeightPacks | None
) -> torch.Tensor | None:
    """The product through ``packs``' copy of ``weight`` for 2 .. :data:`TALL_SKINNY_ROWS` rows on the CPU, else
    None."""
    if packs is None or hidden.device.type != "cpu" or hidden.dtype != weight.dtype:
        return None
    rows = hidden.reshape(-1, hidden.shape[-1])
    if not 1 < rows.shape[0] <= TALL_SKINNY_ROWS:
        return None
    packed = packs.get(weight)
    if packed is None:
        return None
    # oneDNN reads the bias as dense: a strided one (a view) would be added wrongly.
    bias = bias.contiguous() if bias is not None else None
    out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, bias, "none", [], "")
    return out.reshape(*hidden.shape[:-1], weight.shape[0])


_ONE_ROW_ONEDNN = [False]


def one_row_onednn(enabled: bool | None = None) -> bool:
    """Whether products of one row (a decode step) on the CPU in float32 run as oneDNN's matmul on the weight as it
    lies (``torch.ops.mkldnn._linear_pointwise`` on the dense tensor: no copy, no packing); sets it when ``enabled``
    is given and returns the setting before.  Off by default (opt-in, process-wide).

    Measured on this project's 2-core AMD EPYC machine with one torch thread (thread CPU time, best of 5, weights
    cycled so that they come from DRAM): MKL's one-row product streams 15-18 GB/s, oneDNN's 18-24 GB/s (1.1-1.4x:
    Qwen2.5-0.5B's LM head 1.38x, its MLP 1.1-1.3x, its attention projections 1.2x), where ``torch.sum`` reads
    36 GB/s.  With two threads on that machine while other processes ran, oneDNN was 3-8x slower on the small
    weights (each product a parallel region waiting for a descheduled thread), hence not the default.
    """
    before = _ONE_ROW_ONEDNN[0]
    if enabled is not None:
        _ONE_ROW_ONEDNN[0] = bool(enabled)
    return before


def one_row_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight[V, H]`` with the same values laid out column-major (``weight.t().contiguous().t()``: each input
    feature's ``V`` weights side by side) where a product of one row (a decode step) reads it faster, else
    ``weight`` itself: on the CPU, in float32, when the layer widens (``V > H``).

    One row through ``F.linear`` is a matrix-vector product whose kernel, on a row-major weight of short rows (the
    896 inputs of Qwen2.5-0.5B), reads it at about half the machine's bandwidth; column-major, the same kernel streams
    long rows.  Measured with one torch thread on this project's 2-core machine (thread CPU time, weights cycled from
    DRAM, ``torch.sum`` reading 24 GB/s): the 151,936 x 896 LM head 12 -> 18 GB/s, the fused 9,728 x 896 MLP gate and
    up projections 11 -> 19 GB/s, the 1,152 x 896 Q/K/V projection 11 -> 13 GB/s; a narrowing layer (the 896 x 4,864
    down projection) gains nothing, and prefill products (1,024 rows) run within 5% either way.  No copy is kept:
    the returned tensor replaces the weight (the model's size in memory is unchanged).  Results equal the row-major
    product's up to float rounding (another summation order).
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return weight
    if weight.shape[0] <= weight.shape[1] or weight.stride() == (1, weight.shape[0]):
        return weight
    with torch.no_grad():
        return weight.t().contiguous().t()


def lay_out_for_decode(module: nn.Module) -> int:
    """Give the weight of each of :func:`large_cpu_linears` of ``module`` :func:`one_row_layout` in place
    (``weight.data`` replaced: the same parameter, the same values, other strides; a weight tied to an embedding is
    the embedding's too, whose lookups of a prefill's rows then read strided: 1,024 rows of Qwen2.5-0.5B's 10 ms).
    Returns how many weights changed.  O(weights) once."""
    changed = 0
    for layer in large_cpu_linears(module):
        laid = one_row_layout(layer.weight.data)
        if laid is not layer.weight.data:
            layer.weight.data = laid
            changed += 1
    return changed


def _one_row_product(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The product of one row through oneDNN (see :func:`one_row_onednn`), or None where it does not apply."""
    if (
        not _ONE_ROW_ONEDNN[0]
        or hidden.device.type != "cpu"
        or hidden.dtype != torch.float32
        or weight.dtype != torch.float32
        or hidden.numel() != hidden.shape[-1]
        or not weight.is_contiguous()
    ):
        return None
    bias = bias.contiguous() if bias is not None else None  # oneDNN reads the bias as dense
    out = torch.ops.mkldnn._linear_pointwise(hidden.reshape(1, -1).contiguous(), weight, bias, "none", [], "")
    return out.reshape(*hidden.shape[:-1], weight.shape[0])


def linear(
    hidden: torch.Tensor,
    weight: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None = None,
    packs: WeightPacks | None = None,
) -> torch.Tensor:
    """``F.linear(hidden[..., H], weight[V, H], bias)`` -> ``[..., V]``, through ``packs``' oneDNN copy of ``weight``
    for 2 .. :data:`TALL_SKINNY_ROWS` rows on the CPU where it has one, and for one row through oneDNN where
    :func:`one_row_onednn` is on (float rounding aside).  A :class:`~prefixcache.models.quantize.QuantizedWeight`
    computes its own product (:meth:`~prefixcache.models.quantize.QuantizedWeight.linear`)."""
    if isinstance(weight, QuantizedWeight):
        return weight.linear(hidden, bias)
    out = _one_row_product(hidden, weight, bias)
    if out is not None:
        return out
    out = _packed_product(hidden, weight, bias, packs)
    return torch.nn.functional.linear(hidden, weight, bias) if out is None else out


def project(
    hidden: torch.Tensor,
    weight: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None,
    packs: WeightPacks | None = None,
) -> torch.Tensor:
    """``hidden[..., H] @ weight[V, H].T + bias`` -> ``[..., V]``, as ``F.linear`` computes it (float rounding aside).

    On the CPU with 2 .. :data:`TALL_SKINNY_ROWS` rows: through ``packs``' copy of ``weight`` where ``packs`` is given
    and has one (oneDNN), else as ``weight @ hidden.T`` (so also one row, unless :func:`one_row_onednn` is on) for a
    row-major ``weight`` and through ``F.linear`` for another layout; more rows, another device: ``F.linear``.  A
    :class:`~prefixcache.models.quantize.QuantizedWeight` computes its own product.
    """
    if isinstance(weight, QuantizedWeight):
        return weight.linear(hidden, bias)
    rows = hidden.reshape(-1, hidden.shape[-1])
    if rows.shape[0] > TALL_SKINNY_ROWS or hidden.device.type != "cpu":
        return torch.nn.functional.linear(hidden, weight, bias)
    out = _one_row_product(hidden, weight, bias)
    if out is None:
        out = _packed_product(hidden, weight, bias, packs)
    if out is not None:
        return out
    if not weight.is_contiguous():
        # A weight laid out for one-row decode (column-major, lay_out_for_decode): ``weight @ rows.T`` on it took
        # 27 ms for 3 rows of a 4,864 x 896 projection, F.linear 1.4 ms (one thread; 2.0 ms row-major).
        return torch.nn.functional.linear(hidden, weight, bias)
    out = torch.matmul(weight, rows.t()).t()
    if bias is not None:
        out = out + bias
    return out.reshape(*hidden.shape[:-1], weight.shape[0])


def _linear_forward(layer: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    return project(hidden, layer.weight, layer.bias)


LARGE_WEIGHT = 1 << 22
"""Only layers of at least this many weights (4 Mi: 16 MiB in float32) go through :func:`project`.  Measured with
one torch thread at 8 rows: Qwen2.5-0.5B's 4,864 x 896 MLP up and gate projections 7.0 -> 6.6 ms, its 896 x 4,864
down projection 5.0 -> 4.5 ms, its LM head 234 -> 152 ms; but the 896 x 896 attention projections 0.41 -> 0.77 ms
and the embedded ``small`` model's 2,816 x 512 MLP 1.0 -> 1.8 ms: below some megabytes ``F.linear`` is faster."""


def large_cpu_linears(module: nn.Module) -> list[nn.Linear]:
    """The plain ``nn.Linear`` layers of ``module`` (subclasses, such as quantised layers, excluded) on the CPU with
    at least :data:`LARGE_WEIGHT` weights."""
    return [
        m
        for m in module.modules()
        if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.numel() >= LARGE_WEIGHT
    ]


@contextmanager
def tall_skinny_linears(layers: Sequence[nn.Linear], rows: int) -> Iterator[None]:
    """While the block runs, ``layers`` compute through :func:`project` when a forward has 2 to
    :data:`TALL_SKINNY_ROWS` ``rows`` (tokens); otherwise, and afterwards, as their class does.  One row (a decode
    step of one request) keeps ``F.linear``: the two products stream a weight equally fast there (Qwen2.5-0.5B's MLP
    projections, two threads: 0.69 against 0.70 ms, 0.72 against 0.71), and routing a call through :func:`project`
    costs some 20 us of Python, 3-5 ms in a 24-layer step of 72 such layers.

    Sets (then removes) an instance ``forward`` on each layer, so it concerns only the forwards run inside the
    block, on the calling thread's model object: run it where nothing else uses the model at the same time.
    """
    if not 1 < rows <= TALL_SKINNY_ROWS or not layers:
        yield
        return
    for layer in layers:
        layer.forward = partial(_linear_forward, layer)
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
