"""Turning caller-supplied token ids into the compact form the cache stores.

The radix tree keeps token ids as ``array('I')`` (4 bytes a token, compared at C speed by slice equality)
instead of lists of Python ints (about 36 bytes a token).  :func:`as_token_array` accepts every form a
caller is likely to hold and rejects everything else with :class:`~prefixcache.errors.InvalidTokensError`.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from prefixcache.errors import InvalidTokensError

TOKEN_TYPECODE = "I"
"""``array`` typecode of stored token ids: unsigned 32-bit, so ids are 0 .. 2**32 - 1."""

MAX_TOKEN_ID = 2**32 - 1

BOOL_SCAN_TOKENS = 64
"""From this length on, bools in a list are looked for with one numpy pass over the converted ids (about 1 us
whatever the length) instead of a pass over the element types (about 20 ns a token)."""

TokenIds = Sequence[int] | array | Any
"""What the public API accepts: list, tuple, ``array``, 1-D integer numpy array or 1-D integer CPU tensor."""


def as_token_array(token_ids: TokenIds, *, allow_empty: bool = False) -> array:
    """Validate ``token_ids`` and return them as ``array('I')``.

    Accepts a list or tuple of ints, an ``array.array`` of an integer typecode, a 1-D integer numpy array
    or a 1-D integer torch tensor on the CPU.  Cost is O(n) at C speed on the happy path; an ``array('I')`` is
    returned as is, in O(1).

    Raises:
        InvalidTokensError: empty (unless ``allow_empty``), not 1-D, not integers (floats, bools in a tensor,
            nested lists, strings), bytes-like (``bytes``, ``bytearray``, ``memoryview``), negative, above
            ``MAX_TOKEN_ID``, or a tensor that is not dense or not on the CPU.
    """
    if type(token_ids) is array and token_ids.typecode == TOKEN_TYPECODE and (allow_empty or len(token_ids)):
        # Already what the tree stores (the form hot callers pre-convert to): skip the dispatch below.
        return token_ids
    if isinstance(token_ids, array):
        if token_ids.typecode == TOKEN_TYPECODE:
            out = token_ids
        elif token_ids.typecode in "bBhHiIlLqQ":
            # The array module's typecodes are numpy's type characters for the same C types.
            out = _from_ndarray(np.frombuffer(token_ids, np.dtype(token_ids.typecode))) if token_ids else array("I")
        else:
            raise InvalidTokensError(f"token ids must be integers, got array of typecode {token_ids.typecode!r}")
    elif isinstance(token_ids, (list, tuple)):
        out = _from_list(token_ids)
    elif _is_tensor(token_ids):
        out = _from_tensor(token_ids)
    elif _is_ndarray(token_ids):
        out = _from_ndarray(token_ids)
    elif isinstance(token_ids, (bytes, bytearray, memoryview)):
        # Iterating a bytes-like object gives one int per byte, which would pass as ids 0..255: raw bytes (text not
        # yet tokenized, a buffer of another width) are never a caller's token ids.
        raise InvalidTokensError(
            f"token ids must be a list/tuple/array/1-D integer tensor of ints, got {type(token_ids).__name__}: "
            "bytes are not token ids (tokenize text first; wrap a buffer of ids in array('I', ...) or numpy)"
        )
    elif isinstance(token_ids, (str, dict, set, frozenset)) or not hasattr(token_ids, "__iter__"):
        raise InvalidTokensError(
            f"token ids must be a list/tuple/array/1-D integer tensor of ints, got {type(token_ids).__name__}"
        )
    else:
        out = _from_list(list(token_ids))
    if not allow_empty and len(out) == 0:
        raise InvalidTokensError("token ids must not be empty: at least one token is needed")
    return out


def _from_list(values: Sequence[Any]) -> array:
    try:
        # 'I' rejects negatives, floats and values >= 2**32 in C.  bool is an int subclass that 'I' accepts, so
        # look for it separately.
        out = array(TOKEN_TYPECODE, values)
    except (TypeError, OverflowError, ValueError):
        pass
    else:
        if not _holds_bool(values, out):
            return out
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidTokensError(
                f"token id at index {index} is {value!r} of type {type(value).__name__}; "
                "token ids must be non-negative Python ints (a flat, 1-D sequence)"
            ) from None
        if value < 0 or value > MAX_TOKEN_ID:
            raise InvalidTokensError(
                f"token id at index {index} is {value}; allowed token ids are 0 .. {MAX_TOKEN_ID}"
            ) from None
    raise InvalidTokensError("token ids could not be converted to unsigned 32-bit integers")


def _holds_bool(values: Sequence[Any], converted: array) -> bool:
    """Whether ``values`` (a list or tuple, already converted to ``converted``) holds a bool.  A bool converts to 0
    or 1, so a long sequence is scanned at C speed for ids below 2 and only the elements there are looked at: O(n)
    in numpy plus O(number of ids 0 and 1) in Python.  A short one is one pass over the element types."""
    if len(converted) < BOOL_SCAN_TOKENS:
        return bool in set(map(type, values))
    ids = np.frombuffer(converted, np.uintc)
    # argmin, not min(): a ufunc reduction costs twice as much on a request's ids.
    if ids[ids.argmin()] > 1:
        return False
    return any(type(values[i]) is bool for i in np.flatnonzero(ids <= 1).tolist())


def _is_tensor(obj: object) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "dtype") and hasattr(obj, "device")


def _is_ndarray(obj: object) -> bool:
    return type(obj).__module__ == "numpy" and hasattr(obj, "dtype") and hasattr(obj, "ndim")


def _from_tensor(tensor: Any) -> array:
    import torch

    if tensor.device.type != "cpu":
        raise InvalidTokensError(
            f"token ids must be a CPU tensor (token ids are metadata), got a tensor on {tensor.device}"
        )
    if tensor.dim() != 1:
        raise InvalidTokensError(f"token ids must be 1-D, got a tensor of shape {tuple(tensor.shape)}")
    if tensor.layout != torch.strided:  # a sparse tensor has no storage to read ids from
        raise InvalidTokensError(f"token ids must be a dense tensor, got layout {tensor.layout}")
    if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
        raise InvalidTokensError(f"token ids must be an integer tensor, got dtype {tensor.dtype}")
    try:
        values = tensor.detach().numpy()
    except (TypeError, RuntimeError):  # an integer dtype numpy has no match for: element by element
        return _from_list(tensor.tolist())
    return _from_ndarray(values)


def _from_ndarray(values: Any) -> array:
    """A 1-D integer array's ids in one C-speed conversion (O(n), no Python int per token); out-of-range ids go the
    element-by-element way, whose error names the first of them."""
    if values.ndim != 1:
        raise InvalidTokensError(f"token ids must be 1-D, got an array of shape {values.shape}")
    if values.dtype.kind not in "iu":
        raise InvalidTokensError(f"token ids must be an integer array, got dtype {values.dtype}")
    out = array(TOKEN_TYPECODE)
    if values.size:
        if values[values.argmin()] < 0 or values[values.argmax()] > MAX_TOKEN_ID:
            return _from_list(values.tolist())
        out.frombytes(values.astype(np.uintc).tobytes())
    return out
