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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

__all__ = ["TALL_SKINNY_ROWS", "LARGE_WEIGHT", "project", "tall_skinny_linears", "large_cpu_linears"]

TALL_SKINNY_ROWS = 64
"""Rows (tokens of a forward, all batch rows together) up to which :func:`project` computes ``W @ x.T``."""


def project(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``hidden[..., H] @ weight[V, H].T + bias`` -> ``[..., V]``, as ``F.linear`` computes it (float rounding aside);
    up to :data:`TALL_SKINNY_ROWS` rows on the CPU as ``weight @ hidden.T``, else ``F.linear`` itself."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    if rows.shape[0] > TALL_SKINNY_ROWS or hidden.device.type != "cpu":
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
    """While the block runs, ``layers`` compute through :func:`project` when a forward has at most
    :data:`TALL_SKINNY_ROWS` ``rows`` (tokens); otherwise, and afterwards, as their class does.

    Sets (then removes) an instance ``forward`` on each layer, so it concerns only the forwards run inside the
    block, on the calling thread's model object: run it where nothing else uses the model at the same time.
    """
    if rows > TALL_SKINNY_ROWS or not layers:
        yield
        return
    for layer in layers:
        layer.forward = partial(_linear_forward, layer)
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
