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


@pytest.fixture(scope="module")
def moto_s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 for this module; stopped by PID afterwards."""
    from vllm_fastload.servers import MotoS3

    with MotoS3(log_path=tmp_path_factory.mktemp("moto") / "moto.log") as s3:
        yield s3
