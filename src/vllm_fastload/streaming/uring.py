"""This package's io_uring reader for local files in the page cache: one thread (the consumer's) keeps reads in flight.

:mod:`.preader` reads with a pool of Python threads; each finished read needs the GIL to hand its slot over, and
the thread that issues the H2D copies (vLLM's loading thread) shares the GIL with all of them. Here the kernel's
io_uring workers do the page-cache copies (``IOSQE_ASYNC``: every read is handed to an ``io-wq`` worker instead of
being copied inline by the submitting thread), and the consumer's own thread submits and reaps them between the
copies it issues: no reader thread, no hand-over (the shape of instanttensor's BUFFERED backend, whose public
source reads through io_uring from one loader thread).

Data flow (:class:`UringRing`, the same interface as :class:`.preader.PreadRing`)::

    consumer thread, at each next(): slots whose copy finished (event query) -> submit a read of the next range
    into each (file order, IOSQE_ASYNC) -> wait for one completion -> hand (range, slot) out
    consumer (:func:`.direct.stream_tensors`): issue the copy out of the slot, then :meth:`UringRing.recycle`
    with the copy's event

The binding is the ``liburing`` package on PyPI (a wrapper of C liburing). Its wait calls keep the GIL and raise on
EINTR, so this module never blocks in them: the ring signals completions on an eventfd
(``io_uring_register_eventfd``) and the thread blocks in ``os.read`` of it, which releases the GIL and retries
after a signal (PEP 475), then takes the completions without waiting. :func:`unavailable` says why io_uring cannot
be used here (package missing, the kernel or a seccomp profile refusing ``io_uring_setup``, a test read failing);
the loader then reads with :mod:`.preader`.
"""

from __future__ import annotations

import errno
import functools
import os
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Optional

from .knobs import env_int, env_switch
from .preader import Piece, plan_reads

#: Bytes per read request: a range longer than this is read as several requests, each copied by its own io-wq
#: worker. The default is the default slot size (one request per range): smaller requests measured slower on the
#: H200 host (docs/benchmarks.md). ``FASTLOAD_URING_PART_BYTES`` overrides it, for the benchmarks that compare sizes.
PART_BYTES = env_int("FASTLOAD_URING_PART_BYTES", 8 << 20)
#: Most read requests in flight: a ring of this many entries (the kernel refuses more than 32768), and what
#: ``concurrency`` admits.
MAX_DEPTH = 4096
#: Whether a ring registers its slots with the kernel (``io_uring_register_buffers``) and reads into them with
#: ``IORING_OP_READV_FIXED`` (Linux 6.15 on), as instanttensor's reader registers its pinned ring. Off unless
#: ``FASTLOAD_URING_FIXED=1``: on this project's CPU machine it read slower than plain ``readv`` (CHANGELOG.md), and
#: the GPU host has not measured it. Where registering is refused (``RLIMIT_MEMLOCK``, memory the kernel cannot
#: pin) or the kernel lacks the opcode (``EINVAL``), the ring reads with plain ``readv``.
FIXED_BUFFERS = env_switch("FASTLOAD_URING_FIXED") is True
#: Most io-wq workers copying for the loading thread at once (``IORING_REGISTER_IOWQ_MAX_WORKERS``, bounded class,
#: Linux 5.15 on; 0: the kernel's default, min(ring entries, 4 x CPUs)). The per-copy timeline of a TP=1 load on a
#: 16-CPU host (docs/benchmarks.md) found the loading thread slow to issue copies while 16 workers copied, so a
#: limit below the CPU count is a candidate to measure; unset unless ``FASTLOAD_URING_IOWQ_WORKERS`` gives one.
#: The limit belongs to the thread's io-wq, shared by its rings: :meth:`UringRing.close` puts the old one back (a
#: load opens one ring at a time; two open at once on one thread and closed oldest first would leave the cap on).
IOWQ_WORKERS = env_int("FASTLOAD_URING_IOWQ_WORKERS", 0)
#: io_uring_register(2)'s system call number (427 on x86_64, aarch64 and every architecture of the generic table; the
#: liburing wheels are built for those) and opcode.
_NR_IO_URING_REGISTER = 427
_IORING_REGISTER_IOWQ_MAX_WORKERS = 19
_IORING_REGISTER_IOWQ_AFF = 17
_IORING_UNREGISTER_IOWQ_AFF = 18
#: Whether a ring keeps its io-wq workers off one CPU and pins the thread that started it (the loading thread, which
#: submits the reads and issues the H2D copies) to that CPU while it reads (``IORING_REGISTER_IOWQ_AFF``, Linux 5.14
#: on): True / False as ``FASTLOAD_URING_IOWQ_AFF`` is ``1`` / ``0``; None (unset): where the thread may run on at
#: least :data:`AFFINITY_MIN_CPUS` CPUs. The per-copy timeline of a TP=1 load on a 16-CPU host found the loading
#: thread slow to issue copies while 16 workers copied on every CPU; capping the workers helped issuing but slowed
#: the reads, this keeps all of them and gives the loading thread a CPU of its own (docs/benchmarks.md).
IOWQ_AFFINITY: Optional[bool] = env_switch("FASTLOAD_URING_IOWQ_AFF")
#: Fewest CPUs the loading thread may use for :data:`IOWQ_AFFINITY`'s default to pin it: it was measured on 16-CPU
#: hosts; with few CPUs, one taken from the workers is a large share of their copying.
AFFINITY_MIN_CPUS = 8


