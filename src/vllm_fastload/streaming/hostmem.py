"""Page-locked host memory that can be prepared on a thread without stalling the GPU's other users.

PyTorch's pinned allocator (``torch.empty(..., pin_memory=True)``) page-locks with ``cudaHostAlloc``, which holds
the CUDA driver busy for the whole page-locking (PyTorch added ``cudaHostRegister`` as an allocator option "to
avoid large lock wait time with cudaHostAlloc", pytorch/pytorch#108488; that option,
``PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True``, is process-wide and read once, so a loader plugin
cannot use it for one buffer). The read arena is allocated on a thread so that it overlaps vLLM's model
construction; page-locked that way it would instead hold up every CUDA call of the construction until it is done
(``benchmarks/pin_probe.py`` shows it; docs/benchmarks.md has the figures). :func:`page_locked` therefore maps
anonymous memory, asks for transparent huge pages (``madvise(MADV_HUGEPAGE)``: fewer pages to fault in and to
register), faults every page in from the calling thread (no CUDA call) and only then registers the range with
``cudaHostRegister``, the one short step that needs the driver. CUDA documents registered memory as page-locked
like ``cudaHostAlloc``'s ("CUDA Runtime API", ``cudaHostRegister``): asynchronous copies from it need no staging.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch

from ..log import logger


def _on_own_thread(call: Callable[[], Any], device: int) -> int:
    """``int(call())`` with CUDA ``device`` current, on a short-lived thread. A failed CUDA runtime call leaves a
    per-thread "last error" that PyTorch's kernel-launch checks read (``cudaGetLastError``): a refused registration
    must not surface as the caller's next kernel error, and a thread that never chose a device would get a context
    on GPU 0. Raises what ``call`` (or selecting the device) raised."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            torch.cuda.set_device(device)
            box["rc"] = int(call())
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    th = threading.Thread(target=run, name="fastload-hostreg", daemon=True)
    th.start()
    th.join()
    if "error" in box:
        raise box["error"]
    return box["rc"]


def _unregister(ptr: int, device: int, keep: Any) -> None:
    """Finalizer: unregister ``ptr`` once the last tensor over the mapping is gone; ``keep`` (the mapping) is
    released after it, so the range is never unmapped while registered."""
    try:
        rc = _on_own_thread(lambda: torch.cuda.cudart().cudaHostUnregister(ptr), device)
    except RuntimeError as e:  # pragma: no cover - e.g. no new threads during interpreter shutdown
        logger.warning("fastload: could not unregister pinned memory at 0x%x: %s", ptr, e)
        return
    if rc != 0:  # pragma: no cover - only a driver fault gets here
        logger.warning("fastload: cudaHostUnregister(0x%x) failed with CUDA error %s", ptr, rc)


def _advise(mm: mmap.mmap, name: str) -> None:
    """``madvise`` hint ``name`` if this Python and kernel have it (a kernel without THP answers EINVAL)."""
    advice = getattr(mmap, name, None)
    if advice is not None:
        try:
            mm.madvise(advice)
        except OSError:
            pass


def page_locked(nbytes: int, device: Optional[int] = None) -> torch.Tensor:
    """``nbytes`` (> 0) of page-locked host memory as a flat ``torch.uint8`` CPU tensor, zero-filled, registered
    with CUDA ``device`` (an index; default: the current device).

    The memory stays registered as long as any tensor or numpy array over it lives (views included) and is
    unregistered, then unmapped, when the last one is gone (not at interpreter exit). The mapping is not inherited
    by ``fork`` (``MADV_DONTFORK``). Where registration is not possible (no CUDA runtime, ``cudaHostRegister``
    refused) it comes from PyTorch's pinned allocator instead, with an INFO line naming the CUDA error. Raises
    ``ValueError`` for ``nbytes <= 0``.
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes must be > 0, got {nbytes}")
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _advise(mm, "MADV_HUGEPAGE")
    _advise(mm, "MADV_DONTFORK")
    view = memoryview(mm)
    t = torch.frombuffer(view, dtype=torch.uint8)
    t.zero_()  # fault every page in here, outside the driver
    ptr = t.data_ptr()
    try:
        dev = torch.cuda.current_device() if device is None else device
        rc = _on_own_thread(lambda: torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0), dev)
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
    weakref.finalize(view, _unregister, ptr, dev, mm).atexit = False
    return t
