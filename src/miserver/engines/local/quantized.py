"""Products with a quantized matrix: ``quantized.c``, built and loaded by ``native``.

A GGUF ``Q4_1`` or ``Q8_0`` matrix (groups of 32 inputs sharing a float16 scale, and for ``Q4_1`` a float16 minimum)
reaches the slot forward dequantized to float32 by transformers, four bytes a weight. The kernel reads the
quantized bits instead (half a byte or one byte a weight, and a scale a group): it rounds each row's inputs to 8 bits
a group and multiplies in integers, as llama.cpp does, in the same bits on every processor (see the C source for the
order). A row's result never depends on the other rows. A matrix is multiplied in tiles of 16 outputs, laid out
once by :func:`int4_tiles` or :func:`int8_tiles`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from miserver.engines.local import native

SOURCE = Path(__file__).with_name("quantized.c")
#: Input columns per group: the block of GGUF's Q4_1 and Q8_0 (``GROUP`` in the C source).
GROUP = 32
#: Outputs per tile of a quantized matrix (``TILE`` in the C source).
TILE = 16


@dataclass(frozen=True)
class Int4Tiles:
    """A 4-bit ``[out, in]`` matrix laid out for the kernel's products of 16 outputs at once (:func:`int4_tiles`):
    ``q`` (``[tiles, in / 32, 4, 16, 4]``, uint8), byte ``[t, g, b, o, i]`` holding the values of output ``16 t + o``
    at inputs ``32 g + 4 b + i`` (low four bits) and ``32 g + 16 + 4 b + i`` (high four); ``scales`` and ``mins``
    (``[tiles, in / 32, 16]``, float32); the last tile padded with zero weights past ``out``."""

    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    out: int

    def __post_init__(self) -> None:
        tiles, groups = self.q.shape[:2]
        _laid_out(self.q, (tiles, groups, 4, TILE, 4), torch.uint8, self.out)
        _laid_out(self.scales, (tiles, groups, TILE), torch.float32, self.out)
        _laid_out(self.mins, (tiles, groups, TILE), torch.float32, self.out)

    @property
    def width(self) -> int:
        """Input columns, ``in``."""
        return int(self.q.shape[1]) * GROUP


@dataclass(frozen=True)
class Int8Tiles:
    """An 8-bit ``[out, in]`` matrix laid out for the kernel's products of 16 outputs at once (:func:`int8_tiles`):
    ``q`` (``[tiles, in / 32, 8, 16, 4]``, int8), ``[t, g, k, o, i]`` the value of output ``16 t + o`` at input
    ``32 g + 4 k + i``; ``scales`` (``[tiles, in / 32, 16]``, float32); ``offsets`` (the same shape, int32) 128 times
    the sum of each group's values; the last tile padded with zero weights past ``out``."""

    q: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    out: int

    def __post_init__(self) -> None:
        tiles, groups = self.q.shape[:2]
        _laid_out(self.q, (tiles, groups, 8, TILE, 4), torch.int8, self.out)
        _laid_out(self.scales, (tiles, groups, TILE), torch.float32, self.out)
        _laid_out(self.offsets, (tiles, groups, TILE), torch.int32, self.out)

    @property
    def width(self) -> int:
        """Input columns, ``in``."""
        return int(self.q.shape[1]) * GROUP


def _laid_out(tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, out: int) -> None:
    """``ValueError`` unless ``tensor`` is a contiguous ``shape`` of ``dtype`` on the CPU whose tiles hold ``out``
    outputs (the last one at least one)."""
    tiles = shape[0]
    if tensor.shape != shape or tensor.dtype != dtype or not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError(f"tiles of {tensor.dtype} {list(tensor.shape)}, not {dtype} {list(shape)} (contiguous, CPU)")
    if not (tiles - 1) * TILE < out <= tiles * TILE:
        raise ValueError(f"tiles of {out} outputs in {tiles} tiles of {TILE}")


