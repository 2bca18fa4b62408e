"""Reading beside model construction (``prefetch``): a load's tensor stream on a thread of its own, started before
vLLM builds the model.

vLLM's ``BaseModelLoader.load_model`` builds the model (``initialize_model``), then calls ``load_weights``, then
``process_weights_after_loading`` (vllm/model_executor/model_loader/base_loader.py, 0.26-0.32). Without this the
reads and H2D copies start only in ``load_weights``; with it the loader starts the same stream (shards, headers,
fingerprint checked first, in the calling thread) before construction, and :class:`Prefetch` runs it on a thread
that keeps at most ``budget_bytes`` of finished tensors the model has not taken. ``load_weights`` then takes the
tensors from that thread: those read meanwhile at once, the rest as they arrive.

**The thread runs the whole stream**, to its end, also after ``load_weights`` started: the io_uring reader's
requests belong to the thread that submitted them (the kernel cancels a task's requests when it exits, and its io-wq
workers are per thread), so the stream is never handed to another thread midway.

**The GIL.** Each H2D copy the thread issues is a few PyTorch calls, and PyTorch releases the GIL inside every op;
the thread then waits for the GIL until the interpreter makes the thread running Python (model construction,
vLLM's ``weight_loader`` calls) drop it, which happens after ``sys.getswitchinterval()`` (5 ms by default, "the
thread switch interval", Python's ``sys`` docs). At 5 ms per copy issued the thread would stream a few hundred MB
while the model is built, so the interval is lowered to :data:`SWITCH_S` while a prefetch's thread runs and put
back when that thread ends (it is process-wide; every thread of the process switches that often meanwhile).

**Memory.** The budget is device memory (host memory on CPU) held beyond the model's parameters: the loader sizes
it from what is free before construction (:func:`gpu_budget`, :func:`host_budget`). It bounds the finished tensors
the model has not taken; the thread may hold one tensor beyond it (it learns a tensor's size when the tensor is
done) and the read ring's pieces of the tensors being assembled.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Optional

from .knobs import env_int

#: The interpreter's thread switch interval while a prefetch runs, in seconds: ``FASTLOAD_PREFETCH_SWITCH_US``
#: microseconds (default 100). Short enough that the prefetch thread gets the GIL back within a fraction of one 8
#: MiB copy's time on the link (about 150 us at 55 GB/s), not shorter: every switch costs the thread that gives
#: the GIL up.
SWITCH_S = env_int("FASTLOAD_PREFETCH_SWITCH_US", 100) / 1e6
#: Seconds between the thread's looks at its stop flag while it waits for room.
POLL_S = 0.05
#: Device memory a GPU prefetch leaves free beyond the parameters, in bytes: CUDA context growth, vLLM's own
#: allocations during construction, the read ring's tensors being assembled.
GPU_MARGIN = 2 << 30

_switch_lock = threading.Lock()
_running = 0  # prefetches now running in this process (the switch interval is lowered while > 0)
_switch_before = 0.0
_switch_set: Optional[float] = None  # the interval the first of them set, None when it left it alone


class _End(NamedTuple):
    """The thread's last message: the stream ended."""


class _Failed(NamedTuple):
    """The thread's last message: what the stream raised."""

    error: BaseException


def nbytes(tensor: Any) -> int:
    """Bytes of ``tensor``'s elements (``numel * element_size``)."""
    return tensor.numel() * tensor.element_size()


def gpu_budget(free: int, total: int, utilization: float, weights: int, largest: int = 0) -> int:
    """Bytes of device memory a prefetch may hold beyond the model's parameters, at most ``weights``.

    ``free``, ``total``: ``torch.cuda.mem_get_info`` before the model is built (bytes); ``utilization``: vLLM's
    ``gpu_memory_utilization`` (the share of ``total`` this engine may use, which vLLM checked was free at its
    start; the KV cache takes it only after the load); ``weights``: the checkpoint's tensor bytes, taken as what
    construction allocates; ``largest``: its largest tensor's bytes (the one tensor the thread may hold beyond the
    budget). What is left of the engine's share and of the free memory after the parameters, ``largest`` and
    :data:`GPU_MARGIN`, never negative: a prefetch never takes memory another process on the GPU may count on.
    """
    used = total - free
    room = min(free, int(utilization * total) - used) - weights - largest - GPU_MARGIN
    return max(0, min(weights, room))


