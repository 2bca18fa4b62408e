"""CPU transport: every exported tensor of a rank packed into one anonymous shared-memory segment (memfd).

Why memfd and not ``/dev/shm`` files: a memfd has no name, so nothing is left behind when the daemon is killed,
nobody else can open it (it is reachable only through a file descriptor passed over the 0600 Unix socket), and
the kernel keeps its pages alive while any process maps them — an engine keeps serving after the daemon died.

Clients map the segment ``MAP_PRIVATE`` (read/write, copy-on-write): zero_copy engines share the daemon's pages
and can never write into them. ``copy`` clients clone what they mapped and unmap.
"""

from __future__ import annotations

import mmap
import os
import zlib
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 64
#: bytes hashed per checksum sample window (start, middle, end of each tensor)
SAMPLE = 4096

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64) }
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "uint16", "uint32", "uint64", "float8_e4m3fnuz",
              "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)


def checksum(raw: torch.Tensor) -> str:
    """CRC32 (hex) of up to three ``SAMPLE``-byte windows (start, middle, end) of a flat uint8 tensor."""
    n = raw.numel()
    parts = [raw[:SAMPLE], raw[max(0, n // 2 - SAMPLE // 2): n // 2 + SAMPLE // 2], raw[max(0, n - SAMPLE):]]
    crc = 0
    for p in parts:
        crc = zlib.crc32(p.numpy().tobytes(), crc)
    return f"{crc:08x}"


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s storage span as a flat uint8 tensor (t must be on CPU)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.contiguous().reshape(-1).view(torch.uint8)


@dataclass
class Segment:
    """A memfd holding packed tensors. ``fd`` stays open in the daemon; ``size`` in bytes."""

    fd: int
    size: int
    mm: Any = None

    def close(self) -> None:
        """Unmap and close the daemon's handle (clients that map it keep the pages alive)."""
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def pack(tensors: dict[str, torch.Tensor], name: str = "vllm-fastload") -> tuple[Segment, dict[str, dict]]:
    """Copy CPU ``tensors`` into one new memfd segment.

    Returns the segment and, per name, a manifest entry ``{dtype, shape, offset, nbytes, checksum}`` (offset and
    nbytes in bytes, 64-byte aligned offsets). Tensors are stored contiguous (their stride is re-derived).
    """
    layout, off = {}, 0
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        layout[k] = (off, nbytes)
        off += -(-nbytes // ALIGN) * ALIGN
    size = max(off, ALIGN)
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    entries = {}
    for k, t in tensors.items():
        o, n = layout[k]
        raw = _bytes_view(t.detach().cpu())
        if n:
            buf[o:o + n].copy_(raw)
        entries[k] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": o,
                      "nbytes": n, "checksum": checksum(buf[o:o + n])}
    del buf
    return Segment(fd, size, mm), entries


def map_segment(fd: int, size: int) -> mmap.mmap:
    """Map a received segment copy-on-write (``MAP_PRIVATE``) and close the fd (the mapping keeps it alive)."""
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def tensor_at(mm: mmap.mmap, entry: dict, name: str = "?") -> torch.Tensor:
    """The tensor an entry describes, viewing the mapping (no copy). Raises ``ValueError`` naming the tensor on a
    bad entry (unknown dtype, range outside the segment, size not matching shape x dtype)."""
    dtype = DTYPES.get(entry.get("dtype"))
    if dtype is None:
        raise ValueError(f"manifest entry {name!r} has unknown dtype {entry.get('dtype')!r}")
    o, n = int(entry["offset"]), int(entry["nbytes"])
    if o < 0 or o + n > len(mm):
        raise ValueError(f"manifest entry {name!r} spans [{o}, {o + n}), outside the {len(mm)}-byte segment")
    numel = 1
    for d in entry["shape"]:
        numel *= int(d)
    if numel * torch.empty(0, dtype=dtype).element_size() != n:
        raise ValueError(f"manifest entry {name!r}: {n} bytes do not hold {entry['dtype']} {entry['shape']}")
    if n == 0:
        return torch.empty(entry["shape"], dtype=dtype)
    raw = torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=o)
    return raw.view(dtype).view(entry["shape"])


def verify(t: torch.Tensor, entry: dict) -> bool:
    """True when the sampled checksum of ``t``'s bytes equals the manifest's."""
    return checksum(_bytes_view(t)) == entry["checksum"]
