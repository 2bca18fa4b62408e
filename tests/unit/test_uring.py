"""This package's io_uring reader (streaming/uring.py) alone and how a load chooses it (inside the direct path it
runs in tests/unit/test_preader.py's direct-path tests, beside the pread reader).

On CPU: the bytes handed out equal the file's, a slot is read into again only after its copy's event, a shard cut
short and a failed read are errors naming the file, closing early waits for the reads in flight, the opt-in io-wq
worker limit and CPU affinity hold while a ring reads and are put back at close, and where io_uring cannot be used
the load reads with the pread reader and says so. The reader tests skip (with the reason)
where this kernel or the liburing package gives no io_uring; the CUDA copies run in tests/gpu on the device.
"""

import os
import threading

import pytest
import torch

from tests.conftest import assert_zoo_bit_exact, write_zoo
from tests.unit.test_direct_reader import fake_cuda  # noqa: F401 - fixture
from tests.unit.test_preader import SlowEvent, _file, _ranges, _strategy
from vllm_fastload.checkpoint import read_header
from vllm_fastload.streaming import direct, uring
from vllm_fastload.streaming.timing import StageTimes

needs_uring = pytest.mark.skipif(uring.unavailable() is not None, reason=f"no io_uring here: {uring.unavailable()}")


def _slots(n, size=4096):
    return [torch.empty(size, dtype=torch.uint8) for _ in range(n)]


