"""Device buffers a load gives back (the streamers' per-tensor buffers): on which stream, and outside which pool.

**Outside vLLM's sleep pool.** With ``--enable-sleep-mode`` (which turns on ``enable_cumem_allocator``) vLLM builds
and loads the model inside ``torch.cuda.use_mem_pool`` with its sleep allocator
(``CuMemAllocator.use_memory_pool(tag="weights")``, vllm/device_allocator/cumem.py; the condition is
``Worker._maybe_get_memory_pool_context``, vllm/v1/worker/gpu_worker.py, 0.26). When that context ends, vLLM unmaps
the pool's segments that hold no live tensor itself, and PyTorch still counts them as reserved. vLLM then sizes the
KV cache from CUDA's free memory and PyTorch's reserved bytes (its "non-torch memory" is the difference,
vllm/utils/mem_utils.py), so every byte a loader allocated in the pool and gave back became KV cache beyond
``gpu_memory_utilization`` (measured in docs/benchmarks.md, sleep mode). PyTorch routes
only the calling thread's allocations to the pool ("This context manager makes only current thread's allocations
route to the given pool. If a new thread is spawned inside the context manager ... the allocations in that thread
will not route to the given pool", ``torch.cuda.use_mem_pool``'s docstring). So while a load runs inside
:func:`outside_pools` (the streaming loader enters it when :func:`uses_cumem_pool`), these buffers are allocated by
one helper thread of this module. Without a pool they are allocated in the caller: the hop is a thread round trip
per tensor, which a checkpoint of 10^5 tensors would feel.

**On which stream** (:func:`copy_target`). Outside a pool a buffer is allocated on the copy stream and
``record_stream``-ed on the consumer, as PyTorch's CUDA semantics notes prescribe for cross-stream use (the path
every GPU measurement in docs/benchmarks.md ran). Inside one that does not work: while any memory pool is in use,
PyTorch's caching allocator does not free a block that ``record_stream`` marked as used on another stream, it
defers its end-of-life events "until no captures are underway" (``CUDACachingAllocator.cpp``, ``free``;
``use_mem_pool`` counts as a capture), so no buffer freed during the load would be reused. So inside
:func:`outside_pools` a buffer is allocated on the consumer's stream, which needs no ``record_stream`` and is reused
at once in that stream's order, and the copy stream waits for the consumer before its first copy into it (the block
may be one the consumer just dropped, whose last reads are still queued there). That wait makes each new tensor's
copies follow the consumer's work queued so far, which is why it is not the default.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch

_lock = threading.Lock()
_executor: Optional[ThreadPoolExecutor] = None
#: Loads now running inside :func:`outside_pools` (process-wide: the ring pipeline's producer thread and the
#: fan-out allocate for the same load from other threads).
_outside = 0


def uses_cumem_pool(model_config: Any) -> bool:
    """Whether vLLM loads this model inside its sleep allocator's memory pool: ``enable_cumem_allocator`` (vLLM 0.26
    sets it for ``enable_sleep_mode`` on CUDA) or ``enable_sleep_mode`` (XPU's condition); False for a config
    without either field."""
    return bool(getattr(model_config, "enable_cumem_allocator", False) or
                getattr(model_config, "enable_sleep_mode", False))


@contextlib.contextmanager
def outside_pools(enabled: bool) -> Iterator[None]:
    """While this context is open (``enabled``), :func:`transient_empty` allocates CUDA buffers on the helper
    thread, outside any memory pool the loading thread routes to. Nesting and concurrent loads are counted."""
    global _outside
    if not enabled:
        yield
        return
    with _lock:
        _outside += 1
    try:
        yield
    finally:
        with _lock:
            _outside -= 1


def _allocator() -> ThreadPoolExecutor:
    """The process's one allocation thread (started on first use)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix="fastload-devmem")
        return _executor


def _forget_allocator_in_child() -> None:
    """After ``fork`` the child has no thread behind an inherited executor (a submit would wait for ever)."""
    global _executor, _lock
    _executor, _lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_allocator_in_child)


def transient_empty(shape: Any, dtype: torch.dtype, device: torch.device, stream: Any = None) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)`` on ``stream`` (default: the caller's current stream of
    ``device``), for a buffer the load gives back: inside :func:`outside_pools`, allocated by the helper thread
    (never in a pool the calling thread routes to), else in the caller. ``device`` without an index means the
    caller's current CUDA device. Non-CUDA devices: a plain ``torch.empty``. Errors of the allocation (CUDA out of
    memory) are raised in the caller."""
    if device.type != "cuda":
        return torch.empty(shape, dtype=dtype, device=device)
    index = torch.cuda.current_device() if device.index is None else device.index
    device = torch.device("cuda", index)
    if stream is None:
        stream = torch.cuda.current_stream(device)

    def allocate() -> torch.Tensor:
        with torch.cuda.stream(stream):
            return torch.empty(shape, dtype=dtype, device=device)

    if not _outside:
        return allocate()

    def on_helper() -> torch.Tensor:
        # a new thread's current device is device 0: without this, a TP rank's helper would touch GPU 0 (its
        # streams, and a CUDA context there) when it makes the stream current
        torch.cuda.set_device(index)
        return allocate()

    return _allocator().submit(on_helper).result()


def copy_target(nbytes: int, device: torch.device, consumer: Any, copy_stream: Any) -> torch.Tensor:
    """A ``nbytes`` uint8 buffer on ``device`` that ``copy_stream`` fills and ``consumer`` reads and frees (module
    docstring, "On which stream"). Outside :func:`outside_pools`: allocated on ``copy_stream`` and
    ``record_stream``-ed on ``consumer``. Inside: allocated on ``consumer`` by the helper thread, then
    ``copy_stream`` waits for ``consumer``. Either way the consumer must wait for the copies before it reads the
    buffer, and must not drop it before (inside, a dropped buffer may be reused on the consumer's stream while its
    copies still run). ``copy_stream`` None (CPU, or copies made in the consumer's stream): a plain
    :func:`transient_empty` on ``consumer``."""
    if copy_stream is None:
        return transient_empty(nbytes, torch.uint8, device, consumer)
    if not _outside:
        dst = transient_empty(nbytes, torch.uint8, device, copy_stream)
        if device.type == "cuda":
            dst.record_stream(consumer)
        return dst
    dst = transient_empty(nbytes, torch.uint8, device, consumer)
    copy_stream.wait_stream(consumer)
    return dst
