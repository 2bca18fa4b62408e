"""streaming/devmem.py on the CPU machine: CUDA buffers are made by the module's own thread, on the stream asked
for; other devices are a plain allocation in the caller. (tests/gpu/test_direct_gpu.py checks on the GPU that such
buffers stay out of a memory pool the loading thread routes to.)"""

import contextlib
import threading

import pytest
import torch

from vllm_fastload.streaming import devmem


@pytest.fixture
def fake_cuda_alloc(monkeypatch):
    """torch.empty on a CUDA device answers a CPU tensor and records (thread name, stream made current)."""
    calls, current = [], []
    real_empty = torch.empty

    def empty(*a, device=None, **k):
        calls.append((threading.current_thread().name, current[-1] if current else None, str(device)))
        return real_empty(*a, **k)

    @contextlib.contextmanager
    def stream(s):
        current.append(s)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "caller's stream")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda i: calls.append((threading.current_thread().name, "set_device", i)))
    return calls


def test_cuda_buffers_are_made_on_the_modules_thread_on_the_stream_asked_for(fake_cuda_alloc):
    t = devmem.empty_outside_pools((3, 5), torch.bfloat16, torch.device("cuda", 2), stream="copy stream")
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16
    (thread, _, index), (thread2, stream, device) = fake_cuda_alloc
    assert thread.startswith("fastload-devmem") and thread != threading.current_thread().name and thread2 == thread
    assert index == 2  # the helper makes the buffer's device current first (a new thread's is device 0)
    assert (stream, device) == ("copy stream", "cuda:2")


def test_default_stream_and_device_are_the_callers_current_ones(fake_cuda_alloc):
    devmem.empty_outside_pools(7, torch.uint8, torch.device("cuda"))
    assert fake_cuda_alloc[0][1:] == ("set_device", 5)
    assert fake_cuda_alloc[1][1:] == ("caller's stream", "cuda:5")


def test_cpu_buffers_are_plain_allocations_in_the_caller(fake_cuda_alloc):
    t = devmem.empty_outside_pools(4, torch.int32, torch.device("cpu"))
    assert t.numel() == 4
    assert fake_cuda_alloc == [(threading.current_thread().name, None, "cpu")]


def test_allocation_errors_reach_the_caller(monkeypatch):
    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch, "empty", oom)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 2.00 GiB"):
        devmem.empty_outside_pools(2**30, torch.uint8, torch.device("cuda", 0), stream="s")
