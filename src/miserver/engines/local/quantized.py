"""Products with a quantized matrix: ``quantized.c``, built and loaded by ``native``.

A GGUF ``Q4_1`` or ``Q8_0`` matrix (groups of 32 inputs sharing a float16 scale, and for ``Q4_1`` a float16 minimum)
reaches the slot forward dequantized to float32 by transformers, four bytes a weight. The kernel reads the
quantized bits instead (half a byte or one byte a weight, and a scale a group) and computes the float32 product up to
the rounding of its additions (see the C source for the order); a row's result never depends on the other rows. On a
CPU whose decode step is bound by reading weights, a product of a few rows then costs what reading those bytes costs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from miserver.engines.local import native

SOURCE = Path(__file__).with_name("quantized.c")
#: Input columns per group: the block of GGUF's Q4_1 and Q8_0 (``GROUP`` in the C source).
GROUP = 32


class QuantizedProducts:
    """The loaded kernel (see the module)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        self._int8 = library.miserver_int8_product
        self._int8.argtypes = [pointer] * 4 + [i64] * 3 + [ctypes.c_int]
        self._int8.restype = ctypes.c_int
        self._int4 = library.miserver_int4_product
        self._int4.argtypes = [pointer] * 5 + [i64] * 3 + [ctypes.c_int]
        self._int4.restype = ctypes.c_int

    def int8(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``x @ (scales * q).T``: ``x`` ``[rows, in]`` float32, ``q`` ``[out, in]`` int8, ``scales`` ``[out, in /
        32]`` float32, each group's scale; returns ``[rows, out]`` float32. Raises ``ValueError`` when ``in`` is not
        a multiple of 32 or the shapes disagree."""
        out = _checked(x, q, scales, q.shape[1], torch.int8)
        y = torch.empty((x.shape[0], out), dtype=torch.float32, device=x.device)
        x = x.contiguous()
        failed = self._int8(x.data_ptr(), q.data_ptr(), scales.data_ptr(), y.data_ptr(), *_sizes(x, out))
        return _result(failed, y)

    def int4(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
        """``x @ (scales * q + mins).T`` with ``q`` 0 to 15 two to a byte (``packed``, ``[out, in / 2]`` uint8: byte
        ``j`` of a group's 16 holds ``q[j]`` in its low four bits and ``q[j + 16]`` in its high four); ``scales`` and
        ``mins`` ``[out, in / 32]`` float32; ``x`` ``[rows, in]`` float32; returns ``[rows, out]`` float32. Raises
        ``ValueError`` when ``in`` is not a multiple of 32 or the shapes disagree, ``MemoryError`` when the kernel
        cannot allocate its scratch."""
        out = _checked(x, packed, scales, packed.shape[1] * 2, torch.uint8)
        if mins.shape != scales.shape or mins.dtype != torch.float32 or not mins.is_contiguous():
            raise ValueError(f"a 4-bit product's minimums {list(mins.shape)} against scales {list(scales.shape)}")
        y = torch.empty((x.shape[0], out), dtype=torch.float32, device=x.device)
        x = x.contiguous()
        failed = self._int4(
            x.data_ptr(), packed.data_ptr(), scales.data_ptr(), mins.data_ptr(), y.data_ptr(), *_sizes(x, out)
        )
        return _result(failed, y)


def _checked(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, width: int, dtype: torch.dtype) -> int:
    """The product's output count, once ``x``, ``q`` (``width`` inputs) and ``scales`` agree; ``ValueError`` else."""
    out = q.shape[0]
    if (
        x.dim() != 2
        or x.shape[1] != width
        or width % GROUP
        or scales.shape != (out, width // GROUP)
        or x.dtype != torch.float32
        or q.dtype != dtype
        or scales.dtype != torch.float32
        or not (q.is_contiguous() and scales.is_contiguous())
    ):
        raise ValueError(
            f"a quantized product of {x.dtype} {list(x.shape)} by {q.dtype} {list(q.shape)}, scales "
            f"{scales.dtype} {list(scales.shape)} (inputs a multiple of {GROUP}, contiguous)"
        )
    return int(out)


def _sizes(x: torch.Tensor, out: int) -> tuple[int, int, int, int]:
    return x.shape[0], x.shape[1], out, torch.get_num_threads()


def _result(failed: int, y: torch.Tensor) -> torch.Tensor:
    if failed == 1:
        raise MemoryError("the quantized product kernel could not allocate its scratch")
    if failed:
        raise ValueError(f"the quantized product kernel refused its shapes (inputs a multiple of {GROUP})")
    return y


def load(folder: Path | None = None) -> QuantizedProducts | None:
    """The kernel, built under ``folder`` (default ``native.default_folder()``) unless a build for this source,
    compiler and processor is there; None (logged) when it cannot be built or loaded (see ``native.build``)."""
    library = native.build(SOURCE, folder, "quantized product kernel", "quantized matrices are multiplied as float32")
    return None if library is None else QuantizedProducts(library)
