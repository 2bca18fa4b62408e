"""CPU transport: a rank's export buffer is one anonymous shared-memory file (``memfd``).

It has no name, so nothing is left behind when the daemon is killed and nobody can open it without the fd passed
over the 0600 socket; the kernel keeps its pages while any process maps them. Engines map it ``MAP_PRIVATE``
(copy-on-write): they can never write into the daemon's pages.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import torch

from ...errors import ManifestError
from ..wire.messages import SegmentMeta
from .transport import Segment, Transport


class MemfdTransport(Transport):
    """The ``memfd`` backend of :class:`.transport.Transport` (CPU tensors)."""

    name = "memfd"
    #: engines map the memfd MAP_PRIVATE (:meth:`open`): a write copies the page into this process only
    shares_writes = False

    def allocate(self, size: int, device: torch.device, label: str = "vllm-fastload") -> Segment:
        """A new memfd of ``size`` bytes (named ``label`` in ``/proc/PID/fd``), mapped shared and writable."""
        fd = os.memfd_create(label, os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return Segment(fd, size, self.name, torch.frombuffer(mm, dtype=torch.uint8), mm)

    def open(self, fd: int, meta: SegmentMeta, device: torch.device) -> Segment:
        """Map the memfd copy-on-write (closes ``fd``). Raises :class:`~vllm_fastload.errors.ManifestError` when
        the segment is not a memfd or cannot be mapped at ``meta.size`` bytes."""
        self.check(fd, meta, device)
        try:
            mm = mmap.mmap(fd, meta.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as e:  # a size beyond the file, or no address space left
            raise ManifestError(f"cannot map the daemon's {meta.size}-byte memfd segment ({e})") from None
        finally:
            os.close(fd)
        return Segment(-1, meta.size, self.name, torch.frombuffer(mm, dtype=torch.uint8), mm)

    def read_windows(self, buf: torch.Tensor, starts: list[int], lens: list[int], width: int) -> Any:
        """The windows as numpy rows, read straight from the mapping: one gather of whole rows where a row's
        ``width`` bytes lie inside the buffer, the window's own bytes alone for the rows at its end."""
        import numpy as np
        from numpy.lib.stride_tricks import sliding_window_view

        a = buf.numpy()
        s = np.asarray(starts, dtype=np.int64)
        inside = s + width <= a.size
        if a.size >= width and inside.all():
            # the common case: the gather's own array is the answer (a masked assignment would copy every row a
            # second time)
            return sliding_window_view(a, width)[s]
        rows = np.empty((len(s), width), dtype=np.uint8)
        if a.size >= width and inside.any():
            rows[inside] = sliding_window_view(a, width)[s[inside]]
        for i in np.flatnonzero(~inside).tolist():
            rows[i, :lens[i]] = a[starts[i]:starts[i] + lens[i]]
        return rows
