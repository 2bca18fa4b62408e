"""Copies straight out of the page cache (opt-in: ``FASTLOAD_PAGECACHE_DMA=1``; direct GPU path, local files).

The other readers of the direct path copy every byte twice on a warm page cache: a CPU copies it from the page
cache into a pinned ring slot, then the copy engine copies the slot to the GPU, and the two copies share the host's
memory. Here each shard is mapped read-only (``mmap``, shared) and its pages are page-locked where they are, with
``cudaHostRegister`` and the flag ``cudaHostRegisterReadOnly`` ("the memory will be considered as read-only by the
device", CUDA Runtime API, CUDA 11.1 on), one registration per shard, in file order, started beside vLLM's model
construction (:func:`start_early`); the copy engine then reads the page cache itself. A range is handed to the
copies once its shard is registered.

Linux allows long-term pins of a read-only shared file mapping's pages (``pin_user_pages`` with
``FOLL_LONGTERM``, refused only for writable file mappings and DAX); a file system or driver that refuses anyway
answers the first registration with a CUDA error, and the loader reads through its ring instead, said at INFO.
The registered pages stay in memory (the page cache cannot evict them) until :meth:`RegisteredShards.close`.
"""

from __future__ import annotations

import concurrent.futures as cf
import mmap
import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, Optional

import torch

from .knobs import env_switch

#: cudaHostRegisterReadOnly (CUDA Runtime API, ``cudaHostRegister``'s flags)
READ_ONLY = 0x08


def enabled() -> bool:
    """``FASTLOAD_PAGECACHE_DMA=1``: the direct path copies out of the registered page cache."""
    return bool(env_switch("FASTLOAD_PAGECACHE_DMA"))


def whole_files(paths: list[str]) -> int:
    """A region size that makes each of ``paths`` one registration: the largest file's size in whole pages. A copy
    must come out of one registration (CUDA refuses one across two: "invalid argument", measured on an H100), and
    a range of the direct path may lie anywhere in its shard."""
    largest = max((os.path.getsize(p) for p in paths), default=0)
    return max(mmap.PAGESIZE, -(-largest // mmap.PAGESIZE) * mmap.PAGESIZE)


def cuda_register(device: int) -> tuple[Callable[[int, int], int], Callable[[int], int]]:
    """``(register(ptr, nbytes) -> CUDA error code, unregister(ptr) -> CUDA error code)`` for CUDA ``device``
    (an index), through PyTorch's runtime binding; each sets the device on its calling thread first (a thread
    that never chose one would get a context on GPU 0)."""

    def register(ptr: int, nbytes: int) -> int:
        torch.cuda.set_device(device)
        return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, READ_ONLY))

    def unregister(ptr: int) -> int:
        torch.cuda.set_device(device)
        return int(torch.cuda.cudart().cudaHostUnregister(ptr))

    return register, unregister


class RegistrationRefused(OSError):
    """``cudaHostRegister`` refused a region of a shard (the message names the shard, the offset and the CUDA
    error): the caller reads through its ring instead."""