def int8_tiles(q: torch.Tensor, scales: torch.Tensor) -> Int8Tiles:
    """``q`` (``[out, in]`` int8, -127 to 127) and ``scales`` (``[out, in / 32]`` float32), each weight ``scales[o,
    i / 32] * q[o, i]`` as GGUF's Q8_0 holds it, laid out as :class:`Int8Tiles`. Raises ``ValueError`` when the shapes
    disagree or a value is -128."""
    out, width = q.shape
    if (
        q.dtype != torch.int8
        or width % GROUP
        or scales.shape != (out, width // GROUP)
        or scales.dtype != torch.float32
        or bool((q == -128).any())
    ):
        raise ValueError(
            f"an 8-bit matrix of {q.dtype} {list(q.shape)} (-127 to 127) and scales {scales.dtype} {list(scales.shape)}"
        )
    groups, tiles = width // GROUP, -(-out // TILE)
    pad = tiles * TILE - out
    values = torch.nn.functional.pad(q, (0, 0, 0, pad)).reshape(tiles, TILE, groups, 8, 4)
    d = torch.nn.functional.pad(scales, (0, 0, 0, pad)).reshape(tiles, TILE, groups).transpose(1, 2)
    offsets = values.sum((3, 4), dtype=torch.int32).transpose(1, 2) * 128
    return Int8Tiles(values.permute(0, 2, 3, 1, 4).contiguous(), d.contiguous(), offsets.contiguous(), out)


def int4_tiles(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Int4Tiles:
    """``packed`` (``[out, in / 2]`` uint8, a group's 16 bytes holding its values ``q[j]`` low and ``q[j + 16]`` high,
    as GGUF's Q4_1 does), ``scales`` and ``mins`` (``[out, in / 32]`` float32) laid out as :class:`Int4Tiles`.
    Raises ``ValueError`` when the shapes disagree."""
    out, half = packed.shape
    groups = half * 2 // GROUP
    if (
        packed.dtype != torch.uint8
        or half * 2 % GROUP
        or scales.shape != (out, groups)
        or mins.shape != (out, groups)
        or scales.dtype != torch.float32
        or mins.dtype != torch.float32
    ):
        raise ValueError(
            f"a 4-bit matrix of {packed.dtype} {list(packed.shape)}, scales {scales.dtype} {list(scales.shape)} "
            f"and minimums {mins.dtype} {list(mins.shape)}"
        )
    tiles = -(-out // TILE)
    pad = tiles * TILE - out
    q = torch.nn.functional.pad(packed, (0, 0, 0, pad)).reshape(tiles, TILE, groups, 4, 4)
    d = torch.nn.functional.pad(scales, (0, 0, 0, pad)).reshape(tiles, TILE, groups)
    m = torch.nn.functional.pad(mins, (0, 0, 0, pad)).reshape(tiles, TILE, groups)
    return Int4Tiles(
        q.permute(0, 2, 3, 1, 4).contiguous(), d.transpose(1, 2).contiguous(), m.transpose(1, 2).contiguous(), out
    )


class QuantizedProducts:
    """The loaded kernel (see the module)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        self._int8 = library.miserver_int8_product
        self._int8.argtypes = [pointer] * 5 + [i64] * 3 + [ctypes.c_int]
        self._int8.restype = ctypes.c_int
        self._int4 = library.miserver_int4_product
        self._int4.argtypes = [pointer] * 5 + [i64] * 3 + [ctypes.c_int]
        self._int4.restype = ctypes.c_int

    def int8(self, x: torch.Tensor, tiles: Int8Tiles) -> torch.Tensor:
        """``x @ weight.T`` for the 8-bit matrix ``tiles`` (:class:`Int8Tiles`), as :meth:`int4`."""
        _fits(x, tiles.width)
        y = torch.empty((x.shape[0], tiles.out), dtype=torch.float32, device=x.device)
        x = x.contiguous()
        failed = self._int8(
            x.data_ptr(),
            tiles.q.data_ptr(),
            tiles.scales.data_ptr(),
            tiles.offsets.data_ptr(),
            y.data_ptr(),
            *_sizes(x, tiles.out),
        )
        return _result(failed, y)

    def int4(self, x: torch.Tensor, tiles: Int4Tiles) -> torch.Tensor:
        """``x @ weight.T`` for the 4-bit matrix ``tiles`` (:class:`Int4Tiles`, each weight ``d * q + m``), ``x``
        ``[rows, in]`` float32; returns ``[rows, out]`` float32, each row's inputs rounded to 8 bits a group (see
        the module). Raises ``ValueError`` when ``x`` does not fit the matrix, ``MemoryError`` when the kernel
        cannot allocate its scratch."""
        _fits(x, tiles.width)
        y = torch.empty((x.shape[0], tiles.out), dtype=torch.float32, device=x.device)
        x = x.contiguous()
        failed = self._int4(
            x.data_ptr(),
            tiles.q.data_ptr(),
            tiles.scales.data_ptr(),
            tiles.mins.data_ptr(),
            y.data_ptr(),
            *_sizes(x, tiles.out),
        )
        return _result(failed, y)


def _fits(x: torch.Tensor, width: int) -> None:
    """``ValueError`` unless ``x`` is ``[rows, width]`` float32 on the CPU."""
    if x.dim() != 2 or x.shape[1] != width or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(
            f"a quantized product of {x.dtype} {list(x.shape)} on {x.device.type} by a matrix of {width} inputs "
            "(float32, CPU)"
        )


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
