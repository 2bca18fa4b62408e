"""This package's own reader for local files in the page cache: threads calling ``os.preadv`` into a small ring.

runai-model-streamer stays the reader for object storage and for a cold page cache (its ``O_DIRECT`` reads); a
restart's checkpoint is in the page cache, where a read is a kernel memcpy that a plain thread pool does as well
as any engine. What decides the speed there is the ring: the H2D copies read host memory while the readers write
it, and a ring small enough to stay in the CPU caches spares the memory bus one round trip of every byte
(``benchmarks/pread_probe.py`` measures ring sizes; docs/benchmarks.md has the figures). So the ring is
``slots`` pieces of ``slot_bytes`` (default 16 x 8 MiB), not a deep one.

Data flow (:class:`PreadRing`)::

    reader threads: take the next range (file order) -> take a free slot (wait for the event of the copy that
    last used it) -> os.preadv into the slot -> hand (range, slot) to the consumer
    consumer (:func:`.direct.stream_tensors`): issue the copy out of the slot, then :meth:`PreadRing.recycle`
    with the copy's event (None when the copy already finished, e.g. on CPU)

``os.preadv`` releases the GIL for the system call (CPython's ``posix`` module), so the threads read in parallel.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple, Optional

#: Share of the CPUs given to reader threads by default: the consumer thread issuing copies and vLLM's own
#: threads need the rest (docs/benchmarks.md, the page-cache reader probe: fewer readers than CPUs loaded faster).
CPU_SHARE = 0.75
#: Most reader threads chosen by default.
MAX_DEFAULT_THREADS = 32
#: Seconds between a waiting thread's looks at the stop flag (a closed ring must not leave threads behind).
POLL_S = 0.05


def default_threads(ranks_on_host: int = 1, cpus: Optional[int] = None) -> int:
    """Reader threads for one rank: :data:`CPU_SHARE` of the CPUs (``os.cpu_count()`` unless ``cpus``), shared
    among ``ranks_on_host`` ranks reading at the same time, at least 1 and at most :data:`MAX_DEFAULT_THREADS`."""
    n = int((cpus or os.cpu_count() or 4) * CPU_SHARE) // max(1, ranks_on_host)
    return max(1, min(MAX_DEFAULT_THREADS, n))


class Piece(NamedTuple):
    """One range read into a slot: ``file_id``/``range_index`` index the requests given to :class:`PreadRing`,
    ``data`` is the slot's first ``nbytes`` bytes (a uint8 tensor view), ``slot`` goes back to
    :meth:`PreadRing.recycle`."""

    file_id: int
    range_index: int
    data: Any
    slot: int


class _Failed(NamedTuple):
    error: BaseException


def pread_into(fd: int, buf: memoryview, offset: int, path: str) -> None:
    """Fill ``buf`` from ``fd`` at byte ``offset`` (``os.preadv`` until full). Raises ``EOFError`` naming ``path``
    when the file ends first (it was cut short under the reader), ``OSError`` as the system call raised it."""
    done, want = 0, len(buf)
    while done < want:
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got <= 0:
            raise EOFError(f"{path} ended at byte {offset + done}, {want - done} bytes short of the range "
                           f"[{offset}, {offset + want}) the header promised")
        done += got


def plan_reads(requests: list[tuple[str, list[int], list[int]]], slots: list[Any], who: str):
    """What a ring reads (:class:`PreadRing`, :class:`.uring.UringRing`): ``(work, paths, views, room)`` with
    ``work`` = ``(file id, range index, offset, bytes)`` per range of ``requests`` (``(path, offsets, sizes)`` per
    file), ``views`` = a writable memoryview per slot (uint8 host tensors), ``room`` = the smallest slot's bytes.
    Raises ``ValueError`` (naming ``who``) for no slots or a range larger than a slot."""
    if not slots:
        raise ValueError(f"{who} needs at least one slot")
    room = min(s.numel() for s in slots)
    work = [(fid, r, off, n) for fid, (_, offs, sizes) in enumerate(requests)
            for r, (off, n) in enumerate(zip(offs, sizes))]
    big = max((n for *_, n in work), default=0)
    if big > room:
        raise ValueError(f"a range of {big} bytes does not fit a slot of {room} bytes")
    return work, [p for p, _, _ in requests], [memoryview(s.numpy()) for s in slots], room


class PreadRing:
    """Reads byte ranges of local files with ``threads`` threads into ``slots`` (uint8 host tensors, each at least
    as large as the largest range), handing them out in completion order.

    ``requests``: ``(path, offsets, sizes)`` per file (absolute byte offsets, sizes <= a slot's bytes). Iterate
    once; every :class:`Piece` must be given back with :meth:`recycle` after its bytes were used (or their copy
    issued). :meth:`close` (also on leaving ``with``) stops and joins every thread before it returns, so the slots'
    memory may be freed after it. Errors of a reader thread (``OSError``, ``EOFError`` for a shard cut short) are
    raised by the iterator; ``ValueError`` for no slots or a range larger than a slot.
    """

    def __init__(self, requests: list[tuple[str, list[int], list[int]]], slots: list[Any], threads: int):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._work, self._paths, self._views, _ = plan_reads(requests, slots, "PreadRing")
        self._slots = slots
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(len(slots)):
            self._free.put((i, None))
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._next = itertools.count()
        self._stop = threading.Event()
        self._fds: list[int] = []
        self._threads: list[threading.Thread] = []
        #: reader threads this ring runs (``threads``, at most one per range)
        self.threads = min(threads, max(1, len(self._work)))
        #: seconds reader threads waited for a slot's copy to finish, summed over the threads
        self.slot_wait_s = 0.0
        self._lock = threading.Lock()

    def __enter__(self) -> PreadRing:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        """Open the files and start the threads (the first ``next()`` does it too)."""
        if self._threads or self._stop.is_set():
            return
        for p in self._paths:
            self._fds.append(os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
        for k in range(self.threads):
            th = threading.Thread(target=self._read, name=f"fastload-pread-{k}", daemon=True)
            th.start()
            self._threads.append(th)

    def __iter__(self) -> Iterator[Piece]:
        self.start()
        for _ in range(len(self._work)):
            item = self._done.get()
            if isinstance(item, _Failed):
                raise item.error
            yield item

    def recycle(self, slot: int, event: Any = None) -> None:
        """Give ``slot`` back; a reader reuses it after ``event`` (a CUDA event recorded after the copies out of
        it; None = free now) completed."""
        self._free.put((slot, event))

    def _take_slot(self) -> Optional[int]:
        while not self._stop.is_set():
            try:
                slot, event = self._free.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if event is not None and not event.query():
                t = time.perf_counter()
                event.synchronize()
                with self._lock:
                    self.slot_wait_s += time.perf_counter() - t
            return slot
        return None

    def _read(self) -> None:
        try:
            while not self._stop.is_set():
                i = next(self._next)
                if i >= len(self._work):
                    return
                slot = self._take_slot()
                if slot is None:
                    return
                fid, r, off, n = self._work[i]
                pread_into(self._fds[fid], self._views[slot][:n], off, self._paths[fid])
                self._done.put(Piece(fid, r, self._slots[slot][:n], slot))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self._done.put(_Failed(e))

    def close(self) -> None:
        """Stop the threads, wait for them, close the files. Idempotent."""
        self._stop.set()
        for th in self._threads:
            th.join()
        self._threads = []
        for fd in self._fds:
            os.close(fd)
        self._fds = []
