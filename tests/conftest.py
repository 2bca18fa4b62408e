"""Shared fixtures: small safetensors files made by the tests, the demo model, a moto S3 server."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest


def write_safetensors(path: Path, tensors: dict, metadata=None) -> Path:
    """Write ``tensors`` (name -> torch tensor) with the safetensors library; returns ``path``."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def write_raw(path: Path, header: dict, data: bytes, pad_to: int | None = None, header_len: int | None = None) -> Path:
    """Write a safetensors file by hand (for malformed inputs): u64 length, JSON header, data bytes."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    if pad_to is not None:
        raw += b" " * (pad_to - len(raw))
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The embedded SmolLM2-135M-Instruct bf16 directory (built once, cached outside the repo)."""
    from vllm_fastload.demo_model import build_model

    return build_model()


def demo_plus_overlay(demo_model: Path, tmp_path: Path) -> Path:
    """Issue 15's example: the demo model (its shard linked, not copied) plus ``overlay.safetensors`` holding an
    all-zero ``model.norm.weight``, no index. Returns the directory."""
    import torch

    from vllm_fastload.checkpoint import read_header

    d = tmp_path / "overlaid"
    d.mkdir()
    (d / "model.safetensors").symlink_to(demo_model / "model.safetensors")
    norm = read_header(str(demo_model / "model.safetensors")).tensors["model.norm.weight"]
    write_safetensors(d / "overlay.safetensors", {"model.norm.weight": torch.zeros(norm.shape, dtype=torch.bfloat16)})
    return d


@pytest.fixture(scope="module")
def moto_s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 for this module; stopped by PID afterwards."""
    from vllm_fastload.servers import MotoS3

    with MotoS3(log_path=tmp_path_factory.mktemp("moto") / "moto.log") as s3:
        yield s3


#: safetensors dtype -> torch dtype attribute name (those this torch lacks are skipped by the zoo)
ZOO_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu", "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16",
    "I32": "int32", "U32": "uint32", "F32": "float32", "I64": "int64", "U64": "uint64", "F64": "float64",
}


def write_zoo(path: Path, seed: int = 0) -> dict:
    """A safetensors file holding every dtype this torch has, odd byte lengths, zero-element tensors (first, in
    the middle, last, and sharing a start offset) and tensors at offsets not aligned to their element size.

    Returns name -> (torch dtype, shape, expected raw bytes). Written by hand (the safetensors library would
    sort tensors by alignment), header padded to 8k+3 bytes so the data section itself is unaligned.
    """
    import random

    import torch

    rng = random.Random(seed)
    items = [("empty.first", "F32", [0, 4]), ("odd.u8", "U8", [3])]
    for i, (st, attr) in enumerate(ZOO_DTYPES.items()):
        if not hasattr(torch, attr):
            continue
        items.append((f"t{i:02d}.{st}", st, [rng.randint(1, 5), rng.randint(1, 7)]))
        if i == 6:
            items.append(("empty.middle", "BF16", [0]))
            items.append(("odd.i8", "I8", [5]))
    items.append(("big.f32", "F32", [1000, 37]))  # spans many small ring slots
    items.append(("empty.last", "I64", [2, 0]))
    from vllm_fastload.checkpoint import DTYPE_BYTES

    header, data, expected, off = {}, bytearray(), {}, 0
    for name, st, shape in items:
        n = 1
        for d in shape:
            n *= d
        nbytes = int(n * DTYPE_BYTES[st])
        if st == "BOOL":
            raw = bytes(rng.randint(0, 1) for _ in range(nbytes))
        else:
            raw = bytes(rng.getrandbits(8) for _ in range(nbytes))
            if st == "F8_E8M0":
                raw = bytes(b if b != 0xFF else 0x7F for b in raw)  # 0xFF is NaN; still bit-exact, keep it tame
        header[name] = {"dtype": st, "shape": shape, "data_offsets": [off, off + nbytes]}
        data += raw
        expected[name] = (getattr(torch, ZOO_DTYPES.get(st, "float32")), tuple(shape), raw)
        off += nbytes
    raw_h = json.dumps(header, separators=(",", ":")).encode()
    pad = (8 - (len(raw_h) % 8) + 3) % 8
    write_raw(path, header, bytes(data), pad_to=len(raw_h) + pad)
    return expected
