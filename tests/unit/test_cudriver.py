"""The CUDA driver copy path (streaming/cudriver.py) against a stand-in driver, and the direct path through it on CPU.

The stand-in's ``cuMemcpyHtoDAsync`` is a ``memmove`` between two CPU buffers, so the direct path's use of it is
checked for real: every byte of the zoo must land where the header says. The real driver runs in
tests/gpu/test_direct_gpu.py on the device.
"""

import ctypes
import gc

import pytest
import torch

from tests.conftest import assert_zoo_bit_exact, write_zoo
from tests.unit.test_direct_reader import fake_cuda  # noqa: F401 - a fixture
from vllm_fastload.checkpoint import read_header
from vllm_fastload.streaming import cudriver, direct
from vllm_fastload.streaming.timing import StageTimes


class FakeDriver(cudriver._Lib):
    """``libcuda`` in Python: copies are ``memmove``, events are numbers whose completion the test decides."""

    def __init__(self, ctx=0xC0, device=0, fail=None):
        self.calls, self.created, self.destroyed = [], [], []
        self.ctx, self.device, self.fail = ctx, device, fail or {}
        self.not_ready = set()

    def _rc(self, name):
        return self.fail.get(name, cudriver.CUDA_SUCCESS)

    def memcpy(self, dst, src, n, stream):
        self.calls.append(("memcpy", dst, src, n, stream))
        if self._rc("memcpy"):
            return self._rc("memcpy")
        ctypes.memmove(dst, src, n)
        return 0

    def create(self, ref, flags):
        handle = 0x1000 + len(self.created)
        self.created.append((handle, flags))
        ref._obj.value = handle
        return 0

    def record(self, handle, stream):
        self.calls.append(("record", handle, stream))
        return self._rc("record")

    def query(self, handle):
        return cudriver.CUDA_ERROR_NOT_READY if handle in self.not_ready else self._rc("query")

    def wait(self, stream, handle, flags):
        self.calls.append(("wait", stream, handle, flags))
        return 0

    def synchronize(self, handle):
        self.not_ready.discard(handle)
        return 0

    def destroy(self, handle):
        self.destroyed.append(handle)
        return 0

    def ctx_current(self, ref):
        ref._obj.value = self.ctx
        return 0

    def ctx_device(self, ref):
        ref._obj.value = self.device
        return 0

    def error_name(self, rc, ref):
        ref._obj.value = {1: b"CUDA_ERROR_INVALID_VALUE", 700: b"CUDA_ERROR_ILLEGAL_ADDRESS"}.get(rc, b"?")
        return 0


class Stream:
    def __init__(self, handle=0x5, index=0):
        self.cuda_stream, self.device = handle, torch.device("cuda", index)


@pytest.fixture
def enabled(monkeypatch):
    monkeypatch.setattr(cudriver, "ENABLED", True)


def test_for_stream_needs_the_switch_a_current_context_and_the_streams_device(monkeypatch):
    lib = FakeDriver()
    monkeypatch.setattr(cudriver, "ENABLED", False)
    assert cudriver.for_stream(Stream(), lib) is None  # opt-in
    monkeypatch.setattr(cudriver, "ENABLED", True)
    assert isinstance(cudriver.for_stream(Stream(), lib), cudriver.Driver)
    assert cudriver.for_stream(None, lib) is None
    assert cudriver.for_stream(Stream(), FakeDriver(ctx=0)) is None  # no context on this thread
    assert cudriver.for_stream(Stream(index=1), FakeDriver(device=0)) is None  # the context is another GPU's


def test_the_library_is_none_without_a_driver(monkeypatch):
    cudriver._library.cache_clear()

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "PyDLL", missing)
    try:
        assert cudriver._library() is None
        monkeypatch.setattr(cudriver, "ENABLED", True)
        assert cudriver.for_stream(Stream()) is None
    finally:
        cudriver._library.cache_clear()


