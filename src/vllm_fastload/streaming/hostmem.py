"""Page-locked host memory that can be prepared on a thread without stalling the GPU's other users.

PyTorch's pinned allocator (``torch.empty(..., pin_memory=True)``) page-locks with ``cudaHostAlloc``, which holds
the CUDA driver busy for the whole page-locking (PyTorch added ``cudaHostRegister`` as an allocator option "to
avoid large lock wait time with cudaHostAlloc", pytorch/pytorch#108488; that option,
``PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True``, is process-wide and read once, so a loader plugin
cannot use it for one buffer): on the H200 machine, building an 8B model's parameters with
``torch.empty(..., device="cuda")`` took 0.008-0.011 s alone and 0.46-0.58 s while a thread page-locked 1 GiB that
way (``benchmarks/pin_probe.py``, docs/benchmarks.md), so the read arena's allocation, started on a thread to
overlap vLLM's model construction, only delayed it. :func:`page_locked` instead maps anonymous memory, asks for
transparent huge pages (``madvise(MADV_HUGEPAGE)``), faults every page in from the calling thread (no CUDA call)
and only then registers the range with ``cudaHostRegister`` (0.02 s per GiB there, against 0.35-0.42 s for
``cudaHostAlloc``). CUDA documents registered memory as page-locked like ``cudaHostAlloc``'s ("CUDA Runtime API",
``cudaHostRegister``): asynchronous copies from it need no staging.
"""

from __future__ import annotations

import mmap
import weakref
from typing import Any

import torch

from ..log import logger


def _unregister(ptr: int, device: int, keep: Any) -> None:
    """Finalizer: unregister ``ptr`` once the last tensor over the mapping is gone; ``keep`` (the mapping) is
    released after it, so the range is never unmapped while registered. A finalizer runs on whichever thread
    drops the last reference: the registering ``device`` is made current first, else the CUDA runtime would
    create a context on GPU 0 for a thread that never chose a device."""
    with torch.cuda.device(device):
        rc = torch.cuda.cudart().cudaHostUnregister(ptr)
    if int(rc) != 0:  # pragma: no cover - only a driver fault gets here
        logger.warning("fastload: cudaHostUnregister(0x%x) failed with CUDA error %s", ptr, int(rc))


def page_locked(nbytes: int) -> torch.Tensor:
    """``nbytes`` (> 0) of page-locked host memory as a flat ``torch.uint8`` CPU tensor, zero-filled.

    The memory stays registered as long as any tensor or numpy array over it lives (views included) and is
    unregistered, then unmapped, when the last one is gone. Where registration is not possible (no CUDA runtime,
    ``cudaHostRegister`` refused) it comes from PyTorch's pinned allocator instead, with an INFO line naming the
    CUDA error. Raises ``ValueError`` for ``nbytes <= 0``.
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes must be > 0, got {nbytes}")
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(mm)
    t = torch.frombuffer(view, dtype=torch.uint8)
    t.zero_()  # fault every page in here, outside the driver
    try:
        rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
    except (AttributeError, RuntimeError, AssertionError) as e:  # CPU-only torch, no CUDA runtime
        rc, why = -1, f"{type(e).__name__}: {e}"
    else:
        why = f"cudaHostRegister returned CUDA error {rc}"
    if rc != 0:
        logger.info("fastload: %d bytes of pinned memory from PyTorch's allocator (%s)", nbytes, why)
        del t
        view.release()
        mm.close()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    # the tensor's storage holds `view` until its last user is gone; then unregister, then drop the mapping
    weakref.finalize(view, _unregister, t.data_ptr(), torch.cuda.current_device(), mm)
    return t
