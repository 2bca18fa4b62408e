"""The direct path's copy-issue thread (streaming/direct.py ``_IssueThread``), on CPU with stand-ins for CUDA streams
and events (tests/unit/test_direct_reader.py's ``fake_cuda``).

What is checked without a GPU: the tensors are bit-exact through both readers; the copies (and the copy stream made
current) happen on the issue thread, the consumer's stream waits happen in the consumer's thread, which never has
its current stream switched; the thread runs no more than its budget ahead of a consumer that pauses; reader errors
reach the consumer with the file named; a consumer that stops midway leaves no thread behind. The real CUDA path:
tests/gpu/test_direct_gpu.py on the device.
"""

import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import assert_zoo_bit_exact, write_zoo
from tests.unit.test_direct_reader import device_buffers, fake_cuda  # noqa: F401 - fixture
from vllm_fastload.checkpoint import read_header
from vllm_fastload.streaming import direct
from vllm_fastload.streaming.timing import StageTimes

READERS = pytest.mark.parametrize("threads", [None, 3], ids=["runai", "pread"])


def _load_threads():
    return [t for t in threading.enumerate() if t.name.startswith(("fastload-h2d-issue", "fastload-pread"))]


def _stream(headers, piece=4096, depth=2, threads=None, stats=None, times=None):
    arena = torch.empty(direct.arena_bytes(piece, depth), dtype=torch.uint8)
    return direct.stream_to_device(headers, torch.device("cpu"), direct.Ring(piece, depth, threads, True),
                                   times or StageTimes(), arena, stats)


@READERS
@pytest.mark.parametrize("piece, depth", [(4096, 2), (5000, 3)])
def test_tensors_are_bit_exact_and_each_is_waited_for_in_the_consumers_thread(tmp_path, fake_cuda, monkeypatch,  # noqa: F811
                                                                              threads, piece, depth):
    consumer, extra = fake_cuda
    me = threading.current_thread()
    waits, copies, current = [], [], []
    monkeypatch.setattr(type(consumer), "wait_event", lambda self, ev: waits.append(threading.current_thread()))
    real_copy = StageTimes.h2d_copy
    monkeypatch.setattr(StageTimes, "h2d_copy", lambda self, *a, **k: copies.append(threading.current_thread()) or
                        real_copy(self, *a, **k))
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: current.append((threading.current_thread(), s)))
    expected = write_zoo(tmp_path / "model.safetensors")
    headers = [read_header(str(tmp_path / "model.safetensors"))]
    times, stats = StageTimes(), {}
    got = {n: t.clone() for n, t in _stream(headers, piece, depth, threads, stats, times)}
    assert_zoo_bit_exact(got, expected)
    assert times.bytes == sum(len(raw) for _, _, raw in expected.values()) and times.tensors == len(expected)
    # one wait per copy event the tensors were handed with, one copy per range read
    assert len(waits) == device_buffers(tmp_path / "model.safetensors", piece) and set(waits) == {me}
    pieces = len(direct.split_into_pieces(headers, piece)[0][0][1])
    assert len(copies) == pieces and me not in copies and len(set(copies)) == 1
    (copy_stream,) = consumer.copy_streams
    assert current == [(copies[0], copy_stream)]  # made current once, on the issue thread only
    assert times.consumer_wait_s is not None and times.consumer_wait_s >= 0
    assert extra == [] and stats["pinned_extra_bytes"] == 0
    assert _load_threads() == []


def _many(tmp_path, n=64, numel=2048):
    """``n`` float32 tensors of ``numel`` elements (8 KiB each) in one file; returns the tensors."""
    g = torch.Generator().manual_seed(1)
    ts = {f"w{i:03d}": torch.randn(numel, generator=g) for i in range(n)}
    save_file(ts, str(tmp_path / "many.safetensors"))
    return ts


@READERS
def test_the_thread_runs_at_most_its_budget_ahead_of_a_pausing_consumer(tmp_path, fake_cuda, monkeypatch,  # noqa: F811
                                                                        threads):
    """Budget: AHEAD_SPANS x pinned_slots x pinned_slot_bytes = 2 x 2 x 4096 bytes = two 8 KiB tensors here. While
    the consumer holds its first tensor the thread finishes at most two more, then waits; the rest follow once the
    consumer goes on."""
    made = []

    class Recorded(direct._IssueThread):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(direct, "_IssueThread", Recorded)
    ts = _many(tmp_path)
    g = _stream([read_header(str(tmp_path / "many.safetensors"))], 4096, 2, threads)
    name, first = next(g)
    (th,) = made
    deadline = time.monotonic() + 10
    while th._ready.qsize() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # had it no budget, it would finish more meanwhile
    assert th._ahead == 2 * 8192 and th._ready.qsize() == 2
    assert th._thread.is_alive()
    got = {name: first.clone(), **{n: t.clone() for n, t in g}}
    assert got.keys() == ts.keys() and all(torch.equal(got[n], ts[n]) for n in ts)
    assert th._ahead == 0 and _load_threads() == []


@READERS
def test_a_tensor_larger_than_the_budget_still_goes_through(tmp_path, fake_cuda, threads):  # noqa: F811
    save_file({"big": torch.arange(100_000, dtype=torch.float32), "small": torch.ones(3)},
              str(tmp_path / "big.safetensors"))
    got = dict(_stream([read_header(str(tmp_path / "big.safetensors"))], 4096, 2, threads))
    assert torch.equal(got["big"], torch.arange(100_000, dtype=torch.float32)) and torch.equal(got["small"],
                                                                                                torch.ones(3))


def test_a_shard_cut_short_is_raised_in_the_consumer_naming_the_file(tmp_path, fake_cuda):  # noqa: F811
    _many(tmp_path, n=8)
    path = tmp_path / "many.safetensors"
    headers = [read_header(str(path))]
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 10_000)
    with pytest.raises(EOFError, match="many.safetensors ended at byte"):
        for _ in _stream(headers, 4096, 2, threads=2):
            pass
    assert _load_threads() == []


@READERS
def test_a_consumer_that_stops_midway_leaves_no_thread(tmp_path, fake_cuda, threads):  # noqa: F811
    _many(tmp_path)
    g = _stream([read_header(str(tmp_path / "many.safetensors"))], 4096, 2, threads)
    next(g)
    time.sleep(0.1)
    g.close()
    assert _load_threads() == []


def test_issue_thread_is_off_by_default_and_validated():
    from vllm_fastload.config import StreamerConfig
    from vllm_fastload.errors import ConfigError

    assert StreamerConfig.from_extra({}).issue_thread is False
    assert StreamerConfig.from_extra({"issue_thread": True}).issue_thread is True
    with pytest.raises(ConfigError, match="issue_thread"):
        StreamerConfig.from_extra({"issue_thread": "yes please"})
