"""The decode step's attention kernel: ``attention.c``, built and loaded by ``native``.

torch's fused attention runs a decode step's grouped-query attention as one small matrix product per row and kv
head over the longest row's width (masked), and those small products cost far more than the bytes they read. The
kernel reads each row's own columns only, once for its whole query group, with the products and the softmax
vectorised by the compiler (see the C source for the shapes and the order of operations). A row's result never
depends on the rest of its step. It asks for ``torch.get_num_threads()`` threads.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from miserver.engines.local import native

SOURCE = Path(__file__).with_name("attention.c")
#: the query group a task holds (``heads / kv_heads``), as ``MAX_GROUP`` in the C source
MAX_GROUP = 16
#: head_dim must be a multiple of this
LANES = 16
#: the widest head_dim (``LANES * MAX_CHUNKS`` in the C source)
MAX_HEAD_DIM = 256


class DecodeAttention:
    """The loaded kernel (see the module); :meth:`__call__` runs one layer of one decode step."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.miserver_decode_attention
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [pointer] * 8 + [i64] * 7 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    @staticmethod
    def covers(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the kernel computes this attention: float32 on the CPU, ``head_dim`` a multiple of 16 up to 256, a
        query group of at most 16 heads."""
        return (
            device.type == "cpu"
            and dtype == torch.float32
            and head_dim % LANES == 0
            and head_dim <= MAX_HEAD_DIM
            and heads % kv_heads == 0
            and heads // kv_heads <= MAX_GROUP
        )

    def __call__(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        slot: torch.Tensor,
        seen: torch.Tensor,
        scale: float,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``q`` (``[rows, heads, head_dim]``, float32) over one layer's cache ``keys`` and ``values``
        (``[slots, kv_heads, capacity, head_dim]``, float32 or bfloat16, contiguous), row ``r`` over the first
        ``seen[r]`` columns of slot ``slot[r]`` (both ``[rows]``, int64, ``1 <= seen <= capacity``), after each row's
        own key and value ``k`` and ``v`` (``[rows, kv_heads, head_dim]``, float32), when given, are written into its
        column ``seen[r] - 1`` (rounded as ``Tensor.to`` rounds into a bfloat16 cache; rows of one slot must write
        distinct columns); returns ``[rows, heads * head_dim]`` float32. Raises ``MemoryError`` when the kernel
        cannot allocate its scratch, ``ValueError`` for a shape :meth:`covers` refuses."""
        q = q.contiguous()
        rows, heads, head_dim = q.shape
        _, kv_heads, capacity, _ = keys.shape
        assert keys.is_contiguous() and values.is_contiguous() and keys.shape == values.shape
        assert keys.dtype == values.dtype and keys.dtype in (torch.float32, torch.bfloat16) and q.dtype == torch.float32
        assert slot.dtype == torch.long and seen.dtype == torch.long and slot.is_contiguous() and seen.is_contiguous()
        own = [_rows_of(x, rows, kv_heads, head_dim) for x in (k, v)] if k is not None and v is not None else None
        out = torch.empty_like(q)
        failed = self._fn(
            q.data_ptr(),
            own[0].data_ptr() if own else None,
            own[1].data_ptr() if own else None,
            keys.data_ptr(),
            values.data_ptr(),
            slot.data_ptr(),
            seen.data_ptr(),
            out.data_ptr(),
            own[0].stride(0) if own else 0,
            own[1].stride(0) if own else 0,
            rows,
            heads,
            kv_heads,
            capacity,
            head_dim,
            scale,
            torch.get_num_threads(),
            keys.dtype == torch.bfloat16,
        )
        if failed == 2:
            raise ValueError(
                f"the decode attention kernel does not cover heads={heads}, kv_heads={kv_heads}, "
                f"head_dim={head_dim} (see covers)"
            )
        if failed:
            raise MemoryError("the decode attention kernel could not allocate its scores")
        return out.view(rows, heads * head_dim)


def _rows_of(x: torch.Tensor, rows: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """``x`` (``[rows, kv_heads, head_dim]`` float32) with each row's elements contiguous (a copy only when they
    are not), for the kernel, which steps from row to row by ``stride(0)``."""
    assert x.shape == (rows, kv_heads, head_dim) and x.dtype == torch.float32
    if x.stride(2) == 1 and (x.stride(1) == head_dim or kv_heads == 1):
        return x
    return x.contiguous()


def load(folder: Path | None = None) -> DecodeAttention | None:
    """The kernel, built under ``folder`` (default ``native.default_folder()``) unless a build for this source,
    compiler and processor is there; None (logged) when it cannot be built or loaded (see ``native.build``)."""
    library = native.build(SOURCE, folder, "decode attention kernel", "the decode step uses torch's attention")
    return None if library is None else DecodeAttention(library)
