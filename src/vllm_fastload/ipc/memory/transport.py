"""The device/transport interface of ``ipc_cache``: how one device's export buffer crosses processes as one fd.

A :class:`Transport` allocates a rank's export buffer (daemon), maps a received one (engine), describes it for
the manifest, reads sample windows of it to the host, and says whether its memory must be counted as the
engine's own. :func:`.backends.get_transport` picks the backend for a ``torch.device``; callers ask the
transport instead of checking device types, so a ROCm or XPU transport is one more backend there.

Backends: ``memfd`` (CPU shared memory, :mod:`.memfd`) and ``cuda_vmm`` (one CUDA VMM allocation, :mod:`.cuda_vmm`).
Where each tensor sits inside a segment and how it is checked: :mod:`.layout`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...errors import CacheUnavailable, ManifestError
from ..wire.messages import SegmentMeta


class NoTransport(CacheUnavailable):
    """No transport serves this device (ROCm, XPU, ...); the message names the device type."""


@dataclass
class Segment:
    """An export buffer: ``buf`` is its flat ``torch.uint8`` view (``size`` bytes), ``fd`` the descriptor sent to
    clients (owned by this object; -1 in an engine, which closed it after mapping), ``transport`` the name of the
    :class:`Transport` that made it, ``owner`` what keeps the mapping (an ``mmap`` or a VMM buffer)."""

    fd: int
    size: int
    transport: str
    buf: Any
    owner: Any = None

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


class Transport:
    """One kind of device memory shared between the daemon and engines as one file descriptor.

    Subclasses set :attr:`name` and implement :meth:`allocate` and :meth:`open`; the rest has defaults that fit a
    device without special needs."""

    #: The manifest's ``transport`` value of the segments this backend makes.
    name: ClassVar[str] = ""
    #: True when segments live in device memory that the engine's allocator never sees, so a zero_copy engine
    #: must count the mapped bytes as its weights (:mod:`.accounting`).
    device_memory: ClassVar[bool] = False
    #: True when an engine's writes into a mapped segment land in the daemon's memory (and so in every other
    #: engine mapping it); False when the engine's mapping is private (copy-on-write). A zero_copy engine must
    #: never write into a segment of a transport that shares writes (``reload_weights``: :mod:`.reload`).
    shares_writes: ClassVar[bool] = True

    def resolve(self, device: torch.device) -> torch.device:
        """``device`` made concrete for this process (a device index where the type has several)."""
        return device

    def bind_rank(self, local_rank: int) -> None:
        """Daemon: bind this process to its rank's device before the distributed state is set up."""

    def allocate(self, size: int, device: torch.device) -> Segment:
        """Daemon: a fresh, writable segment of at least ``size`` bytes on ``device``."""
        raise NotImplementedError

    def open(self, fd: int, meta: SegmentMeta, device: torch.device) -> Segment:
        """Engine: map the received segment ``meta`` describes on ``device``; always closes ``fd`` (the mapping
        keeps the memory). Raises :class:`~vllm_fastload.errors.ManifestError` when ``meta`` does not fit."""
        raise NotImplementedError

    def describe(self, segment: Segment, device: torch.device) -> SegmentMeta:
        """The manifest's entry of ``segment``."""
        return SegmentMeta(size=segment.size, transport=self.name)

    def check(self, fd: int, meta: SegmentMeta, device: torch.device) -> None:
        """Close ``fd`` and raise :class:`~vllm_fastload.errors.ManifestError` unless this transport made
        ``meta``'s segment."""
        if meta.transport != self.name:
            os.close(fd)
            raise ManifestError(f"the daemon exports {meta.transport!r} memory, which a {device.type} engine "
                                f"(transport {self.name!r}) cannot map")

    def synchronize(self, device: torch.device) -> None:
        """Wait until work queued on ``device`` (copies, post-processing) is done."""

    def free_cached(self, device: torch.device) -> None:
        """Daemon, once the dropped model's reference cycles were collected: hand memory it still holds in caches
        back to the device."""

    def read_windows(self, buf: torch.Tensor, starts: list[int], lens: list[int], width: int) -> Any:
        """The byte windows ``buf[s:s + n]`` as rows of a ``(len(starts), width)`` ``numpy.uint8`` array (each
        ``n <= width``; the rest of a row is left as it is). Default: one blocking copy per window into a host
        buffer, right for any device; a backend overrides it with something faster."""
        host = torch.empty(len(starts) * width, dtype=torch.uint8)
        for i, (s, m) in enumerate(zip(starts, lens)):
            host[i * width:i * width + m].copy_(buf[s:s + m])
        return host.numpy().reshape(len(starts), width)


def gather_windows(buf: torch.Tensor, starts: Any, width: int) -> Any:
    """The ``width``-byte windows ``buf[s:s + width]`` of the flat ``torch.uint8`` ``buf`` (any device) as rows of
    a ``(len(starts), width)`` ``numpy.uint8`` array, read with one gather on ``buf``'s device and one copy to the
    host: a device buffer's windows cost one kernel and one transfer instead of a driver copy each. Every window
    must lie inside ``buf`` (``0 <= s`` and ``s + width <= buf.numel()``), else ``IndexError``, checked before
    anything is read on any device. ``starts``: int64 byte offsets (a sequence or ``numpy`` array)."""
    import numpy as np

    s = np.asarray(starts, dtype=np.int64)
    if not len(s):
        return np.empty((0, width), dtype=np.uint8)
    if s.min() < 0 or s.max() + width > buf.numel():
        raise IndexError(f"a {width}-byte window at {int(s.min())}..{int(s.max())} lies outside the "
                         f"{buf.numel()}-byte buffer")
    # every window of the buffer as a (numel - width + 1, width) view (strides 1, 1: no copy), then the rows wanted
    idx = torch.from_numpy(s).to(buf.device)
    rows = buf.unfold(0, width, 1).index_select(0, idx)
    if rows.device.type == "cpu":
        return rows.numpy()
    host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(rows, non_blocking=True)
    torch.cuda.current_stream(buf.device).synchronize()
    return host.numpy()
