"""bf16 <-> float32 conversion on NumPy arrays, bit-identical to libepd's helpers.

NumPy has no bfloat16 type, so epd carries bf16 tensors as ``uint16`` arrays holding the bits.
These helpers convert exactly as ``epd_float_to_bf16`` / ``epd_bf16_to_float`` (epd.h) do:
round to nearest even, every NaN becomes ``0x7FFF`` (what CUDA's ``__float2bfloat16_rn`` gives),
infinities and signed zeros are kept.
"""

import numpy as np


def float_to_bf16(x):
    """Rounds ``x`` to bf16 (round to nearest even) and returns the bits as ``uint16``.

    ``x`` is anything ``np.asarray`` accepts. It is converted to float32 first, so a float64
    input is rounded twice (to float32, then to bf16); pass float32 when that matters.
    The result has ``x``'s shape and is a new C-contiguous array.
    """
    f = np.ascontiguousarray(x, dtype=np.float32)
    bits = f.view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    out[np.isnan(f)] = np.uint16(0x7FFF)
    return out


def bf16_to_float(bits):
    """Widens bf16 bits to float32, exactly.

    ``bits`` is a ``uint16`` or ``int16`` array of bf16 bit patterns (or an array of a 2-byte
    bfloat16 extension type such as ``ml_dtypes.bfloat16``). Returns a new float32 array.
    """
    b = np.asarray(bits)
    if b.dtype.itemsize != 2 or b.dtype.kind == "f":
        raise TypeError("bf16_to_float takes bf16 bits as uint16, not %s" % b.dtype)
    return (b.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_bf16(x):
    """``x`` rounded to the nearest bf16 value, as float32 (``bf16_to_float(float_to_bf16(x))``)."""
    return bf16_to_float(float_to_bf16(x))
