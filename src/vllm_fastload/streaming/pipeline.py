"""Host-to-device pipeline: tensors from the reader -> pinned ring slots -> async H2D copies on a side stream.

Data flow per tensor (``H2DPipeline.run``)::

    reader (runai thread pool, host memory) --memcpy--> pinned slot i --copy_(non_blocking) on copy stream-->
    fresh device tensor; event per slot (slot i is reused only after its copy finished); one event per tensor
    that the consuming stream waits on before the model's ``weight_loader`` narrows it on the GPU.

* The ring is ``pinned_slots`` x ``pinned_slot_bytes`` of pinned (page-locked) host memory, allocated once per load and
  released at the end. A tensor larger than a slot is copied in slot-sized pieces into its device tensor, so
  the largest tensor never has to fit one slot.
* Every yielded tensor is its own device allocation (never a view into a reused buffer); it stays valid for as
  long as the consumer holds it. It is allocated on the copy stream and ``record_stream``-ed on the consumer, or,
  when the load runs inside vLLM's sleep-mode memory pool, outside it and on the consumer's stream
  (:func:`.devmem.copy_target` says why).
* The host memcpy into the slot is split across ``copy_threads`` threads (``Tensor.copy_`` releases the GIL),
  since vLLM workers often run with ``OMP_NUM_THREADS=1``.
* With ``pipeline_thread=True``, :meth:`H2DPipeline.run` drives reader, memcpy and copy issue from a producer thread,
  so they overlap with the consumer's ``weight_loader`` calls. Off by default: the producer's memcpy competes with
  runai's reader threads for the CPUs, which costs more than the overlap gains (docs/benchmarks.md). At most
  ``lookahead`` finished tensors wait in the hand-over queue, so transient device memory is bounded by about
  ``(lookahead + 2)`` x the largest tensor.

PyTorch facts used (docs "CUDA semantics", "Tensor.record_stream"): ``non_blocking=True`` host-to-device
copies are asynchronous only from pinned memory; a stream must ``wait_event`` before using data produced on
another stream; memory allocated on one stream and used on another needs ``record_stream``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .devmem import copy_target
from .timing import StageTimes, next_timed


class H2DPipeline:
    """Copy host tensors to ``device`` through a pinned ring (see module docstring).

    ``pinned_slot_bytes`` (bytes per slot, > 0) and ``pinned_slots`` (>= 2) bound the pinned memory to
    ``pinned_slot_bytes * pinned_slots`` bytes.
    Use as a context manager; :meth:`close` waits for outstanding copies and frees the ring.
    """

    def __init__(self, device: torch.device, pinned_slot_bytes: int = 64 * 2**20, pinned_slots: int = 4,
                 copy_threads: int = 8, lookahead: int = 2, pipeline_thread: bool = False):
        if pinned_slot_bytes <= 0 or pinned_slots < 2:
            raise ValueError(f"pinned ring needs pinned_slot_bytes > 0 and pinned_slots >= 2, got "
                             f"{pinned_slot_bytes} x {pinned_slots}")
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device(self.device.type, torch.cuda.current_device())
        self.pinned_slot_bytes, self.pinned_slots = pinned_slot_bytes, pinned_slots
        self.ring = torch.empty(pinned_slot_bytes * pinned_slots, dtype=torch.uint8, pin_memory=True)
        self.slot_events: list[Any] = [None] * pinned_slots
        self.next_slot = 0
        self.copy_stream = torch.cuda.Stream(device=self.device)
        self.pool = ThreadPoolExecutor(copy_threads) if copy_threads > 1 else None
        self.copy_threads = copy_threads
        self.lookahead = max(1, lookahead)
        self.pipeline_thread = pipeline_thread
        self.times = StageTimes().measures("slot_wait_s", "h2d_s", "memcpy_s", "consumer_wait_s")

    # -- ring -------------------------------------------------------------------------------------------
    def _acquire(self) -> tuple[int, torch.Tensor]:
        i = self.next_slot
        self.next_slot = (i + 1) % self.pinned_slots
        ev = self.slot_events[i]
        if ev is not None:
            with self.times.clock("slot_wait_s"):
                ev.synchronize()
        return i, self.ring[i * self.pinned_slot_bytes:(i + 1) * self.pinned_slot_bytes]

    def _memcpy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        n = src.numel()
        with self.times.clock("memcpy_s"):
            if self.pool is None or n < 8 * 2**20:
                dst[:n].copy_(src)
            else:
                step = -(-n // self.copy_threads)
                list(self.pool.map(lambda o: dst[o:o + step].copy_(src[o:o + step]), range(0, n, step)))

    def to_device(self, src: torch.Tensor, consumer: Any = None) -> tuple[torch.Tensor, Any]:
        """Start copying host tensor ``src`` to the device. Returns ``(device tensor, event)``: the consumer must
        ``wait_event(event)`` (None for an empty tensor) before using it; :meth:`run` does.

        The device tensor comes from :func:`.devmem.copy_target` for ``consumer`` (default: the current stream):
        keep it until ``consumer`` waited for the event. ``src`` may be reused as soon as this returns (its bytes
        are in pinned slots).
        """
        consumer = consumer or torch.cuda.current_stream(self.device)
        if src.numel() == 0:
            return torch.empty(src.shape, dtype=src.dtype, device=self.device), None
        flat = src.reshape(-1).view(torch.uint8)
        nbytes = flat.numel()
        dst = copy_target(nbytes, self.device, consumer, self.copy_stream)
        end = None
        for off in range(0, nbytes, self.pinned_slot_bytes):
            n = min(self.pinned_slot_bytes, nbytes - off)
            i, slot = self._acquire()
            self._memcpy(slot, flat[off:off + n])
            end = self.times.h2d_copy(dst[off:off + n], slot[:n], self.copy_stream)
            self.slot_events[i] = end
        self.times.bytes += nbytes
        self.times.tensors += 1
        return dst.view(src.dtype).view(src.shape), end

    def run(self, named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Map ``(name, host tensor)`` to ``(name, device tensor)``.

        A producer thread pulls from ``named`` (the reader), fills pinned slots and issues the copies; this
        generator hands each finished tensor to the consumer after making the current stream wait for it.
        Errors of the reader or the copy are re-raised here; closing this generator stops the producer.
        """
        consumer = torch.cuda.current_stream(self.device)
        if not self.pipeline_thread:
            try:
                yield from self._run_inline(named, consumer)
            finally:
                consumer.wait_stream(self.copy_stream)  # a buffer dropped mid-copy is reused only after its copies
            return
        handoff: queue.Queue = queue.Queue(maxsize=self.lookahead)
        stop = threading.Event()
        errors: list[BaseException] = []
        dropped: list = []  # a tensor the producer could not hand over: kept until the consumer waited for the copies
        end_mark = object()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    handoff.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                torch.cuda.set_device(self.device)
                while not stop.is_set():
                    item, waited = next_timed(named)
                    self.times.read_wait_s += waited
                    if item is None:
                        break
                    out = (item[0], *self.to_device(item[1], consumer))
                    if not put(out):
                        dropped.append(out)
                        break
            except BaseException as e:  # noqa: BLE001 - handed to the consumer thread
                errors.append(e)
            finally:
                close = getattr(named, "close", None)
                if close is not None:
                    close()
                put(end_mark)

        worker = threading.Thread(target=produce, name="fastload-h2d", daemon=True)
        worker.start()
        try:
            while True:
                with self.times.clock("consumer_wait_s"):
                    item = handoff.get()
                if item is end_mark:
                    break
                name, dst, event = item
                if event is not None:
                    consumer.wait_event(event)
                yield name, dst
        finally:
            stop.set()
            worker.join()
            consumer.wait_stream(self.copy_stream)  # tensors left in the hand-over queue may still be copying
            dropped.clear()
        if errors:
            raise errors[0]

    def _run_inline(self, named: Iterator[tuple[str, torch.Tensor]],
                    consumer: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """``pipeline_thread=False``: reader, memcpy and copy issue run in the consumer's thread between its
        ``weight_loader`` calls; the copies themselves still run asynchronously on the copy stream."""
        while True:
            item, waited = next_timed(named)
            self.times.read_wait_s += waited
            if item is None:
                return
            dst, event = self.to_device(item[1], consumer)
            if event is not None:
                consumer.wait_event(event)
            yield item[0], dst

    def close(self) -> StageTimes:
        """Wait for all copies, sum the H2D GPU time, free the ring and the copy threads. Returns the timings."""
        self.copy_stream.synchronize()
        self.times.settle_h2d()
        self.slot_events = [None] * self.pinned_slots
        self.ring = None
        if self.pool is not None:
            self.pool.shutdown()
        return self.times

    def __enter__(self) -> H2DPipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