def _register(ring_fd: int, op: int, name: str, arg: Any, nr_args: int) -> None:
    """``io_uring_register(ring_fd, op, arg, nr_args)`` as the raw system call (io_uring_register(2)): the liburing
    package wraps none of the io-wq opcodes. Raises ``OSError`` naming ``name`` as the kernel refused it."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(ctypes.c_long(_NR_IO_URING_REGISTER), ctypes.c_int(ring_fd), ctypes.c_uint(op), arg,
                    ctypes.c_uint(nr_args)) < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"io_uring_register({name}): {os.strerror(err)}")


def iowq_max_workers(ring_fd: int, bounded: int, unbounded: int = 0) -> tuple[int, int]:
    """Set the most io-wq workers (bounded: regular-file reads; unbounded) of the calling thread's io-wq, for the
    io_uring instance ``ring_fd``; 0 leaves a class as it is. Returns the limits before the call (0, 0 when the
    thread had no io-wq yet). Raises ``OSError`` as the kernel refused it (EINVAL before Linux 5.15)."""
    import ctypes

    counts = (ctypes.c_uint * 2)(bounded, unbounded)
    _register(ring_fd, _IORING_REGISTER_IOWQ_MAX_WORKERS, "IOWQ_MAX_WORKERS", counts, 2)
    return counts[0], counts[1]


def iowq_affinity(ring_fd: int, cpus: Optional[set[int]]) -> None:
    """Keep the calling thread's io-wq workers (for the io_uring instance ``ring_fd``) on ``cpus`` (CPU numbers);
    None puts the default back (the CPUs the thread may run on). Raises ``OSError`` as the kernel refused it (EINVAL
    before Linux 5.14 or for a mask of no online CPU). ``IORING_REGISTER_IOWQ_AFF`` takes a ``cpu_set_t`` mask and
    its size in bytes, ``IORING_UNREGISTER_IOWQ_AFF`` nothing (io_uring_register(2))."""
    import ctypes

    if cpus is None:
        _register(ring_fd, _IORING_UNREGISTER_IOWQ_AFF, "UNREGISTER_IOWQ_AFF", None, 0)
        return
    size = max(128, -(-(max(cpus, default=0) + 1) // 64) * 8)  # glibc's cpu_set_t is 128 bytes
    raw = bytearray(size)
    for c in cpus:
        raw[c // 8] |= 1 << (c % 8)
    _register(ring_fd, _IORING_REGISTER_IOWQ_AFF, "REGISTER_IOWQ_AFF", (ctypes.c_ubyte * size).from_buffer(raw), size)


def io_workers(tid: int) -> dict[int, set[int]]:
    """The io-wq worker threads of thread ``tid`` (native id) of this process -> the CPUs each may run on: the
    tasks of ``/proc/self/task`` named ``iou-wrk-<tid>`` (the kernel's name for them, cut at 15 characters like
    every task name). The kernel names them by the id in its own (initial) pid namespace, so inside a container's
    namespace none may match: then every ``iou-wrk-*`` task whose number is no task id here (the workers of all
    this process's threads; moving another thread's worker with these only narrows it while the ring reads).
    Empty where /proc cannot be read."""
    name = f"iou-wrk-{tid}"[:15]
    mine: dict[int, set[int]] = {}
    other: dict[int, set[int]] = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return mine
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                comm = f.read().rstrip("\n")
            if comm == name:
                mine[int(t)] = os.sched_getaffinity(int(t))
            elif comm.startswith("iou-wrk-") and comm[8:] not in tasks:
                other[int(t)] = os.sched_getaffinity(int(t))
        except OSError:
            pass  # the task exited meanwhile
    return mine or other


def current_cpu() -> Optional[int]:
    """The CPU the calling thread runs on (glibc's ``sched_getcpu(3)``, else field 39, ``processor``, of
    ``/proc/thread-self/stat``, proc(5)); None where neither answers."""
    import ctypes

    try:
        cpu = ctypes.CDLL(None, use_errno=True).sched_getcpu()
        if cpu >= 0:
            return int(cpu)
    except (OSError, AttributeError):
        pass  # no such symbol (a libc without it): ask /proc
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])  # fields from the 3rd on, after the command name
    except (OSError, ValueError, IndexError):
        return None


#: Native ids of threads whose ring was closed by another thread: the kernel applies the io-wq mask calls to the
#: calling thread's io-wq, so the pinned thread's own mask for new workers stays until that thread starts its next
#: ring (:func:`_restore_stale_iowq`)
_STALE_IOWQ: set[int] = set()


def _restore_stale_iowq(ring_fd: int) -> None:
    """Put the default io-wq mask back for the calling thread if a ring of it was closed by another thread."""
    import threading

    tid = threading.get_native_id()
    if tid in _STALE_IOWQ:
        _STALE_IOWQ.discard(tid)
        try:
            iowq_affinity(ring_fd, None)
        except OSError:
            pass  # the kernel refuses: new workers keep the narrower mask, reading the same bytes


def _new_tasks(before: Optional[set[str]], workers: dict[int, set[int]]) -> list[int]:
    """This process's task ids not in ``before`` (ids as /proc/self/task lists them), without ``workers`` (the
    pinned thread's io-wq workers, :func:`io_workers`); empty when ``before`` is None or /proc cannot be read."""
    if before is None:
        return []
    try:
        now = set(os.listdir("/proc/self/task")) - before
    except OSError:
        return []
    return [int(t) for t in now if int(t) not in workers]