def host_budget(available: int, cgroup_max: Optional[int], cgroup_current: Optional[int], weights: int,
                largest: int = 0) -> int:
    """Bytes of host memory a CPU prefetch may hold beyond the model's parameters, at most ``weights``: a quarter
    of what is left after the parameters and ``largest`` (as :func:`gpu_budget`) of ``available``
    (:func:`host_available`) or, in a container, of its limit (``cgroup_max``, bytes; None: none) less what it
    uses (``cgroup_current``), whichever is less: ``MemAvailable`` counts the whole host's memory, and a prefetch
    must not take a pod past its limit."""
    if cgroup_max is not None:
        available = min(available, cgroup_max - (cgroup_current or 0))
    return max(0, min(weights, (available - weights - largest) // 4))


class Prefetch:
    """``produce()``'s items (tuples whose second element is a tensor: ``(name, tensor)``, the direct path's
    ``(key, buffer, event)``), produced on a thread of their own from now on; iterate once (the consumer's thread):
    each item in the order produced, waiting for the thread when it has none ready. Serves ``prefetch`` and the
    direct path's copy-issue thread (:class:`.direct._IssueThread`).

    ``budget_bytes``: the tensors of items the thread holds that the consumer has not taken, in bytes (always room
    for one). ``setup``: called first in the thread (e.g. to make the consumer's CUDA device and stream the thread's
    current ones). ``lower_switch``: lower the switch interval while the thread runs (below). ``stop``: the event
    :meth:`close` sets (a ``produce`` that checks it stops mid-item; default a new one).
    Errors of ``produce`` or of the stream are raised by the iterator, in the consumer's thread.
    :meth:`close` stops the thread (checked between tensors) and waits for it and so for the stream's own close
    (the reader stopped, the copies finished); call it always (idempotent). The switch interval is lowered from
    construction until the thread ends.
    ``started`` (``time.perf_counter()`` at construction), ``taken_at`` (when iteration began) and
    ``bytes_before_take`` (bytes the thread had produced by then) say how much the prefetch overlapped.
    """

    def __init__(self, produce: Callable[[], Iterator[tuple]], budget_bytes: int,
                 setup: Optional[Callable[[], None]] = None, name: str = "fastload-prefetch",
                 lower_switch: bool = True, stop: Optional[threading.Event] = None):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.started = time.perf_counter()
        self.taken_at: Optional[float] = None
        self.bytes_before_take = 0
        #: seconds the consumer waited for the thread
        self.wait_s = 0.0
        self._produced = 0
        self._produce, self._setup = produce, setup
        self._held = 0
        self._stop = threading.Event() if stop is None else stop
        self._room = threading.Condition()
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._lower_switch = lower_switch
        if lower_switch:
            _lower_switch_interval()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        try:
            self._thread.start()
        except BaseException:
            if lower_switch:
                _restore_switch_interval()
            raise

    def _run(self) -> None:
        try:
            self._stream()
        finally:
            if self._lower_switch:  # here, not in close(): an interrupted close() must not leave it lowered
                _restore_switch_interval()

    def _stream(self) -> None:
        try:
            if self._setup is not None:
                self._setup()
            it = self._produce()
            try:
                for item in it:
                    n = nbytes(item[1])
                    if not self._wait_for_room(n):
                        return
                    self._ready.put((item, n))
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()
            self._ready.put(_End())
        except BaseException as e:  # noqa: BLE001 - raised in the consumer's thread by __iter__
            self._ready.put(_Failed(e))

    def _wait_for_room(self, n: int) -> bool:
        """Wait until the consumer took enough for ``n`` more bytes (always room for one tensor) and count them as
        held and produced, under the lock the consumer reads the count with; False when the prefetch was stopped
        meanwhile."""
        with self._room:
            while self._held and self._held + n > self.budget_bytes and not self._stop.is_set():
                self._room.wait(POLL_S)
            if self._stop.is_set():
                return False
            self._held += n
            self._produced += n
            return True

    def __iter__(self) -> Iterator[tuple]:
        if self.taken_at is not None or self._closed:
            raise RuntimeError("a Prefetch is iterated once, before it is closed")
        self.taken_at = time.perf_counter()
        with self._room:
            self.bytes_before_take = self._produced
        while True:
            t = time.perf_counter()
            item = self._ready.get()
            self.wait_s += time.perf_counter() - t
            if isinstance(item, _End):
                return
            if isinstance(item, _Failed):
                raise item.error
            item, n = item
            with self._room:
                self._held -= n
                self._room.notify()
            yield item

    def close(self) -> None:
        """Stop the thread and wait for it (and so for the stream's close; the thread puts the switch interval back
        when it ends). An interrupted wait (``KeyboardInterrupt``) leaves the prefetch open: call again."""
        if self._closed:
            return
        self._stop.set()
        with self._room:
            self._room.notify()
        self._thread.join()
        self._closed = True
        while True:  # drop what the consumer never took (device memory) now, not with this object
            try:
                self._ready.get_nowait()
            except queue.Empty:
                break


def _lower_switch_interval() -> None:
    global _running, _switch_before, _switch_set
    with _switch_lock:
        if _running == 0:
            _switch_before = sys.getswitchinterval()
            _switch_set = None
            if SWITCH_S < _switch_before:
                sys.setswitchinterval(SWITCH_S)
                _switch_set = sys.getswitchinterval()  # as the interpreter keeps it (whole microseconds)
        _running += 1


def _restore_switch_interval() -> None:
    global _running
    with _switch_lock:
        _running -= 1
        # put back only what a prefetch set: a value someone else set meanwhile stays
        if _running == 0 and _switch_set is not None and sys.getswitchinterval() == _switch_set:
            sys.setswitchinterval(_switch_before)


def host_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (the kernel's estimate of memory available without
    swapping, proc(5)); 0 where it cannot be read."""
    from ..heap import proc_kib_field

    return proc_kib_field("/proc/meminfo", "MemAvailable") or 0
