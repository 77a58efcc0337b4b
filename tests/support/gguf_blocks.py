"""Weights as a GGUF file holds them and transformers reads them back: quantized per group of 32 inputs, then
dequantized to float32 (what the slot forward's quantized products recognise, for tests and benchmarks)."""

from __future__ import annotations

import torch

#: Inputs per block of GGUF's Q4_1 and Q8_0.
GROUP = 32


def q4_1(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[out, in]``) quantized as GGUF's Q4_1 (``d * q + m``, ``q`` 0 to 15, float16 ``d`` and ``m``)
    and dequantized as transformers does (float32)."""
    out, width = weight.shape
    w = weight.reshape(out, width // GROUP, GROUP)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d = (high - low) / 15
    q = torch.where(d > 0, ((w - low) / torch.where(d > 0, d, 1.0)).round(), 0.0).clamp(0, 15)
    return (d.half().float() * q + low.half().float()).reshape(out, width)


def q8_0(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[out, in]``) quantized as GGUF's Q8_0 (``d * q``, ``q`` an int8, float16 ``d``) and
    dequantized as transformers does (float32)."""
    out, width = weight.shape
    w = weight.reshape(out, width // GROUP, GROUP)
    d = w.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, w / torch.where(d > 0, d, 1.0), 0.0).round()
    return (d.half().float() * q).reshape(out, width)