@functools.lru_cache(maxsize=1)
def unavailable() -> Optional[str]:
    """Why this process cannot read through io_uring (the ``liburing`` package is not installed or fails to import;
    ``io_uring_setup`` refused, e.g. ENOSYS on an old kernel or EPERM under a seccomp profile; a test read of this
    module's source file failing or differing from ``os.pread``'s), or None. The answer is cached for the
    process."""
    try:
        import liburing  # noqa: F401 - only whether it imports
    except Exception as e:  # noqa: BLE001 - an import of a compiled module can fail many ways; all mean "no"
        return f"the liburing package cannot be imported ({type(e).__name__}: {e})"
    import torch

    path = os.path.realpath(__file__)
    slot = torch.zeros(64, dtype=torch.uint8)
    try:
        with UringRing([(path, [0], [64])], [slot], 1, pin=False) as ring:
            got = [bytes(p.data.numpy()) for p in ring]
        fd = os.open(path, os.O_RDONLY)
        try:
            want = os.pread(fd, 64, 0)
        finally:
            os.close(fd)
    except Exception as e:  # noqa: BLE001 - the binding raises OSError subclasses; any failure means "no"
        return f"io_uring failed ({type(e).__name__}: {e})"
    if got != [want]:
        return f"an io_uring test read of {path} gave other bytes than os.pread"
    return None


