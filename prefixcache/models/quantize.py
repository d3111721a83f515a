"""Weight-only int8 and int4 for the models' linear layers on the CPU (``--quantize int8|int4``).

A decode step reads every weight once, so on the CPU the bytes per weight bound its speed.  Quantized once at load,
rounding to nearest (no calibration):

- ``int8``: a signed byte per weight and a bfloat16 scale per output row (symmetric, per channel: ``w = q * scale``,
  ``q`` in -127 .. 127): 1 byte a weight (+ 2 a row).  llama.cpp's Q8_0 keeps a scale per 32 weights; PyTorch's
  kernel (``torch.ops.aten._weight_int8pack_mm``) takes one per row.
- ``int4``: four bits per weight in groups of :data:`DEFAULT_GROUP_SIZE` along K, each group with a bfloat16 scale and
  offset (asymmetric: ``w = (q - 8) * scale + zero``, ``q`` in 0 .. 15, from the group's minimum and maximum): 0.625
  bytes a weight at groups of 32.  llama.cpp's Q4_1 block, and the group-wise int4 of GPTQ and AWQ (without their
  calibration), in the packed layout of PyTorch's CPU kernel (``_convert_weight_to_int4pack_for_cpu``,
  ``_weight_int4pack_mm_for_cpu``).  The LM head stays int8 (:data:`HEAD_MODES`).

The kernels take bfloat16 activations: a float32 model's activations are rounded to bfloat16 at each quantized
layer's input, and its output (accumulated in float32, returned in bfloat16) goes back to the model's dtype.  With
float32 or float16 activations the same kernels run a slower path (this project's 2-core AMD EPYC, AVX2 only, one row
through a 151,936 x 896 weight: int8 420 ms against 100-116 with bfloat16).  Forwards of more than :data:`KERNEL_ROWS`
rows (a long prefill) multiply by the dequantized weight instead, a slice at a time, with the same bfloat16 rounding at
input and output, so that both paths compute the same numbers up to float32 summation order.  A quantized LM head's
logits are bfloat16 values (0.125 apart at 16-32), so near ties are exact ties more often than in float32.

Which layers: every ``nn.Linear`` of a Hugging Face model (:func:`quantize_modules`), the embedded model's fused
projections and LM head (``LlamaModel.quantize``).  Embedding lookups read one row a token, so an untied embedding
stays dense; an embedding tied to the LM head becomes a :class:`QuantizedEmbedding` reading the head's codes (no second
dense copy).  A layer the kernel cannot take stays dense and is named in the :class:`QuantizeSummary`: int8 needs K a
multiple of 8 (with other K the AVX2 kernel gave wrong sums or crashed), int4 needs N a multiple of 16 and K a
multiple of the group size.  CPU only: on another device quantizing raises InvalidArgumentError.

Speed, measured on that machine while other work ran on it (load average given; medians of interleaved runs in one
process).  The kernels are compute-bound on AVX2: the int8 one reads 1-3 GB/s of weight where a float32 product reads
5-10, so int8 gains little over float32 there; int4 gains more.

- One row through Qwen2.5-0.5B's 151,936 x 896 LM head, 9 runs, load 4.0, two threads: float32 ``F.linear`` 129 ms
  (its column-major layout, :mod:`.linear`, 106), bfloat16 100, int8 116, int4 76 (groups of 64: 70); one thread:
  float32 106 (column-major), int8 100, int4 54.
- One row through SmolLM2's 576 x 1,536 down projection, one thread, load 5: float32 0.50 ms, int8 0.26, int4 0.21.
  With two threads on the loaded machine the kernels' parallel regions wait for a descheduled thread (medians 15 ms
  where the minimum is 0.1-0.3); MKL runs such small float32 products on one thread and does not wait.
- Decode tokens/s (one request, 64-token context, 7-9 rounds of 8 steps), two threads and one:
  the ``small`` preset (load 1.7): float32 62 / 74, bfloat16 89 / 76, int8 93 / 94, int4 103 / 115;
  SmolLM2 (load 2.5-3.0): float32 8.4 / 5.3, bfloat16 16.9 / 7.4, int8 15.4 / 6.2, int4 17.0 / 8.1.

Quality: SmolLM2-135M-Instruct quantized from its float32 weights (which are its GGUF's Q4_1 and Q8_0 blocks
dequantized: int4 in groups of 32 nearly restores those blocks, so its figures flatter int4), against that float32
model at every position of six real prompts (MT-Bench and OpenAssistant, 576 tokens; logits up to 43), measured by
``pytest -s tests/models/test_quantize_smollm2.py -k float32_models``: the same greedy token at 96.5% of positions for
int8 (logit error max 2.4, mean 0.29) and 94.8% for int4 (max 2.7, mean 0.17).  On 869 positions of the same kind
(160-token prompts): bfloat16 97.2% (max 1.2, mean 0.13), int8 96.4%, int4 with an int4 head 84.3%, int4 in groups of
64 with an int8 head 64.9% (max 22).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from prefixcache.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "HEAD_MODES",
    "INT4_GROUP_SIZES",
    "KERNEL_ROWS",
    "QUANTIZE_MODES",
    "QuantizeSummary",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "QuantizedWeight",
    "parse_quantize",
    "quantize_modules",
    "quantize_tensors",
    "quantize_weight",
    "quantized_buffers",
    "unquantizable",
    "weight_tensors",
]

QUANTIZE_MODES = ("none", "int8", "int4")
"""The values of ``--quantize`` and of ``load_model(..., quantize=)``."""

INT4_GROUP_SIZES = (32, 64, 128, 256)
"""The group sizes the int4 kernel takes (weights along K sharing one scale and offset)."""

DEFAULT_GROUP_SIZE = 32
"""int4's group size, where K allows (else the layer stays dense): llama.cpp's Q4_0/Q4_1 block.  On SmolLM2, groups of
64 agreed with the float32 model's greedy token at 65% of positions where 32 agreed at 96% (the module's quality
figures), for 0.5625 against 0.625 bytes a weight, at about the same kernel speed (70 against 76 ms, the head above)."""

HEAD_MODES = {"int8": "int8", "int4": "int8"}
"""The LM head's quantization under each mode (and that of an embedding tied to it).  int4 keeps the head in int8, as
llama.cpp's Q4_K_M keeps its output weight at 6 bits: on SmolLM2 an int4 head moved the greedy token at 16% of
positions where the layers' int4 moved 2% (the module's quality figures)."""

KERNEL_ROWS = {"int8": 128, "int4": 512}
"""Rows (tokens of a forward) up to which a quantized product runs the kernel; more multiply by the dequantized
weight (:data:`DEQUANT_WEIGHTS` at a time).  Measured with one thread on SmolLM2's 1,536 x 576 MLP weight (medians of
11, interleaved, load average 2-3): int8 kernel 9.6 ms at 128 rows, dequantized 9.8, at 256 rows 16.7 and 10.3; int4
kernel 18 ms at 256 rows, dequantized 26, at 512 rows 39 and 33."""

DEQUANT_WEIGHTS = 1 << 21
"""Weights dequantized at a time (8 MiB of float32) for a product of more than :data:`KERNEL_ROWS` rows."""

_BLOCK = 32  # rows of one block of the int4 kernel's packed layout


def parse_quantize(mode: str | None) -> str:
    """``mode`` checked: one of :data:`QUANTIZE_MODES` (None: ``"none"``).  Raises InvalidArgumentError otherwise."""
    chosen = "none" if mode is None else mode
    if chosen not in QUANTIZE_MODES:
        raise InvalidArgumentError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANTIZE_MODES)}")
    return chosen


class QuantizedWeight:
    """A linear layer's weight ``[N, K]`` (``out_features``, ``in_features``) quantized by :func:`quantize_weight`.

    ``codes``: int8 ``[N, K]`` (``int8``) or uint8 ``[N, K / 2]`` in the int4 kernel's packed layout (``int4``).
    ``scales``: bfloat16 ``[N]`` (``int8``) or ``[K / group_size, N, 2]``, each group's scale and offset (``int4``).
    Not a tensor: :func:`~prefixcache.models.linear.linear` and :func:`~prefixcache.models.linear.project` call
    :meth:`linear` for it.
    """

    __slots__ = ("mode", "codes", "scales", "out_features", "in_features", "group_size")

    def __init__(
        self, mode: str, codes: torch.Tensor, scales: torch.Tensor, out_features: int, in_features: int, group_size: int
    ) -> None:
        self.mode = mode
        self.codes = codes
        self.scales = scales
        self.out_features = out_features
        self.in_features = in_features
        self.group_size = group_size
        """Weights along K sharing a scale: ``in_features`` for int8 (one per row)."""

    @property
    def shape(self) -> torch.Size:
        """``[N, K]``, the dense weight's shape."""
        return torch.Size((self.out_features, self.in_features))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def numel(self) -> int:
        """Weights stood for: ``N * K``."""
        return self.out_features * self.in_features

    @property
    def nbytes(self) -> int:
        """Bytes held: codes and scales."""
        return self.codes.nbytes + self.scales.nbytes

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes, scales)``, for fingerprints and version counters."""
        return self.codes, self.scales

    def linear(self, hidden: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden[..., K] @ W.T + bias`` -> ``[..., N]`` in ``hidden``'s dtype, ``W`` the dequantized weight.

        ``hidden`` is rounded to bfloat16 and the product (accumulated in float32) to bfloat16 before the cast back
        and the bias: up to :data:`KERNEL_ROWS` rows by the kernel, more as a float32 product with the weight
        dequantized :data:`DEQUANT_WEIGHTS` at a time.  O(rows * N * K)."""
        rows = hidden.reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            out = rows.new_zeros(0, self.out_features, dtype=torch.bfloat16)
        elif rows.shape[0] <= KERNEL_ROWS[self.mode] or (self.mode == "int4" and not _int4_layout_known()):
            x = rows.to(torch.bfloat16).contiguous()
            if self.mode == "int8":
                out = torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)
            else:
                out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.codes, self.group_size, self.scales)
        else:
            out = self._dense_product(rows)
        out = out.to(hidden.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*hidden.shape[:-1], self.out_features)

    def _dense_product(self, rows: torch.Tensor) -> torch.Tensor:
        """bfloat16 ``[M, N]``: ``rows`` rounded to bfloat16, times the weight dequantized in slices of rows."""
        x = rows.to(torch.bfloat16).float()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.bfloat16, device=rows.device)
        step = max(_BLOCK, DEQUANT_WEIGHTS // self.in_features // _BLOCK * _BLOCK)
        for first in range(0, self.out_features, step):
            last = min(first + step, self.out_features)
            out[:, first:last] = torch.nn.functional.linear(x, self.dequantize(first, last))
        return out

    def dequantize(self, first: int = 0, last: int | None = None) -> torch.Tensor:
        """float32 ``[last - first, K]``: rows ``first .. last - 1`` of the weight the codes stand for."""
        last = self.out_features if last is None else last
        if self.mode == "int8":
            return self.codes[first:last].float() * self.scales[first:last].float()[:, None]
        if first % _BLOCK or (last % _BLOCK and last != self.out_features) or self.out_features % _BLOCK:
            return self.rows(torch.arange(first, last, device=self.codes.device))
        blocks = self.codes[first:last].view(-1, self.in_features, _BLOCK // 2)  # [blocks, K, 16]
        codes = torch.cat([blocks & 15, blocks >> 4], dim=-1).transpose(1, 2).reshape(last - first, -1)
        return self._scaled(codes, self.scales[:, first:last])

    def _scaled(self, codes: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """float32 ``[m, K]`` of int4 ``codes[m, K]`` and their groups' ``[K / g, m, 2]`` scales and offsets."""
        grouped = (codes.float() - 8).view(codes.shape[0], -1, self.group_size)
        groups = groups.float()
        scaled = grouped * groups[..., 0].t()[..., None] + groups[..., 1].t()[..., None]
        return scaled.view(codes.shape[0], -1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 ``[*ids.shape, K]``: the dequantized rows ``ids`` (an embedding's lookup of a tied LM head)."""
        flat = ids.reshape(-1)
        if self.mode == "int8":
            out = self.codes[flat].float() * self.scales[flat].float()[:, None]
        else:
            codes = _int4_rows(self.codes, flat, self.out_features, self.in_features)
            out = self._scaled(codes, self.scales[:, flat])
        return out.view(*ids.shape, self.in_features)

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.mode}, [{self.out_features}, {self.in_features}], group_size={self.group_size})"


def _int4_rows(packed: torch.Tensor, ids: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """uint8 ``[m, K]``: the 4-bit codes of rows ``ids[m]`` read from the kernel's packed ``[N, K / 2]``.

    The layout (checked once per process by :func:`_int4_layout_known`): rows in blocks of 32, a block's bytes
    ``[K, 16]``, row ``r`` of it in the low nibbles of column ``r`` (``r < 16``) or the high ones of ``r - 16``; a last
    block of 16 rows ``[K, 8]``, even rows in the low nibbles, odd ones in the high."""
    full = n // _BLOCK * _BLOCK
    out = torch.empty(ids.numel(), k, dtype=torch.uint8, device=packed.device)
    in_blocks = ids < full
    if bool(in_blocks.all()):
        picked = ids
        blocks = packed[:full].view(-1, k, _BLOCK // 2)
        shift = (picked % _BLOCK // (_BLOCK // 2) * 4).to(torch.uint8)
        return (blocks[picked // _BLOCK, :, picked % (_BLOCK // 2)] >> shift[:, None]) & 15
    picked = ids[in_blocks]
    if picked.numel():
        blocks = packed[:full].view(-1, k, _BLOCK // 2)
        shift = (picked % _BLOCK // (_BLOCK // 2) * 4).to(torch.uint8)
        out[in_blocks] = (blocks[picked // _BLOCK, :, picked % (_BLOCK // 2)] >> shift[:, None]) & 15
    tail_rows = ids[~in_blocks] - full
    tail = packed[full:].view(k, (n - full) // 2)
    shift = (tail_rows % 2 * 4).to(torch.uint8)
    out[~in_blocks] = (tail[:, tail_rows // 2].t() >> shift[:, None]) & 15
    return out


@functools.cache
def _int4_layout_known() -> bool:
    """Whether :func:`_int4_rows` reads this torch's packed int4 layout right (a 48 x 64 probe: one block and a
    tail); where not, every int4 product runs the kernel."""
    codes = torch.randint(0, 16, (48, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return bool(torch.equal(_int4_rows(packed, torch.arange(48), 48, 64).int(), codes))


def int4_group_size(in_features: int, group_size: int | None = None) -> int | None:
    """The int4 group size for K = ``in_features``: ``group_size`` (default :data:`DEFAULT_GROUP_SIZE`) where it
    divides K, else the largest smaller one of :data:`INT4_GROUP_SIZES` that does; None where none does."""
    wanted = DEFAULT_GROUP_SIZE if group_size is None else group_size
    return next((g for g in sorted(INT4_GROUP_SIZES, reverse=True) if g <= wanted and in_features % g == 0), None)


def unquantizable(weight: torch.Tensor, mode: str, group_size: int | None = None) -> str | None:
    """Why ``weight`` cannot be quantized in ``mode`` (a short reason), or None where it can."""
    if weight.dim() != 2 or not weight.is_floating_point():
        return f"not a 2-D floating weight ({weight.dtype}, {tuple(weight.shape)})"
    if weight.device.type != "cpu":
        return f"on {weight.device.type} (the kernels are the CPU's)"
    n, k = weight.shape
    if mode == "int8" and k % 8:
        return f"K = {k} is not a multiple of 8"
    if mode == "int4" and n % 16:
        return f"N = {n} is not a multiple of 16"
    if mode == "int4" and int4_group_size(k, group_size) is None:
        wanted = DEFAULT_GROUP_SIZE if group_size is None else group_size
        return f"K = {k} is a multiple of no group size of the kernel up to {wanted}"
    return None


def quantize_weight(weight: torch.Tensor, mode: str, group_size: int | None = None) -> QuantizedWeight:
    """``weight[N, K]`` (any floating dtype, any strides, on the CPU) quantized to ``mode`` (``"int8"`` or
    ``"int4"``, groups of ``group_size`` along K: see :func:`int4_group_size`), rounding to nearest.  Works through
    the rows a few MiB at a time (the memory it takes beyond the result is bounded).  O(N * K).

    Raises InvalidArgumentError: another mode, a group size the kernel does not take, or a weight it cannot take
    (:func:`unquantizable` says why)."""
    _check_mode(mode, group_size)
    reason = unquantizable(weight, mode, group_size)
    if reason is not None:
        raise InvalidArgumentError(f"cannot quantize this weight to {mode}: {reason}")
    n, k = weight.shape
    step = max(_BLOCK, DEQUANT_WEIGHTS // k // _BLOCK * _BLOCK)
    codes, scales = [], []
    with torch.no_grad():
        if mode == "int8":
            for first in range(0, n, step):
                w = weight[first : first + step].float()
                # Rounded up past bfloat16's rounding, so that no code needs more than 127.
                scale = (w.abs().amax(1).clamp(min=1e-30) / 127 * (1 + 2**-7)).to(torch.bfloat16)
                codes.append(torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8))
                scales.append(scale)
            return QuantizedWeight("int8", torch.cat(codes), torch.cat(scales), n, k, k)
        group = int4_group_size(k, group_size)
        for first in range(0, n, step):
            w = weight[first : first + step].float().view(-1, k // group, group)
            low, high = w.amin(-1), w.amax(-1)
            scale = ((high - low) / 15).clamp(min=1e-30).to(torch.bfloat16)
            zero = (low + 8 * scale.float()).to(torch.bfloat16)
            q = torch.round((w - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp(0, 15)
            codes.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).view(-1, k), 1))
            scales.append(torch.stack([scale, zero], -1).transpose(0, 1))
        return QuantizedWeight("int4", torch.cat(codes), torch.cat(scales, 1).contiguous(), n, k, group)


def _check_mode(mode: str, group_size: int | None) -> None:
    """Raise InvalidArgumentError unless ``mode`` is ``"int8"`` or ``"int4"`` and ``group_size`` None or one of
    :data:`INT4_GROUP_SIZES`."""
    if mode not in ("int8", "int4"):
        raise InvalidArgumentError(f"quantization needs mode 'int8' or 'int4', got {mode!r}")
    if group_size is not None and group_size not in INT4_GROUP_SIZES:
        raise InvalidArgumentError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")


def weight_tensors(weight: torch.Tensor | QuantizedWeight) -> list[torch.Tensor]:
    """The tensors that hold ``weight``: itself, or a :class:`QuantizedWeight`'s codes and scales."""
    return list(weight.tensors()) if isinstance(weight, QuantizedWeight) else [weight]


@dataclass(frozen=True, slots=True)
class QuantizeSummary:
    """What a model's quantization did: ``mode``, int4's ``group_size`` (None for int8, per channel), the LM head's
    ``head_mode`` (:data:`HEAD_MODES`; None where the model has no head among the weights), the ``quantized`` layers'
    names, the ``dense`` ones (``"name: reason"``), and the bytes of the quantized layers' weights before
    (``dense_bytes``) and after (``quantized_bytes``)."""

    mode: str
    group_size: int | None
    head_mode: str | None
    quantized: tuple[str, ...]
    dense: tuple[str, ...]
    dense_bytes: int
    quantized_bytes: int

    def describe(self) -> str:
        """``"int8 (per channel)"`` or ``"int4 (groups of 32, LM head int8)"``, with the count of layers left dense,
        if any."""
        parts = ["per channel" if self.group_size is None else f"groups of {self.group_size}"]
        if self.head_mode is not None and self.head_mode != self.mode:
            parts.append(f"LM head {self.head_mode}")
        if self.dense:
            parts.append(f"{len(self.dense)} layers dense")
        return f"{self.mode} ({', '.join(parts)})"


class _Tally:
    """The summary's lists, kept while layers are quantized one by one."""

    def __init__(self, mode: str, group_size: int | None) -> None:
        _check_mode(mode, group_size)
        self.mode, self.group_size = mode, group_size
        self.head_mode: str | None = None
        self.done: dict[str, tuple[int, int]] = {}
        self.dense: list[str] = []

    def quantize(self, name: str, weight: torch.Tensor, head: bool) -> QuantizedWeight | None:
        """``weight`` quantized (in :data:`HEAD_MODES`' mode for the ``head``), or None where it stays dense."""
        mode = HEAD_MODES[self.mode] if head else self.mode
        reason = unquantizable(weight, mode, self.group_size)
        if reason is not None:
            self.dense.append(f"{name}: {reason}")
            return None
        quantized = quantize_weight(weight, mode, self.group_size)
        self.done[name] = (weight.nbytes, quantized.nbytes)
        if head:
            self.head_mode = mode
        return quantized

    def summary(self) -> QuantizeSummary:
        group = None if self.mode == "int8" else (self.group_size or DEFAULT_GROUP_SIZE)
        before = sum(dense for dense, _ in self.done.values())
        after = sum(quantized for _, quantized in self.done.values())
        return QuantizeSummary(self.mode, group, self.head_mode, tuple(self.done), tuple(self.dense), before, after)


def quantize_tensors(
    weights: dict[str, torch.Tensor], mode: str, group_size: int | None = None, *, head: str | None = None
) -> tuple[dict[str, torch.Tensor | QuantizedWeight], QuantizeSummary]:
    """Each of ``weights`` (name -> ``[N, K]``) quantized where :func:`unquantizable` allows, else left as it is; the
    one named ``head`` (the LM head) in :data:`HEAD_MODES`' mode.  Returns the new mapping and the summary.  Raises
    InvalidArgumentError as :func:`quantize_weight` for a mode or group size, before anything is quantized."""
    tally = _Tally(mode, group_size)
    out: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name, weight in weights.items():
        quantized = tally.quantize(name, weight, name == head)
        out[name] = weight if quantized is None else quantized
    return out, tally.summary()


class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is a :class:`QuantizedWeight` (``weight``, made from the ``codes`` and ``scales``
    buffers); ``bias`` stays as it was.  ``forward(hidden[..., K])`` -> ``[..., N]`` in ``hidden``'s dtype
    (:meth:`QuantizedWeight.linear`)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.mode, self.group_size = weight.mode, weight.group_size
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.register_buffer("codes", weight.codes)
        self.register_buffer("scales", weight.scales)
        if isinstance(bias, nn.Parameter) or bias is None:
            self.register_parameter("bias", bias)
        else:
            self.register_buffer("bias", bias)

    @property
    def weight(self) -> QuantizedWeight:
        """The quantized weight over the module's current buffers (after ``.to()`` too)."""
        return QuantizedWeight(self.mode, self.codes, self.scales, self.out_features, self.in_features, self.group_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.weight.linear(hidden, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.mode}, group_size={self.group_size}"


class QuantizedEmbedding(nn.Module):
    """An ``nn.Embedding`` tied to a :class:`QuantizedLinear` LM head: it shares the head's ``codes`` and ``scales``
    and looks up dequantized rows.  ``forward(ids[...])`` -> ``[..., K]`` in ``dtype`` (the embedding's before)."""

    def __init__(self, head: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.head = [head]  # a list: not a submodule (its buffers are registered here too, the same tensors)
        self.dtype = dtype
        self.register_buffer("codes", head.codes)
        self.register_buffer("scales", head.scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        weight = QuantizedWeight(
            head.mode, self.codes, self.scales, head.out_features, head.in_features, head.group_size
        )
        return weight.rows(ids).to(self.dtype)


def quantize_modules(
    root: nn.Module, mode: str, group_size: int | None = None, *, head: nn.Module | None = None
) -> QuantizeSummary:
    """Replace every ``nn.Linear`` (that class, not a subclass) under ``root`` by a :class:`QuantizedLinear` where the
    kernel takes its weight (``head``, the LM head, in :data:`HEAD_MODES`' mode), and every ``nn.Embedding`` whose
    weight is a replaced layer's (tied) by a :class:`QuantizedEmbedding`; the others stay and are named in the summary.
    O(weights).  Raises InvalidArgumentError as :func:`quantize_weight` for a mode or group size, before anything
    changes."""
    tally = _Tally(mode, group_size)
    linears = [(name, m) for name, m in root.named_modules() if type(m) is nn.Linear]
    embeddings = [(name, m) for name, m in root.named_modules() if type(m) is nn.Embedding]
    replaced: dict[int, QuantizedLinear] = {}
    for name, module in linears:
        weight = tally.quantize(name, module.weight, module is head)
        if weight is not None:
            replaced[id(module.weight)] = quantized = QuantizedLinear(weight, module.bias)
            _replace(root, name, quantized)
    for name, module in embeddings:
        tied = replaced.get(id(module.weight))
        if tied is not None:
            _replace(root, name, QuantizedEmbedding(tied, module.weight.dtype))
    return tally.summary()


def _replace(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


def quantized_buffers(root: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the codes and scales of every quantized module under ``root`` (once each), by name."""
    kinds = (QuantizedLinear, QuantizedEmbedding)
    return sorted(
        (f"{name}.{key}", module._buffers[key])
        for name, module in root.named_modules()
        if isinstance(module, kinds)
        for key in ("codes", "scales")
    )