@needs_uring
@pytest.mark.parametrize("part", [1000, 4096, 2**21], ids=["parts", "one-part", "default"])
@pytest.mark.parametrize("depth, slots", [(1, 1), (3, 2), (8, 16)])
def test_every_range_comes_back_with_the_files_bytes(tmp_path, depth, slots, part):
    """Each range read as requests of ``part`` bytes (a 4096-byte range in five of 1000: four full, one short)."""
    (a, da), (b, db) = _file(tmp_path, 100_000, "a.bin"), _file(tmp_path, 33_333, "b.bin")
    requests = [(str(a), *_ranges(len(da), 4096)), (str(b), *_ranges(len(db), 1000))]
    got = {}
    with uring.UringRing(requests, _slots(slots), depth, part) as ring:
        for p in ring:
            got[(p.file_id, p.range_index)] = bytes(p.data.numpy())
            ring.recycle(p.slot)
    assert ring.threads == min(depth, slots * -(-4096 // part))
    for fid, data in ((0, da), (1, db)):
        offs, sizes = requests[fid][1:]
        assert [got[(fid, r)] for r in range(len(offs))] == [data[o:o + n] for o, n in zip(offs, sizes)]


@needs_uring
def test_a_slot_is_read_into_again_only_after_its_copy_event(tmp_path):
    p, data = _file(tmp_path, 10 * 4096)
    log, seen = [], []
    with uring.UringRing([(str(p), *_ranges(len(data), 4096))], _slots(1), 4) as ring:
        for piece in ring:
            seen.append(bytes(piece.data.numpy()))
            ring.recycle(piece.slot, SlowEvent(log))
    assert seen == [data[o:o + 4096] for o in range(0, len(data), 4096)]  # one slot, never overwritten early
    assert log == ["waited"] * 9  # every reuse of the slot waited for the copy out of it


@needs_uring
def test_a_shard_cut_short_names_the_file_and_the_range(tmp_path):
    p, data = _file(tmp_path, 8192)
    ring = uring.UringRing([(str(p), [0, 8192], [8192, 4096])], _slots(2, 8192), 2)
    with pytest.raises(EOFError, match=f"{p} ended at byte 8192, 4096 bytes short of the range \\[8192, 12288\\)"):
        with ring:
            for piece in ring:
                ring.recycle(piece.slot)


@needs_uring
def test_a_failed_read_names_the_file(tmp_path):
    d = tmp_path / "dir.safetensors"
    d.mkdir()  # reading a directory fails with EISDIR
    with pytest.raises(OSError, match=f"reading 4096 bytes at byte 0 of {d}"):
        with uring.UringRing([(str(d), [0], [4096])], _slots(1), 1) as ring:
            list(ring)


@needs_uring
def test_closing_early_waits_for_the_reads_in_flight(tmp_path):
    p, data = _file(tmp_path, 64 * 4096)
    ring = uring.UringRing([(str(p), *_ranges(len(data), 4096))], _slots(4), 4)
    it = iter(ring)
    first = next(it)  # the consumer keeps this slot and stops with reads in flight
    assert bytes(first.data.numpy()) == data[first.range_index * 4096:(first.range_index + 1) * 4096]
    ring.close()
    assert ring._inflight == {} and ring._fds == []
    ring.close()  # idempotent


def test_bad_arguments_are_refused(tmp_path):
    p, _ = _file(tmp_path, 8192)
    with pytest.raises(ValueError, match="at least one slot"):
        uring.UringRing([(str(p), [0], [8192])], [], 1)
    with pytest.raises(ValueError, match="range of 8192 bytes does not fit a slot of 4096 bytes"):
        uring.UringRing([(str(p), [0], [8192])], _slots(1), 1)
    with pytest.raises(ValueError, match="depth must be >= 1"):
        uring.UringRing([(str(p), [0], [8192])], _slots(1, 8192), 0)


# --- how a load chooses it (streaming/runai_env.fs_strategy_env) ------------------------------------------------
def test_asked_for_and_available_it_reads_with_io_uring(monkeypatch):
    monkeypatch.setattr(uring, "unavailable", lambda: None)
    env, reader, extra = _strategy(monkeypatch, {"fs_strategy": "uring_buffered"})
    assert env == {} and reader == (16, True) and extra["fs_strategy"] == "uring_buffered"  # every slot in flight
    _, reader, _ = _strategy(monkeypatch, {"fs_strategy": "uring_buffered", "concurrency": 5})
    assert reader == (5, True)


def test_without_io_uring_it_reads_with_pread_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(uring, "unavailable", lambda: "io_uring_setup failed (PermissionError: seccomp)")
    with caplog.at_level("INFO", logger="vllm.fastload"):
        env, reader, extra = _strategy(monkeypatch, {"fs_strategy": "uring_buffered"})
    assert env == {} and reader == (12, False) and extra["fs_strategy"] == "pread_buffered"
    assert ("fs_strategy uring_buffered: io_uring_setup failed (PermissionError: seccomp); this load reads with "
            "pread_buffered") in caplog.text


def test_uring_outside_the_direct_path_or_on_object_storage(monkeypatch, caplog):
    from vllm_fastload.errors import ConfigError

    with caplog.at_level("INFO", logger="vllm.fastload"):
        env, reader, _ = _strategy(monkeypatch, {"fs_strategy": "uring_buffered"}, direct=False)
    assert reader is None and env == {"RUNAI_STREAMER_FS_STRATEGY": "sync_buffered"}
    assert "fs_strategy uring_buffered reads on the direct GPU path only" in caplog.text
    with pytest.raises(ConfigError, match="fs_strategy 'uring_buffered' reads local files, but s3://b/m/x"):
        _strategy(monkeypatch, {"fs_strategy": "uring_buffered"}, files=("s3://b/m/x.safetensors",))


def test_unavailable_names_a_missing_package(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_liburing(name, *a, **k):
        if name == "liburing":
            raise ImportError("No module named 'liburing'")
        return real(name, *a, **k)

    uring.unavailable.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_liburing)
    try:
        assert uring.unavailable() == ("the liburing package cannot be imported (ImportError: No module named "
                                       "'liburing')")
    finally:
        monkeypatch.undo()
        uring.unavailable.cache_clear()


# --- found by a helper's attack: signals, the GIL, zero-byte ranges, where a short file ended -------------------
def _fifo_writer(fifo, payload, delay):
    """A thread that opens ``fifo`` for writing (blocking until the ring opens it) and writes after ``delay`` s:
    the ring waits meanwhile, and only gets its bytes if its wait lets this Python thread run."""
    import threading
    import time

    def write():
        fd = os.open(fifo, os.O_WRONLY)
        time.sleep(delay)
        os.write(fd, payload)
        os.close(fd)

    th = threading.Thread(target=write, daemon=True)
    th.start()
    return th


@pytest.fixture
def alarm():
    """SIGALRM with a handler that returns, armed by the test: a wait must survive it (PEP 475)."""
    import signal

    seen = []
    old = signal.signal(signal.SIGALRM, lambda *a: seen.append(1))
    yield lambda s: (signal.setitimer(signal.ITIMER_REAL, s), seen)[1]
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


@needs_uring
def test_the_wait_releases_the_gil_and_survives_a_signal(tmp_path, alarm):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    payload = os.urandom(4096)
    th = _fifo_writer(fifo, payload, 0.4)
    seen = alarm(0.1)
    with uring.UringRing([(str(fifo), [0], [4096])], _slots(1), 1) as ring:
        got = [bytes(p.data.numpy()) for p in ring]
    th.join()
    assert got == [payload] and seen == [1]


@needs_uring
def test_close_waits_for_a_read_in_flight_through_a_signal(tmp_path, alarm):
    p, data = _file(tmp_path, 4096)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    th = _fifo_writer(fifo, os.urandom(4096), 0.4)
    ring = uring.UringRing([(str(p), [0], [4096]), (str(fifo), [0], [4096])], _slots(2), 2)
    it = iter(ring)
    assert bytes(next(it).data.numpy()) == data  # the pipe's read stays in flight
    seen = alarm(0.1)
    ring.close()
    th.join()
    assert seen == [1] and ring._inflight == {} and ring._ring is None and ring._fds == [] and ring._efd == -1


@needs_uring
def test_a_zero_byte_range_comes_back_empty_as_with_pread(tmp_path):
    p, data = _file(tmp_path, 8192)
    with uring.UringRing([(str(p), [0, 100, 4096], [100, 0, 4096])], _slots(2), 2) as ring:
        got = {}
        for piece in ring:
            got[piece.range_index] = bytes(piece.data.numpy())
            ring.recycle(piece.slot)
    assert got == {0: data[:100], 1: b"", 2: data[4096:]}


@needs_uring
def test_a_short_file_read_in_parts_names_where_it_ended(tmp_path):
    p, _ = _file(tmp_path, 10_500)
    with pytest.raises(EOFError, match=f"{p} ended at byte 10500, 1788 bytes short of the range \\[0, 12288\\)"):
        with uring.UringRing([(str(p), [0], [12288])], _slots(1, 12288), 4, 1000) as ring:
            list(ring)
    assert ring._inflight == {} and ring._fds == []


@needs_uring
def test_a_consumer_keeping_every_slot_gets_an_error_not_a_hang(tmp_path):
    p, data = _file(tmp_path, 3 * 4096)
    with pytest.raises(RuntimeError, match="every slot is still held by the consumer; give each piece back"):
        with uring.UringRing([(str(p), *_ranges(len(data), 4096))], _slots(2), 2) as ring:
            list(ring)  # never recycles


# --- registered slots (READV_FIXED, FASTLOAD_URING_FIXED=1) ------------------------------------------------------
def _kernel_has_readv_fixed():
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (major, minor) >= (6, 15)  # IORING_OP_READV_FIXED came with Linux 6.15


@needs_uring
@pytest.mark.skipif(not _kernel_has_readv_fixed(), reason=f"kernel {os.uname().release} has no READV_FIXED")
def test_the_slots_are_registered_and_read_as_fixed_buffers(tmp_path, monkeypatch):
    import liburing

    monkeypatch.setattr(uring, "FIXED_BUFFERS", True)
    p, data = _file(tmp_path, 40_000)
    calls = []
    real = liburing.io_uring_prep_readv_fixed
    monkeypatch.setattr(liburing, "io_uring_prep_readv_fixed", lambda *a: calls.append(a[3]) or real(*a))
    with uring.UringRing([(str(p), *_ranges(len(data), 4096))], _slots(3), 3, 1000) as ring:
        got = [(piece.range_index, bytes(piece.data.numpy())) for piece in ring if ring.recycle(piece.slot) is None]
        assert ring.fixed
    assert sorted(got) == [(r, data[r * 4096:(r + 1) * 4096]) for r in range(10)]
    parts = sum(-(-n // 1000) for n in _ranges(len(data), 4096)[1])  # 49: nine ranges of five, one of four
    assert len(calls) == parts and set(calls) == {0, 1, 2}  # every request into its slot's registered buffer


@needs_uring
def test_a_kernel_without_readv_fixed_gets_plain_reads_of_the_same_bytes(tmp_path, monkeypatch):
    """What a kernel before 6.15 answers to READV_FIXED (EINVAL), made here by a plain readv at an offset no file
    has: the request goes again as readv, and so does every later one."""
    import liburing

    monkeypatch.setattr(uring, "FIXED_BUFFERS", True)
    p, data = _file(tmp_path, 40_000)
    refused = []
    real = liburing.io_uring_prep_readv

    def einval(sqe, fd, iov, index, offset):
        refused.append(offset)
        real(sqe, fd, iov, 2**64 - 2)  # a negative file position: EINVAL

    monkeypatch.setattr(liburing, "io_uring_prep_readv_fixed", einval)
    with uring.UringRing([(str(p), *_ranges(len(data), 4096))], _slots(2), 2) as ring:
        ring.start()
        assert ring.fixed
        got = [(piece.range_index, bytes(piece.data.numpy())) for piece in ring if ring.recycle(piece.slot) is None]
        assert not ring.fixed
    assert sorted(got) == [(r, data[r * 4096:(r + 1) * 4096]) for r in range(10)]
    assert 1 <= len(refused) <= 2  # the requests in flight when the first EINVAL came back, no later one


@needs_uring
def test_registering_refused_reads_with_plain_readv(tmp_path, monkeypatch):
    import errno

    import liburing

    def refuse(ring, iovecs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")  # RLIMIT_MEMLOCK too small

    monkeypatch.setattr(uring, "FIXED_BUFFERS", True)
    monkeypatch.setattr(liburing, "io_uring_register_buffers", refuse)
    p, data = _file(tmp_path, 20_000)
    with uring.UringRing([(str(p), *_ranges(len(data), 4096))], _slots(2), 2) as ring:
        got = [(piece.range_index, bytes(piece.data.numpy())) for piece in ring if ring.recycle(piece.slot) is None]
        assert not ring.fixed
    assert sorted(got) == [(r, data[r * 4096:(r + 1) * 4096]) for r in range(5)]


@needs_uring
def test_a_real_einval_of_a_plain_read_is_still_an_error(tmp_path, monkeypatch):
    """The retry as readv happens once per request: a readv that fails with EINVAL too is raised, naming the
    file."""
    import liburing

    monkeypatch.setattr(uring, "FIXED_BUFFERS", False)
    real = liburing.io_uring_prep_readv
    monkeypatch.setattr(liburing, "io_uring_prep_readv", lambda sqe, fd, iov, off: real(sqe, fd, iov, 2**64 - 2))
    p, _ = _file(tmp_path, 8192)
    with pytest.raises(OSError, match=f"Invalid argument: reading 4096 bytes at byte 0 of {p}"):
        with uring.UringRing([(str(p), [0, 4096], [4096, 4096])], _slots(1), 1) as ring:
            list(ring)


@needs_uring
def test_an_io_wq_worker_limit_holds_while_the_ring_reads_and_the_old_one_comes_back(tmp_path, monkeypatch):
    """``FASTLOAD_URING_IOWQ_WORKERS``: the thread's io-wq takes at most that many bounded workers while the ring
    reads (asked back from the kernel), the bytes are the file's, and closing puts the thread's old limit back."""
    import liburing

    p, data = _file(tmp_path, 40_000)
    probe = liburing.Ring()
    liburing.io_uring_queue_init(4, probe)
    try:
        with uring.UringRing([(str(p), *_ranges(len(data), 4096))], _slots(1), 1) as warm:
            list(warm.recycle(piece.slot) for piece in warm)  # the thread's io-wq exists: its limit is known
        before = uring.iowq_max_workers(probe.ring_fd, 0)
        assert before[0] > 1
        monkeypatch.setattr(uring, "IOWQ_WORKERS", 1)
        seen = []
        with uring.UringRing([(str(p), *_ranges(len(data), 4096))], _slots(3), 3) as ring:
            for piece in ring:
                seen.append((piece.range_index, bytes(piece.data.numpy())))
                assert uring.iowq_max_workers(probe.ring_fd, 0)[0] == 1
                ring.recycle(piece.slot)
            assert ring.iowq_workers == 1
        assert sorted(seen) == [(r, data[r * 4096:(r + 1) * 4096]) for r in range(10)]
        assert uring.iowq_max_workers(probe.ring_fd, 0) == before
    finally:
        liburing.io_uring_queue_exit(probe)


@needs_uring
def test_without_the_variable_a_ring_leaves_the_worker_limit_alone(tmp_path, monkeypatch):
    import liburing

    monkeypatch.setattr(uring, "IOWQ_WORKERS", 0)
    p, data = _file(tmp_path, 8192)
    probe = liburing.Ring()
    liburing.io_uring_queue_init(4, probe)
    try:
        with uring.UringRing([(str(p), *_ranges(len(data), 4096))], _slots(1), 1) as warm:
            list(warm.recycle(piece.slot) for piece in warm)
        before = uring.iowq_max_workers(probe.ring_fd, 0)
        with uring.UringRing([(str(p), *_ranges(len(data), 4096))], _slots(2), 2) as ring:
            for piece in ring:
                assert uring.iowq_max_workers(probe.ring_fd, 0) == before
                ring.recycle(piece.slot)
        assert ring.iowq_workers is None
    finally:
        liburing.io_uring_queue_exit(probe)


@pytest.fixture
def own_cpus():
    """The test thread's CPUs before, put back after the test: a ring that failed to unpin it must not leave the
    tests after it on one CPU (where they would skip)."""
    before = os.sched_getaffinity(0)
    yield before
    os.sched_setaffinity(0, before)


@pytest.fixture
def pinning(own_cpus, monkeypatch):
    """The test thread's CPUs (given back after the test), the pin forced on; skips on a thread of one CPU."""
    if len(own_cpus) < 2:
        pytest.skip("one CPU: nothing to keep the workers off")
    monkeypatch.setattr(uring, "IOWQ_AFFINITY", True)
    return own_cpus


@needs_uring
def test_io_wq_affinity_keeps_the_workers_off_the_loading_threads_cpu_while_it_reads(tmp_path, pinning):
    """``FASTLOAD_URING_IOWQ_AFF``: while the ring reads, the thread that started it runs on one CPU (one it had)
    and its io-wq workers on the others, also the one the kernel started before the ring (it keeps the CPUs
    it had unless moved); the bytes are the file's; closing gives the thread and the workers their CPUs back."""
    before = pinning
    p, data = _file(tmp_path, 400_000)
    seen, masks, workers = [], set(), {}
    with uring.UringRing([(str(p), *_ranges(len(data), 4096))], _slots(8), 8) as ring:
        for piece in ring:
            seen.append((piece.range_index, bytes(piece.data.numpy())))
            masks.add(frozenset(os.sched_getaffinity(0)))
            workers.update(uring.io_workers(threading.get_native_id()))
            ring.recycle(piece.slot)
        cpu = ring.loader_cpu
        assert cpu in before
    assert masks == {frozenset({cpu})}
    assert workers and all(cpus == before - {cpu} for cpus in workers.values()), workers
    assert sorted(seen) == [(r, data[r * 4096:(r + 1) * 4096]) for r in range(len(seen))] and len(seen) == 98
    assert os.sched_getaffinity(0) == before
    # the workers that stay (the thread's first one does) may run anywhere again
    assert all(cpus == before for cpus in uring.io_workers(threading.get_native_id()).values())


@needs_uring
def test_io_wq_affinity_on_one_cpu_pins_nothing(tmp_path, monkeypatch):
    before = os.sched_getaffinity(0)
    monkeypatch.setattr(uring, "IOWQ_AFFINITY", True)
    p, data = _file(tmp_path, 20_000)
    os.sched_setaffinity(0, {min(before)})
    try:
        with uring.UringRing([(str(p), *_ranges(len(data), 4096))], _slots(2), 2) as ring:
            got = {}
            for piece in ring:
                got[piece.range_index] = bytes(piece.data.numpy())
                assert os.sched_getaffinity(0) == {min(before)}
                ring.recycle(piece.slot)
        assert ring.loader_cpu is None
        assert [got[r] for r in range(5)] == [data[r * 4096:(r + 1) * 4096] for r in range(5)]
        assert os.sched_getaffinity(0) == {min(before)}
    finally:
        os.sched_setaffinity(0, before)


@needs_uring
def test_io_wq_affinity_register_and_back_and_a_bad_ring(tmp_path):
    import liburing

    ring = liburing.Ring()
    liburing.io_uring_queue_init(4, ring)
    try:
        uring.iowq_affinity(ring.ring_fd, {min(os.sched_getaffinity(0))})
        uring.iowq_affinity(ring.ring_fd, None)
    finally:
        liburing.io_uring_queue_exit(ring)
    with pytest.raises(OSError, match="REGISTER_IOWQ_AFF"):
        uring.iowq_affinity(-1, {0})
    # the variable: "1" on, "0" off, else (unset) as the CPU count says
    assert uring.IOWQ_AFFINITY == {"1": True, "0": False}.get(os.environ.get("FASTLOAD_URING_IOWQ_AFF", ""))


@needs_uring
def test_io_wq_affinity_closed_from_another_thread_gives_the_loading_thread_its_cpus_back(tmp_path, pinning):
    """A close from another thread (a generator finalized there) gives the pinned thread its CPUs back by its id and
    leaves the closing thread's own mask alone; the pinned thread's io-wq mask, which only that thread can reset
    (the kernel applies it to the caller's io-wq), is reset when it starts its next ring."""
    before = pinning
    p, data = _file(tmp_path, 40_000)
    ring = uring.UringRing([(str(p), *_ranges(len(data), 4096))], _slots(2), 2)
    started, closed, seen = threading.Event(), threading.Event(), {}

    def loader():
        it = iter(ring)
        piece = next(it)
        seen["data"], seen["tid"] = bytes(piece.data.numpy()), threading.get_native_id()
        started.set()
        closed.wait(30)
        seen["after"] = os.sched_getaffinity(0)
        seen["stale"] = seen["tid"] in uring._STALE_IOWQ
        with uring.UringRing([(str(p), [0], [4096])], _slots(1), 1, pin=False) as again:
            seen["again"] = [bytes(x.data.numpy()) for x in again]
        seen["stale_after"] = seen["tid"] in uring._STALE_IOWQ

    t = threading.Thread(target=loader)
    t.start()
    try:
        assert started.wait(30)
        assert ring.loader_cpu in before and os.sched_getaffinity(0) == before
        os.sched_setaffinity(0, {min(before)})  # the closing thread on other CPUs than the loading thread had
        ring.close()
        assert os.sched_getaffinity(0) == {min(before)}  # the closing thread's own mask untouched
        assert all(cpus == before for cpus in uring.io_workers(seen["tid"]).values())
    finally:
        os.sched_setaffinity(0, before)
        closed.set()
        t.join(30)
        ring.close()
    assert seen["after"] == before  # given back by id from the closing thread
    assert seen["stale"] and not seen["stale_after"] and seen["again"] == [data[:4096]]
    assert seen["data"] in [data[o:o + 4096] for o in range(0, len(data), 4096)]


@needs_uring
@pytest.mark.usefixtures("own_cpus")
@pytest.mark.parametrize("issue_thread", [False, True], ids=["consumer", "issue-thread"])
@pytest.mark.parametrize("on", [False, True], ids=["unset", "aff"])
def test_a_direct_load_reports_the_loader_cpu(tmp_path, fake_cuda, monkeypatch, issue_thread, on):  # noqa: F811
    """The load report's ``uring_loader_cpu``: the CPU the thread that reads (the consumer's, or the issue thread's)
    ran on; the consumer's thread keeps its CPUs when the issue thread reads, and has them back after the load."""
    before = os.sched_getaffinity(0)
    if on and len(before) < 2:
        pytest.skip("one CPU: nothing to keep the workers off")
    monkeypatch.setattr(uring, "IOWQ_AFFINITY", on)
    expected = write_zoo(tmp_path / "model.safetensors")
    headers = [read_header(str(tmp_path / "model.safetensors"))]
    stats, masks = {}, set()
    arena = torch.empty(direct.arena_bytes(4096, 3), dtype=torch.uint8)
    ring = direct.Ring(4096, 3, 3, issue_thread=issue_thread, uring=True)
    got = {}
    for n, t in direct.stream_to_device(headers, torch.device("cpu"), ring, StageTimes(), arena, stats):
        got[n] = t.clone()
        masks.add(frozenset(os.sched_getaffinity(0)))
    assert_zoo_bit_exact(got, expected)
    if on:
        assert stats["uring_loader_cpu"] in before
        pinned = frozenset({stats["uring_loader_cpu"]})
        if issue_thread:
            assert masks == {frozenset(before)}
        else:  # the consumer reads: on the one CPU while the reader is open (the last tensors come after its close)
            assert pinned in masks and masks <= {pinned, frozenset(before)}
    else:
        assert "uring_loader_cpu" not in stats and masks == {frozenset(before)}
    assert os.sched_getaffinity(0) == before


@needs_uring
@pytest.mark.usefixtures("own_cpus")
@pytest.mark.parametrize("fewest, pins", [(2, True), (3, False)])
def test_unset_the_thread_is_pinned_where_it_has_enough_cpus(tmp_path, monkeypatch, fewest, pins):
    """``FASTLOAD_URING_IOWQ_AFF`` unset: a thread with at least :data:`AFFINITY_MIN_CPUS` CPUs is pinned (to the CPU
    it ran on), one with fewer is left alone; set to 0, never."""
    before = os.sched_getaffinity(0)
    if len(before) != 2:
        pytest.skip("the thresholds below are for a thread of two CPUs")
    monkeypatch.setattr(uring, "IOWQ_AFFINITY", None)
    monkeypatch.setattr(uring, "AFFINITY_MIN_CPUS", fewest)
    p, data = _file(tmp_path, 20_000)
    with uring.UringRing([(str(p), *_ranges(len(data), 4096))], _slots(2), 2) as ring:
        for piece in ring:
            assert bytes(piece.data.numpy()) == data[piece.range_index * 4096:(piece.range_index + 1) * 4096]
            assert os.sched_getaffinity(0) == ({ring.loader_cpu} if pins else before)
            ring.recycle(piece.slot)
    assert (ring.loader_cpu in before) if pins else ring.loader_cpu is None
    monkeypatch.setattr(uring, "IOWQ_AFFINITY", False)
    with uring.UringRing([(str(p), *_ranges(len(data), 4096))], _slots(2), 2) as ring:
        list(ring.recycle(piece.slot) for piece in ring)
    assert ring.loader_cpu is None


@needs_uring
def test_a_thread_started_while_pinned_gets_its_cpus_back_and_the_pin_is_where_it_ran(tmp_path, monkeypatch,
                                                                                       pinning):
    """A new thread inherits its creator's CPUs: one the loading thread starts during the load (a pool first used
    then) would stay on the pinned CPU; closing the ring gives it the loading thread's CPUs. The CPU pinned to is
    the one the thread ran on (``current_cpu``)."""
    before = pinning
    cpu = min(before)
    os.sched_setaffinity(0, {cpu})
    assert uring.current_cpu() == cpu
    os.sched_setaffinity(0, before)
    monkeypatch.setattr(uring, "current_cpu", lambda: cpu)
    p, data = _file(tmp_path, 40_000)
    go, masks = threading.Event(), {}
    child = None

    def pool_thread():
        masks["started"] = os.sched_getaffinity(0)
        go.wait(30)
        masks["after"] = os.sched_getaffinity(0)

    with uring.UringRing([(str(p), *_ranges(len(data), 4096))], _slots(2), 2) as ring:
        for piece in ring:
            if child is None:
                child = threading.Thread(target=pool_thread)
                child.start()
            ring.recycle(piece.slot)
    go.set()
    child.join(30)
    assert ring.loader_cpu == cpu and masks["started"] == {cpu}
    assert masks["after"] == before and os.sched_getaffinity(0) == before


@needs_uring
def test_no_pin_when_the_ring_may_not_or_the_cpu_is_unknown(tmp_path, monkeypatch, pinning):
    """``pin=False`` (the availability probe, a fan-out's reading thread) and a CPU that cannot be read both leave
    the thread as it is: a fixed fallback CPU would put the loading threads of a host's engines on one CPU."""
    before = pinning
    p, data = _file(tmp_path, 20_000)
    for kw, cpu in (({"pin": False}, uring.current_cpu), ({}, lambda: None)):
        monkeypatch.setattr(uring, "current_cpu", cpu)
        with uring.UringRing([(str(p), *_ranges(len(data), 4096))], _slots(2), 2, **kw) as ring:
            for piece in ring:
                assert os.sched_getaffinity(0) == before
                ring.recycle(piece.slot)
        assert ring.loader_cpu is None
    from vllm_fastload.streaming.direct import Ring

    assert Ring(4096, 2).pin  # a ring pins unless told not to (test_fanout checks the fan-out's ring does not)


@needs_uring
def test_an_interrupt_while_closing_still_gives_the_cpus_back(tmp_path, monkeypatch, pinning):
    before = pinning
    p, data = _file(tmp_path, 400_000)
    ring = uring.UringRing([(str(p), *_ranges(len(data), 4096))], _slots(8), 8)
    it = iter(ring)
    next(it)
    assert os.sched_getaffinity(0) == {ring.loader_cpu}
    monkeypatch.setattr(ring, "_flush", lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        ring.close()
    assert os.sched_getaffinity(0) == before
    monkeypatch.undo()
    ring.close()  # the ring itself still closes afterwards


def test_io_workers_inside_a_pid_namespace_are_found_by_their_foreign_number(monkeypatch):
    """The kernel names a worker after its owner's id in the initial pid namespace: in a container none matches the
    thread's own id, and the workers are then the ``iou-wrk-*`` tasks whose number is no task id here."""
    import builtins
    import io

    comms = {"1": "python", "7": "iou-wrk-3544", "8": "iou-wrk-3544", "9": "iou-wrk-1"}
    real_open = builtins.open
    monkeypatch.setattr(os, "listdir", lambda path: list(comms) if path == "/proc/self/task" else [])
    monkeypatch.setattr(os, "sched_getaffinity", lambda t: {0, 1})
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: io.StringIO(comms[path.split("/")[4]] + "\n")
                        if str(path).startswith("/proc/self/task/") else real_open(path, *a, **k))
    assert uring.io_workers(1) == {9: {0, 1}}  # its own by name where one matches
    assert uring.io_workers(2) == {7: {0, 1}, 8: {0, 1}}  # else the workers named by a number foreign here