class UringRing:
    """Reads byte ranges of local files through io_uring into ``slots`` (uint8 host tensors, each at least as large
    as the largest range), at most ``depth`` read requests of at most ``part_bytes`` in flight, handing each range
    out (in completion order) once all its requests completed.

    Same contract as :class:`.preader.PreadRing`: ``requests`` are ``(path, offsets, sizes)`` per file (absolute
    byte offsets); iterate once, from one thread; give every :class:`~.preader.Piece` back with :meth:`recycle`
    (with the event of the copy out of it, or None); :meth:`close` (also on leaving ``with``) waits for the reads
    still in flight (the kernel writes into the slots until they complete) before it returns, so the slots' memory
    may be freed after it. The iterator raises ``OSError`` for a failed read (naming the file), ``EOFError`` for a
    file that ended before a range it promised; ``ValueError`` for no slots, ``depth < 1``, ``part_bytes < 1`` or a
    range larger than a slot. ``slot_wait_s``: seconds spent waiting for a slot's copy because no read could be
    submitted.
    """

    def __init__(self, requests: list[tuple[str, list[int], list[int]]], slots: list[Any], depth: int,
                 part_bytes: int = PART_BYTES, pin: bool = True):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if part_bytes < 1:
            raise ValueError(f"part_bytes must be >= 1, got {part_bytes}")
        self._work, self._paths, self._views, room = plan_reads(requests, slots, "UringRing")
        self._slots = slots
        self._part = part_bytes
        #: read requests kept in flight (and io-wq workers busy) at most
        self.threads = max(1, min(depth, MAX_DEPTH, len(slots) * -(-room // part_bytes)))
        self.slot_wait_s = 0.0
        self._ready: deque[Piece] = deque()  # zero-byte ranges: handed out without a read
        self._free: deque[int] = deque(range(len(slots)))
        self._pending: deque[tuple[int, Any]] = deque()  # (slot, event of the copy out of it)
        # slot being read -> [work index, requests not yet completed, byte offset of the next request to submit]
        self._filling: dict[int, list] = {}
        self._open: deque[int] = deque()  # slots with requests still to submit, oldest first
        # request id -> [slot, first byte in the slot, end byte, bytes read so far, iovec the kernel writes through,
        # whether it went as READV_FIXED]
        self._inflight: dict[int, list] = {}
        self._ids = 0
        self._next = 0
        #: whether reads go into the slots as registered buffers (:data:`FIXED_BUFFERS`; set by :meth:`start`)
        self.fixed = False
        #: the io-wq worker limit this ring set (:data:`IOWQ_WORKERS`), None when it set none
        self.iowq_workers: Optional[int] = None
        self._iowq_before: Optional[tuple[int, int]] = None
        #: the CPU the loading thread was pinned to, the io-wq workers kept off it (:data:`IOWQ_AFFINITY`); None
        #: when not pinned
        self.loader_cpu: Optional[int] = None
        self._may_pin = pin  # False: never (the availability probe; a fan-out's reading thread)
        # (native id of the pinned thread, its CPUs before, its io-wq workers then -> their CPUs before, the
        # process's task ids then or None)
        self._pinned: Optional[tuple[int, set[int], dict[int, set[int]], Optional[set[str]]]] = None
        self._registered: Any = None  # the slots' iovecs while registered (the kernel holds their pages)
        self._fds: list[int] = []
        self._ring: Any = None
        self._lib: Any = None
        self._efd = -1

    def __enter__(self) -> UringRing:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        """Open the files and set the ring up with its completion eventfd (the first ``next()`` does it too).
        Raises ``OSError`` as ``open``, ``eventfd`` or ``io_uring_setup`` raised it (nothing left open then)."""
        if self._ring is not None:
            return
        import liburing

        self._lib = liburing
        try:
            for p in self._paths:
                self._fds.append(os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
            self._efd = os.eventfd(0, os.EFD_CLOEXEC)
            ring = liburing.Ring()
            liburing.io_uring_queue_init(1 << max(1, (self.threads - 1).bit_length()), ring)
            try:
                liburing.io_uring_register_eventfd(ring, self._efd)
            except BaseException:
                liburing.io_uring_queue_exit(ring)
                raise
        except BaseException:
            self._close_fds()
            raise
        self._ring, self._cqe = ring, liburing.Cqe()
        if IOWQ_WORKERS:
            try:
                self._iowq_before = iowq_max_workers(ring.ring_fd, IOWQ_WORKERS)
            except OSError:
                pass  # an older kernel: the default number of workers reads the same bytes
            else:
                self.iowq_workers = IOWQ_WORKERS
        _restore_stale_iowq(ring.ring_fd)
        if IOWQ_AFFINITY is not False and self._may_pin:
            self._pin(ring.ring_fd, 2 if IOWQ_AFFINITY else AFFINITY_MIN_CPUS)
        if FIXED_BUFFERS:
            iovecs = liburing.Iovec(self._views)
            try:
                liburing.io_uring_register_buffers(ring, iovecs)
            except (OSError, ValueError, TypeError):
                pass  # refused (memlock limit, memory that cannot be pinned): plain readv reads the same bytes
            else:
                self._registered, self.fixed = iovecs, True

    def _pin(self, ring_fd: int, fewest: int = 2) -> None:
        """:data:`IOWQ_AFFINITY`: this thread onto the CPU it runs on now (where the scheduler put it beside the
        host's other work, so loading threads of other engines or ranks are likely elsewhere; no pin if that cannot
        be read), the workers onto the thread's other CPUs. The kernel's mask covers the workers
        it starts from now on; the thread's workers that already run (one is started with the thread's first ring
        and stays) are moved with ``sched_setaffinity`` of their own. Nothing changes where the thread may use fewer
        than ``fewest`` CPUs or the kernel refuses (the same bytes are read either way)."""
        import threading

        try:
            before = os.sched_getaffinity(0)  # pid 0: the calling thread (sched_setaffinity(2))
        except (AttributeError, OSError):
            return
        if len(before) < max(2, fewest):
            return
        cpu = current_cpu()
        if cpu not in before:
            return  # unknown: a fixed choice would put the loading threads of a host's engines on one CPU
        try:
            tasks = set(os.listdir("/proc/self/task"))
        except OSError:
            tasks = None
        try:
            iowq_affinity(ring_fd, before - {cpu})
        except OSError:
            return
        try:
            os.sched_setaffinity(0, {cpu})
        except OSError:
            try:
                iowq_affinity(ring_fd, None)
            except OSError:
                pass  # the workers keep fewer CPUs: still the same bytes
            return
        tid = threading.get_native_id()
        workers = io_workers(tid)
        for w in workers:
            try:
                os.sched_setaffinity(w, before - {cpu})
            except OSError:
                pass  # it exited meanwhile, or refuses: it reads the same bytes where it is
        self._pinned, self.loader_cpu = (tid, before, workers, tasks), cpu

    def _unpin(self) -> None:
        """Put the worker and thread affinity of :meth:`_pin` back: the CPUs of the workers that ran before (the
        thread's CPUs for those started since), the thread's own mask, and the thread's CPUs for every thread
        started while it was pinned that still has only the pinned CPU (a new thread inherits its creator's mask:
        a pool first started during the load would otherwise stay on one CPU; a thread that pinned itself to that
        very CPU meanwhile is put back too, which cannot be told apart). The kernel's mask for new workers belongs
        to the calling thread's io-wq: put back here when the pinned thread closes (the loader closes on the thread
        that reads), else at that thread's next ring (:data:`_STALE_IOWQ`)."""
        import threading

        pinned, self._pinned = self._pinned, None
        if pinned is None:
            return
        tid, before, workers, tasks = pinned
        if threading.get_native_id() == tid:
            try:
                iowq_affinity(self._ring.ring_fd, None)
            except OSError:
                pass  # the ring goes next, and the workers it started leave when idle
        else:
            _STALE_IOWQ.add(tid)
        now = io_workers(tid)
        for w in now:
            try:
                os.sched_setaffinity(w, workers.get(w, before))
            except OSError:
                pass  # it exited meanwhile
        for t in _new_tasks(tasks, now):
            try:
                if os.sched_getaffinity(t) == {self.loader_cpu}:
                    os.sched_setaffinity(t, before)
            except OSError:
                pass  # it exited meanwhile
        try:
            os.sched_setaffinity(tid, before)  # by id: right from any thread of the process
        except OSError:
            pass  # the thread ended, or a CPU of the old mask went offline: nothing to give back

    def recycle(self, slot: int, event: Any = None) -> None:
        """Give ``slot`` back; it is read into again after ``event`` (a CUDA event recorded after the copies out
        of it; None = free now) completed."""
        if event is None:
            self._free.append(slot)
        else:
            self._pending.append((slot, event))

    def _reclaim(self) -> None:
        while self._pending and self._pending[0][1].query():
            self._free.append(self._pending.popleft()[0])

    def _prep(self, rid: int, req: list) -> None:
        """Queue request ``rid`` (its unread rest) on the submission ring."""
        lib = self._lib
        slot, begin, end, done = req[0], req[1], req[2], req[3]
        fid, _, off, _ = self._work[self._filling[slot][0]]
        iov = lib.Iovec([self._views[slot][begin + done:end]])
        req[4] = iov
        sqe = lib.io_uring_get_sqe(self._ring)
        req[5] = self.fixed
        if self.fixed:
            lib.io_uring_prep_readv_fixed(sqe, self._fds[fid], iov, slot, off + begin + done)
        else:
            lib.io_uring_prep_readv(sqe, self._fds[fid], iov, off + begin + done)
        sqe.flags |= lib.IOSQE_ASYNC
        sqe.user_data = rid

    def _submit(self) -> None:
        """Queue read requests of the next ranges into free slots, up to ``threads`` in flight, and submit them. A
        request counts as in flight once it is queued: :meth:`close` submits what is queued before it waits."""
        self._reclaim()
        added = False
        while len(self._inflight) < self.threads:
            if not self._open:
                if not self._free or self._next >= len(self._work):
                    break
                slot = self._free.popleft()
                fid, r, _, n = self._work[self._next]
                self._next += 1
                if n == 0:
                    self._ready.append(Piece(fid, r, self._slots[slot][:0], slot))
                    continue
                self._filling[slot] = [self._next - 1, -(-n // self._part), 0]
                self._open.append(slot)
            slot = self._open[0]
            state = self._filling[slot]
            n = self._work[state[0]][3]
            begin = state[2]
            end = min(n, begin + self._part)
            self._queue([slot, begin, end, 0, None, False])
            state[2] = end
            if end >= n:
                self._open.popleft()
            added = True
        if added:
            self._flush()

    def _flush(self) -> None:
        """Submit the queued requests, again after a signal interrupted the system call."""
        while True:
            try:
                self._lib.io_uring_submit(self._ring)
                return
            except InterruptedError:
                continue

    def _wait(self) -> None:
        """Block until the ring posted a completion: ``os.read`` of its eventfd releases the GIL while it waits
        and is retried after a signal whose handler returns."""
        os.read(self._efd, 8)

    def _error(self, req: list, res: int) -> BaseException:
        fid, _, off, n = self._work[self._filling[req[0]][0]]
        if res < 0:
            return OSError(-res, f"{os.strerror(-res)}: reading {n} bytes at byte {off} of {self._paths[fid]}")
        try:
            at = min(off + n, max(off, os.fstat(self._fds[fid]).st_size))
        except OSError:
            at = off + req[1] + req[3]
        return EOFError(f"{self._paths[fid]} ended at byte {at}, {off + n - at} bytes short of the range "
                        f"[{off}, {off + n}) the header promised")

    def _queue(self, req: list) -> None:
        """Queue ``req`` (its unread rest) under the next id: ids in flight stay in submission order (:meth:`close`
        relies on it)."""
        rid = self._ids
        self._prep(rid, req)
        self._ids += 1
        self._inflight[rid] = req

    def _again(self, rid: int, req: list) -> None:
        """Queue request ``rid``'s unread rest again, under a new id (:meth:`_queue`)."""
        del self._inflight[rid]
        self._queue(req)

    def _reap(self) -> tuple[list[Piece], int]:
        """``(pieces, completions taken)``: the ranges whose requests all completed, as pieces (a short read is
        submitted again for its rest); never blocks. Every completion seen is taken off the ring before a failed
        read is raised, so :meth:`close` waits only for requests still in flight."""
        lib = self._lib
        out: list[Piece] = []
        again, error, ready = False, None, 0
        # CqeIter follows the completion ring's wrap-around (indexing Cqe past [0] does not)
        for _ in lib.CqeIter(self._ring, self._cqe):
            ready += 1
            c = self._cqe[0]
            rid = c.user_data
            try:
                res = c.res  # the binding raises OSError for a negative result (-errno)
            except OSError as e:
                res = -(e.errno or 5)
            req = self._inflight[rid]
            if res == -errno.EINVAL and req[5] and error is None:
                # a kernel before 6.15 has no READV_FIXED: this request again, and every later one, as plain readv
                self.fixed = False
                self._again(rid, req)
                again = True
                continue
            if res > 0:
                req[3] += res
                if req[1] + req[3] < req[2] and error is None:
                    self._again(rid, req)  # the rest of a short read
                    again = True
                    continue
            if (res <= 0 or req[1] + req[3] < req[2]) and error is None:
                error = self._error(req, res)
            del self._inflight[rid]
            slot = req[0]
            state = self._filling[slot]
            state[1] -= 1
            if state[1] == 0 and state[2] >= self._work[state[0]][3]:
                del self._filling[slot]
                if error is None:
                    fid, r, _, n = self._work[state[0]]
                    out.append(Piece(fid, r, self._slots[slot][:n], slot))
        if ready:
            lib.io_uring_cq_advance(self._ring, ready)
        if again:
            self._flush()
        if error is not None:
            raise error
        return out, ready

    def __iter__(self) -> Iterator[Piece]:
        self.start()
        left = len(self._work)
        while left:
            self._submit()
            if self._ready:
                left -= 1
                yield self._ready.popleft()
                continue
            if not self._inflight:
                if not self._pending:
                    raise RuntimeError("UringRing: every slot is still held by the consumer; give each piece back "
                                       "with recycle() before taking the next")
                # every slot waits for its copy: wait for the oldest, then read into it
                slot, event = self._pending.popleft()
                t = time.perf_counter()
                event.synchronize()
                self.slot_wait_s += time.perf_counter() - t
                self._free.append(slot)
                continue
            pieces, seen = self._reap()
            if not pieces:
                if not seen:
                    self._wait()  # nothing completed since the last look: block until the ring posts
                continue
            for p in pieces:
                left -= 1
                yield p
                self._submit()  # keep the kernel reading while the consumer copies the next piece

    def close(self) -> None:
        """Submit what is queued, wait for every read in flight, tear the ring down, close the files. Idempotent;
        a signal whose handler returns does not interrupt the wait."""
        if self._ring is not None:
            lib = self._lib
            try:
                try:
                    self._flush()
                except OSError:
                    # the newest requests, still queued, never reached the kernel: wait only for the others
                    queued = lib.io_uring_sq_ready(self._ring)
                    for rid in sorted(self._inflight)[len(self._inflight) - queued:] if queued else ():
                        del self._inflight[rid]
                while self._inflight:
                    ready = 0
                    for _ in lib.CqeIter(self._ring, self._cqe):
                        ready += 1
                        self._inflight.pop(self._cqe[0].user_data, None)
                    if ready:
                        lib.io_uring_cq_advance(self._ring, ready)
                    elif self._inflight:
                        self._wait()
            finally:
                self._unpin()  # also when an exception (KeyboardInterrupt) ends the wait: no thread left on one CPU
            if self._iowq_before is not None and any(self._iowq_before):
                try:
                    iowq_max_workers(self._ring.ring_fd, *self._iowq_before)
                except OSError:
                    pass  # it took the limit a moment ago: nothing to do if it refuses the old one
                self._iowq_before = None
            lib.io_uring_queue_exit(self._ring)  # also unregisters the slots
            self._ring, self._registered = None, None
        self._close_fds()

    def _close_fds(self) -> None:
        fds = self._fds + ([self._efd] if self._efd >= 0 else [])
        self._fds, self._efd = [], -1
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass  # already closed underneath us: nothing left to release