def test_copy_queues_on_the_stream_and_a_failure_names_the_call_and_error(enabled):
    lib = FakeDriver()
    drv = cudriver.for_stream(Stream(handle=0x77), lib)
    src = torch.arange(16, dtype=torch.uint8)
    dst = torch.zeros(16, dtype=torch.uint8)
    drv.copy(dst.data_ptr() + 4, src.data_ptr(), 8)
    assert lib.calls == [("memcpy", dst.data_ptr() + 4, src.data_ptr(), 8, 0x77)]
    assert dst.tolist() == [0] * 4 + list(range(8)) + [0] * 4
    assert drv.copies == 1
    lib.fail["memcpy"] = 1
    with pytest.raises(cudriver.DriverError, match=r"cuMemcpyHtoDAsync failed: CUDA_ERROR_INVALID_VALUE \(1\)"):
        drv.copy(dst.data_ptr(), src.data_ptr(), 8)


def test_events_are_pooled_queried_waited_for_and_destroyed(enabled):
    lib = FakeDriver()
    drv = cudriver.for_stream(Stream(handle=0x77), lib)
    ev = drv.record()
    first = ev._handle
    assert lib.created == [(first, cudriver.CU_EVENT_DISABLE_TIMING)]
    assert lib.calls[-1] == ("record", first, 0x77)
    lib.not_ready.add(first)
    assert ev.query() is False
    ev.synchronize()
    assert ev.query() is True
    consumer = Stream(handle=0x99)
    torch.cuda.Stream.wait_event(consumer, ev)  # what the direct path calls: Stream.wait_event -> event.wait
    assert lib.calls[-1] == ("wait", 0x99, first, 0)
    held = drv.record()  # a second event while the first is held: a new handle
    assert held._handle != first and len(lib.created) == 2
    del ev
    gc.collect()
    again = drv.record()  # the dropped one is reused, not created anew
    assert again._handle == first and len(lib.created) == 2
    lib.fail["query"] = 700
    with pytest.raises(cudriver.DriverError, match="cuEventQuery failed: CUDA_ERROR_ILLEGAL_ADDRESS"):
        again.query()
    del again
    gc.collect()
    drv.close()
    assert lib.destroyed == [first]  # the pooled one at close
    del held
    gc.collect()
    assert sorted(lib.destroyed) == sorted(h for h, _ in lib.created)  # a held one when it is dropped after close


@pytest.mark.parametrize("threads", [None, 2])
def test_direct_path_through_the_driver_is_bit_exact(tmp_path, fake_cuda, monkeypatch, enabled,  # noqa: F811
                                                     threads):
    """The zoo through :func:`direct.stream_to_device` with the driver's copies (a ``memmove`` here) for every
    untimed piece: every tensor bit-exact, the untimed copies counted as driver copies, the consumer waiting on the
    driver's events, and every event the load made given back (no handle left outside the pool at close)."""
    consumer, _ = fake_cuda
    lib = FakeDriver()
    made = []

    def for_stream(stream):
        made.append(cudriver.Driver(lib, 0x42))
        return made[-1]

    monkeypatch.setattr(cudriver, "for_stream", for_stream)
    expected = write_zoo(tmp_path / "model.safetensors")
    piece = 4096
    times = StageTimes()
    arena = torch.empty(direct.arena_bytes(piece, 4), dtype=torch.uint8)
    stream = direct.stream_to_device([read_header(str(tmp_path / "model.safetensors"))], torch.device("cpu"),
                                     direct.Ring(piece, 4, threads), times, arena, {})
    got = {n: t.clone() for n, t in stream}
    assert_zoo_bit_exact(got, expected)
    memcpys = [c for c in lib.calls if c[0] == "memcpy"]
    _, where, _ = direct.split_into_pieces([read_header(str(tmp_path / "model.safetensors"))], piece)
    ranges = sum(len(places) for places in where)
    timed = -(-ranges // direct.H2D_SAMPLE)  # every H2D_SAMPLE-th copy stays with torch, between timing events
    assert len(memcpys) == ranges - timed == times.driver_copies > 0
    assert all(c[4] == 0x42 for c in memcpys)  # on the copy stream
    assert sum(c[3] for c in memcpys) < times.bytes
    del stream, got
    gc.collect()
    assert made and made[0]._closed
    assert sorted(lib.destroyed) == sorted(h for h, _ in lib.created)
