"""Device buffers a load gives back (the streamers' per-tensor buffers), allocated outside any memory pool.

Why: with ``--enable-sleep-mode`` vLLM builds and loads the model inside ``torch.cuda.use_mem_pool`` with its sleep
allocator (``CuMemAllocator.use_memory_pool(tag="weights")``, vllm/device_allocator/cumem.py, 0.26). When that
context ends, vLLM unmaps the pool's segments that hold no live tensor itself, and PyTorch still counts them as
reserved. vLLM then sizes the KV cache from CUDA's free memory and PyTorch's reserved bytes (its "non-torch memory"
is the difference, vllm/utils/mem_utils.py), so every byte a loader allocated in the pool and gave back before the
load ended becomes KV cache beyond ``gpu_memory_utilization``: measured on one H200 with the 16 GB model, 16 GB
more KV cache than vLLM's default loader gives (docs/benchmarks.md, sleep mode).

How: PyTorch routes only the calling thread's allocations to the pool ("This context manager makes only current
thread's allocations route to the given pool. If a new thread is spawned inside the context manager ... the
allocations in that thread will not route to the given pool", ``torch.cuda.use_mem_pool``'s docstring).
So these buffers are allocated by one helper thread of this module: they come from PyTorch's default caching
allocator, go back to it when freed, and vLLM's ``torch.cuda.empty_cache()`` after the load returns them to CUDA.
The weights themselves stay where vLLM allocates them (its parameters, in the pool, offloaded and restored by sleep
mode). Without a pool the helper thread changes nothing but the thread that calls ``cudaMalloc``.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch

_lock = threading.Lock()
_executor: Optional[ThreadPoolExecutor] = None


def _allocator() -> ThreadPoolExecutor:
    """The process's one allocation thread (started on first use; idle threads cost nothing)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix="fastload-devmem")
        return _executor


def empty_outside_pools(shape: Any, dtype: torch.dtype, device: torch.device, stream: Any = None) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, allocated on ``stream`` (default: the caller's current
    stream of ``device``) but never in a memory pool the calling thread routes its allocations to (see the module
    docstring). ``device`` without an index means the caller's current CUDA device. Non-CUDA devices: a plain
    ``torch.empty`` in the calling thread. Errors of the allocation (CUDA out of memory) are raised in the
    caller."""
    if device.type != "cuda":
        return torch.empty(shape, dtype=dtype, device=device)
    index = torch.cuda.current_device() if device.index is None else device.index
    device = torch.device("cuda", index)
    if stream is None:
        stream = torch.cuda.current_stream(device)

    def allocate() -> torch.Tensor:
        # a new thread's current device is device 0: without this, a TP rank's helper would touch GPU 0 (its
        # streams, and a CUDA context there) when it makes the stream current
        torch.cuda.set_device(index)
        with torch.cuda.stream(stream):
            return torch.empty(shape, dtype=dtype, device=device)

    return _allocator().submit(allocate).result()