class RegisteredShards:
    """``paths`` mapped read-only, each region of ``region`` bytes page-locked by ``register`` on a pool of
    ``workers`` threads in file order (started here). :meth:`host` waits for the region a range lies in and
    returns the range as a flat ``torch.uint8`` CPU tensor over the mapping; :meth:`close` unregisters every
    registered region (``unregister``) and unmaps. ``wait_s``: seconds :meth:`host` waited for registrations.

    ``register(ptr, nbytes)`` / ``unregister(ptr)`` return a CUDA error code (0: done); :func:`cuda_register`
    gives the CUDA runtime's. Raises ``OSError`` when a shard cannot be opened or mapped; :meth:`host` raises
    :class:`RegistrationRefused`."""

    def __init__(self, paths: list[str], register: Callable[[int, int], int], unregister: Callable[[int], int],
                 region: int, workers: int):
        if region <= 0 or region % mmap.PAGESIZE:
            raise ValueError(f"region must be a positive multiple of the page size, got {region}")
        self.paths, self.region, self.wait_s = list(paths), region, 0.0
        self._unregister = unregister
        self._maps: list[Optional[mmap.mmap]] = []
        self._hosts: list[Optional[torch.Tensor]] = []
        self._lock = threading.Lock()
        self._done: list[int] = []  # pointers registered (unregistered by close)
        self._closed = False
        try:
            for p in self.paths:
                with open(p, "rb") as f:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if _size(f) else None
                self._maps.append(mm)
                with warnings.catch_warnings():  # read-only on purpose: only the device reads it
                    warnings.simplefilter("ignore")
                    self._hosts.append(torch.frombuffer(mm, dtype=torch.uint8) if mm is not None else None)
        except BaseException:
            self._unmap()
            raise
        self._pool = cf.ThreadPoolExecutor(max(1, workers), thread_name_prefix="fastload-pcreg")
        self._futures: dict[tuple[int, int], cf.Future] = {}
        for i, mm in enumerate(self._maps):
            if mm is None:
                continue
            for a in range(0, len(mm), region):
                n = min(region, len(mm) - a)
                self._futures[(i, a)] = self._pool.submit(self._register, register, i, a, n)

    def _register(self, register: Callable[[int, int], int], i: int, a: int, n: int) -> tuple[Any, float]:
        """(CUDA error code, or what ``register`` raised as text; seconds)."""
        if self._closed:
            return "stopped", 0.0
        ptr = self._hosts[i].data_ptr() + a
        t = time.perf_counter()
        try:
            rc = register(ptr, n)
        except Exception as e:  # noqa: BLE001 - e.g. no CUDA runtime: a refusal like the driver's, read by host()
            rc = f"{type(e).__name__}: {e}"
        if rc == 0:
            with self._lock:
                self._done.append(ptr)
        return rc, time.perf_counter() - t

    def host(self, i: int, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` of shard ``i`` once page-locked (waits for its region). Raises
        :class:`RegistrationRefused` naming the shard and region that were refused, ``ValueError`` for bytes in two
        regions."""
        a = offset - offset % self.region
        if offset + nbytes > a + self.region:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) of {self.paths[i]} lie in two registrations of "
                             f"{self.region} bytes; a copy must come out of one")
        t = time.perf_counter()
        rc, _ = self._futures[(i, a)].result()
        if rc:
            why = f"CUDA error {rc}" if isinstance(rc, int) else rc
            raise RegistrationRefused(f"cudaHostRegister of {self.paths[i]} at byte {a} returned {why}")
        self.wait_s += time.perf_counter() - t
        return self._hosts[i][offset:offset + nbytes]

    def register_s(self) -> float:
        """Seconds the registrations that finished took, summed over the threads."""
        return sum(f.result()[1] for f in self._futures.values() if f.done() and not f.cancelled())

    def close(self) -> None:
        """Stop registering, unregister what was registered, unmap. The caller must have waited for every copy
        out of the mappings. Raises nothing; a failed unregistration is left to the process's end."""
        self._closed = True
        for f in self._futures.values():
            f.cancel()
        self._pool.shutdown(wait=True)
        with self._lock:
            done, self._done = self._done, []
        for ptr in done:
            self._unregister(ptr)
        self._unmap()

    def close_later(self) -> threading.Thread:
        """:meth:`close` on a thread of its own (returned, started): unregistering gigabytes of pages takes the
        driver a while, which a load need not wait for once its copies finished."""
        th = threading.Thread(target=self.close, name="fastload-pcunreg", daemon=True)
        th.start()
        return th

    def _unmap(self) -> None:
        self._hosts = [None] * len(self._hosts)
        for mm in self._maps:
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # a tensor over it still lives: the mapping goes with the last one
                    pass
        self._maps = []


def _size(f: Any) -> int:
    return os.fstat(f.fileno()).st_size


#: registrations started before vLLM builds the model (:func:`start_early`): (the shards' paths, the registration)
_EARLY: list[tuple[tuple[str, ...], RegisteredShards]] = []


def start_early(paths: list[str], device: int) -> None:
    """Start registering ``paths`` on CUDA ``device`` (an index) now, one registration per shard on one thread
    (more threads did not register faster: the driver serializes them), so that the registrations overlap vLLM's
    model construction as the read arena's page-locking does; :func:`take_early` hands it to the load. A previous
    one not taken is dropped."""
    drop_early()
    register, unregister = cuda_register(device)
    _EARLY.append((tuple(paths), RegisteredShards(paths, register, unregister, whole_files(paths), 1)))


def take_early(paths: list[str]) -> Optional[RegisteredShards]:
    """The registration :func:`start_early` started for exactly ``paths`` (then no longer held here), or None
    (one for other paths is dropped)."""
    if _EARLY and _EARLY[0][0] == tuple(paths):
        return _EARLY.pop()[1]
    drop_early()
    return None


def drop_early() -> None:
    """Unregister (on a thread) a registration :func:`start_early` started that no load took."""
    while _EARLY:
        _EARLY.pop()[1].close_later()
