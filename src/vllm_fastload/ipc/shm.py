"""A rank's export buffer ("segment") and its two transports, both handed over as one file descriptor.

* ``memfd`` (CPU): one anonymous shared-memory file. It has no name, so nothing is left behind when the daemon
  is killed and nobody can open it without the fd passed over the 0600 socket; the kernel keeps its pages while
  any process maps them. Engines map it ``MAP_PRIVATE`` (copy-on-write): they can never write into the daemon's
  pages.
* ``cuda_vmm`` (CUDA): one VMM allocation exported as a POSIX fd (:mod:`.cuda_vmm`); the physical memory lives
  while any process holds or maps it.

Where each tensor sits inside a segment and how it is checked: :mod:`.layout`.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Any

import torch

from .layout import fill, plan, sample_checksums


@dataclass
class Segment:
    """An export buffer: ``buf`` is its flat ``torch.uint8`` view (``size`` bytes), ``fd`` the descriptor sent to
    clients (owned by this object), ``transport`` ``"memfd"`` or ``"cuda_vmm"``."""

    fd: int
    size: int
    transport: str
    buf: Any
    owner: Any = None

    def meta(self) -> dict[str, Any]:
        """The manifest's description of this segment (JSON)."""
        return {"size": self.size, "transport": self.transport}

    def close(self) -> None:
        """Drop this process's view and handle (other processes that map it keep the memory alive)."""
        self.buf = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.owner is not None:
            try:
                self.owner.close()
            except BufferError:  # a tensor still views the mapping; it is freed with that tensor
                pass
            self.owner = None


def _cuda_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current device when it has none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def new_segment(size: int, device: torch.device, name: str = "vllm-fastload") -> Segment:
    """A fresh segment of at least ``size`` bytes on ``device`` (CPU -> memfd, CUDA -> VMM allocation)."""
    if device.type == "cuda":
        from .cuda_vmm import VmmBuffer

        vb = VmmBuffer.allocate(_cuda_index(device), size)
        return Segment(vb.export_fd(), vb.size, "cuda_vmm", vb.tensor(), vb)
    if device.type != "cpu":
        raise ValueError(f"ipc_cache has no transport for {device.type} devices (CPU memfd and CUDA VMM only)")
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return Segment(fd, size, "memfd", torch.frombuffer(mm, dtype=torch.uint8), mm)


def pack(tensors: dict[str, torch.Tensor], device: torch.device = torch.device("cpu")) -> tuple[Segment, dict]:
    """Copy ``tensors`` into one new segment on ``device``.

    Returns the segment and, per name, a manifest entry (:func:`.layout.plan` plus its ``checksum``).
    """
    entries, size = plan(tensors)
    seg = new_segment(size, device)
    fill(seg.buf, tensors, entries)
    for k, crc in sample_checksums(seg.buf, entries).items():
        entries[k]["checksum"] = crc
    return seg, entries


def open_segment(fd: int, meta: dict[str, Any], device: torch.device) -> Segment:
    """Map a received segment (closes ``fd``; the mapping keeps the memory). CPU segments are mapped copy-on-write.
    Raises ``ValueError`` when the segment's transport does not fit ``device``."""
    transport, size = meta.get("transport", "memfd"), int(meta["size"])
    if transport == "cuda_vmm":
        if device.type != "cuda":
            os.close(fd)
            raise ValueError(f"the daemon exports CUDA memory but this engine runs on {device.type}")
        from .cuda_vmm import VmmBuffer
        from .paths import device_identity

        index = _cuda_index(device)
        mine = device_identity("cuda", index)
        if meta.get("device") and meta["device"] != mine:
            os.close(fd)
            raise ValueError(f"the daemon exports memory of {meta['device']} but this rank uses {mine} (cuda:{index}); "
                             f"check CUDA_VISIBLE_DEVICES and the socket path")
        vb = VmmBuffer.import_fd(index, fd, size)
        return Segment(-1, size, transport, vb.tensor(), vb)
    if transport != "memfd" or device.type != "cpu":
        os.close(fd)
        raise ValueError(f"the daemon exports {transport!r} memory, which a {device.type} engine cannot map")
    try:
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return Segment(-1, size, transport, torch.frombuffer(mm, dtype=torch.uint8), mm)
