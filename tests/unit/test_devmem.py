"""streaming/devmem.py on the CPU machine, with stand-ins for CUDA: inside ``outside_pools`` CUDA buffers are made
by the module's own thread (on the stream asked for, the buffer's device made current there), outside it in the
caller; a consumer buffer is made on the consumer's stream and the copy stream waits for it. (On the GPU,
tests/gpu/test_direct_gpu.py checks that such buffers stay out of a pool and are reused during the load.)"""

import contextlib
import os
import signal
import threading
from types import SimpleNamespace

import pytest
import torch

from vllm_fastload.streaming import devmem


@pytest.fixture
def fake_cuda_alloc(monkeypatch):
    """torch.empty on a CUDA device answers a CPU tensor and records (thread name, stream made current, device)."""
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


def test_inside_outside_pools_cuda_buffers_are_made_on_the_modules_thread(fake_cuda_alloc):
    with devmem.outside_pools(True):
        t = devmem.transient_empty((3, 5), torch.bfloat16, torch.device("cuda", 2), stream="copy stream")
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16
    (thread, _, index), (thread2, stream, device) = fake_cuda_alloc
    assert thread.startswith("fastload-devmem") and thread != threading.current_thread().name and thread2 == thread
    assert index == 2  # the helper makes the buffer's device current first (a new thread's is device 0)
    assert (stream, device) == ("copy stream", "cuda:2")


def test_without_a_pool_buffers_are_made_in_the_caller_on_its_current_stream_and_device(fake_cuda_alloc):
    with devmem.outside_pools(False):
        devmem.transient_empty(7, torch.uint8, torch.device("cuda"))
    assert fake_cuda_alloc == [(threading.current_thread().name, "caller's stream", "cuda:5")]


def test_outside_pools_is_counted_and_closed():
    with devmem.outside_pools(True):
        with devmem.outside_pools(True):
            assert devmem._outside == 2
        assert devmem._outside == 1
    assert devmem._outside == 0
    with pytest.raises(RuntimeError):
        with devmem.outside_pools(True):
            raise RuntimeError("load failed")
    assert devmem._outside == 0


def test_cpu_buffers_are_plain_allocations_in_the_caller(fake_cuda_alloc):
    with devmem.outside_pools(True):
        t = devmem.transient_empty(4, torch.int32, torch.device("cpu"))
    assert t.numel() == 4
    assert fake_cuda_alloc == [(threading.current_thread().name, None, "cpu")]


def test_allocation_errors_reach_the_caller(monkeypatch):
    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch, "empty", oom)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    with devmem.outside_pools(True), pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 2.00 GiB"):
        devmem.transient_empty(2**30, torch.uint8, torch.device("cuda", 0), stream="s")


class _Stream:
    def __init__(self):
        self.waited_for = []

    def wait_stream(self, other):
        self.waited_for.append(other)


def test_copy_target_in_a_pool_is_the_consumers_and_the_copy_stream_waits_for_it(fake_cuda_alloc):
    copy = _Stream()
    with devmem.outside_pools(True):
        t = devmem.copy_target(11, torch.device("cuda", 1), "consumer", copy)
    assert t.numel() == 11 and t.dtype == torch.uint8
    assert fake_cuda_alloc[-1][0].startswith("fastload-devmem")
    assert fake_cuda_alloc[-1][1:] == ("consumer", "cuda:1")
    assert copy.waited_for == ["consumer"]


def test_copy_target_without_a_pool_is_the_copy_streams_recorded_on_the_consumer(fake_cuda_alloc, monkeypatch):
    """The scheme every GPU measurement ran: allocated on the copy stream in the caller, ``record_stream``-ed on
    the consumer; the copy stream does not wait for the consumer."""
    copy = _Stream()
    recorded = []

    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: recorded.append(s), raising=False)
    devmem.copy_target(11, torch.device("cuda", 1), "consumer", copy)
    assert fake_cuda_alloc[-1] == (threading.current_thread().name, copy, "cuda:1")
    assert recorded == ["consumer"] and copy.waited_for == []


@pytest.mark.parametrize("config, expected", [
    (SimpleNamespace(enable_cumem_allocator=True, enable_sleep_mode=True), True),  # vLLM 0.26, CUDA, sleep mode
    (SimpleNamespace(enable_cumem_allocator=True, enable_sleep_mode=False), True),  # --enable-cumem-allocator
    (SimpleNamespace(enable_sleep_mode=True), True),  # a version without the cumem field
    (SimpleNamespace(enable_cumem_allocator=False, enable_sleep_mode=False), False),
    (SimpleNamespace(), False),
])
def test_uses_cumem_pool_follows_vllms_condition(config, expected):
    assert devmem.uses_cumem_pool(config) is expected


def test_a_forked_child_gets_its_own_helper_thread(fake_cuda_alloc):
    with devmem.outside_pools(True):
        devmem.transient_empty(1, torch.uint8, torch.device("cuda", 0), stream="s")  # the parent's executor exists
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: the inherited executor has no thread; a new one must answer
            try:
                devmem.transient_empty(1, torch.uint8, torch.device("cuda", 0), stream="s")
                os.write(w, b"ok")
            finally:
                os._exit(0)
        os.close(w)
        import select

        ready, _, _ = select.select([r], [], [], 20)
        got = os.read(r, 2) if ready else b"timeout"
        if not ready:
            os.kill(pid, signal.SIGKILL)  # the child waits for ever on the dead executor
        os.waitpid(pid, 0)
    assert got == b"ok"
