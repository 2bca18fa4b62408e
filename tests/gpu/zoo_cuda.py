"""Deterministic tensors for the CUDA transport test (imported by the exporter child and the test)."""

import torch


def zoo() -> dict:
    """Dtypes and layouts post-processing produces: a transposed view, BF16, FP8, odd sizes, empty, 12 MB."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(96, 40, generator=g)
    return {"t": base.t(), "bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
            "f8": torch.randn(64, generator=g).to(torch.float8_e4m3fn), "u8": torch.arange(13, dtype=torch.uint8),
            "i64": torch.arange(5, dtype=torch.int64) * 10**12, "f64": torch.randn(3, generator=g, dtype=torch.float64),
            "empty": torch.empty(0, 3), "big": torch.randn(3 * 2**20, generator=g)}
