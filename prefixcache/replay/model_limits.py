"""What a replay with a model checks before it runs: ``--verify``'s tolerance for the model's dtype and layers, and
the memory free on its device for the KV pool."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_ATOL", "HALF_ATOL", "RECURRENT_ATOL", "default_atol", "free_memory_bytes", "gib"]

DEFAULT_ATOL = 1e-4
"""``--verify``'s tolerance on fp32 logits: cached against uncached."""
RECURRENT_ATOL = 5e-3
"""``--verify``'s tolerance for a model with recurrent layers: its chunked scans round differently when a forward is
split where the prefill keeps states (up to ~2.5e-3 on tiny random models with logits near 8; the model's own
``generate`` differs from its full forward as much), so cached and uncached logits agree to this, and greedy tokens
too except where the reference's top two are within it (a near tie the rounding may flip)."""


HALF_ATOL = 2.0
"""``--verify``'s tolerance on the logits of a bfloat16 or float16 model, greedy tokens compared as for a recurrent
model (equal except where the reference's top two are within it).  A prefill split where the cache ends rounds
differently from one forward over the whole prompt: on SmolLM2-135M in bfloat16 the two differ by up to 1.0 (logits
near 20, where a bfloat16 step is 0.125), and transformers' own forward split at the same place gives prefixcache's
cached logits bit for bit (``tests/models/test_smollm2.py``)."""


def default_atol(model: Any) -> float:
    """``--verify``'s tolerance for ``model``: :data:`RECURRENT_ATOL` with recurrent layers, :data:`HALF_ATOL` in
    bfloat16 / float16 or with quantized weights (``--quantize``: bfloat16 activations at each quantized layer), else
    :data:`DEFAULT_ATOL`."""
    if getattr(model, "recurrent", False):
        return RECURRENT_ATOL
    if getattr(model, "quantization", None) is not None:
        return HALF_ATOL
    return HALF_ATOL if str(getattr(model, "dtype", "")) in ("torch.bfloat16", "torch.float16") else DEFAULT_ATOL


def free_memory_bytes(device: torch.device | str) -> int | None:
    """Bytes free for new tensors on ``device``: the CUDA driver's count, or the kernel's ``MemAvailable`` for the
    CPU; ``None`` when unknown."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def gib(num_bytes: int) -> str:
    """``num_bytes`` in GiB with one decimal: ``"1.5 GiB"``."""
    return f"{num_bytes / 2**30:,.1f} GiB"
