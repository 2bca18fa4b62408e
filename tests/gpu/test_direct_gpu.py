"""The direct read path on a real GPU without vLLM: runai reads into registered huge-page memory (streaming.hostmem)
allocated on a thread, the GPU copies the pieces out; needs only torch with CUDA and runai-model-streamer."""

import gc

import pytest
import torch

from tests.gpu.conftest import NO_CUDA

if not torch.cuda.is_available():
    pytest.skip(NO_CUDA, allow_module_level=True)

pytest.importorskip("runai_model_streamer")

from tests.conftest import assert_zoo_bit_exact, write_zoo  # noqa: E402
from vllm_fastload.checkpoint import read_header  # noqa: E402
from vllm_fastload.streaming import direct  # noqa: E402
from vllm_fastload.streaming.hostmem import page_locked  # noqa: E402
from vllm_fastload.streaming.timing import StageTimes  # noqa: E402


@pytest.mark.parametrize("issue_thread", [False, True], ids=["consumer-issues", "issue-thread"])
@pytest.mark.parametrize("threads, uring", [(None, False), (4, False), (4, True)], ids=["runai", "pread", "uring"])
@pytest.mark.parametrize("piece", [4096, 5000, 2**20])
def test_zoo_bit_exact_through_a_registered_arena_made_on_a_thread(tmp_path, piece, threads, uring, issue_thread):
    from vllm_fastload.streaming.uring import unavailable

    if uring and unavailable():
        pytest.skip(f"no io_uring here: {unavailable()}")
    expected = write_zoo(tmp_path / "model.safetensors")
    future = direct.ArenaFuture(piece, 2, torch.cuda.current_device())
    arena, _ = future.result()
    assert arena.is_pinned() and arena.numel() == direct.arena_bytes(piece, 2)  # page-locked per the CUDA runtime
    times, stats, got = StageTimes(), {}, {}
    for name, t in direct.stream_to_device([read_header(str(tmp_path / "model.safetensors"))],
                                           torch.device("cuda", torch.cuda.current_device()),
                                           direct.Ring(piece, 2, threads, issue_thread, uring), times, arena,
                                           stats):
        got[name] = t
        torch.cuda._sleep(1000)  # a slow consumer: a slot must not be refilled before its copies finished
    arena = None
    torch.cuda.synchronize()
    assert_zoo_bit_exact(got, expected)
    assert stats["pinned_extra_bytes"] == 0


def test_page_locked_copies_asynchronously_and_unregisters(monkeypatch):
    from vllm_fastload.streaming import hostmem

    unregistered = []
    real = hostmem._unregister
    monkeypatch.setattr(hostmem, "_unregister",
                        lambda ptr, device, keep: unregistered.append((ptr, device)) or real(ptr, device, keep))
    t = page_locked(64 * 2**20)
    assert t.is_pinned()
    t.copy_(torch.arange(t.numel(), dtype=torch.int64).to(torch.uint8))
    d = torch.empty(t.numel(), dtype=torch.uint8, device="cuda")
    d.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(d.cpu(), t)
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert unregistered == [(ptr, torch.cuda.current_device())]


@pytest.mark.parametrize("path, in_pool", [("direct", True), ("direct-pread", True), ("direct-pread-issue", True),
                                           ("pipeline", True), ("pipeline-thread", True), ("direct", False)])
def test_inside_a_memory_pool_buffers_stay_out_of_it_and_are_reused(tmp_path, path, in_pool):
    """vLLM's sleep mode loads inside ``torch.cuda.use_mem_pool`` (its sleep allocator). Inside
    ``devmem.outside_pools`` (what the loader enters then) the streamer's buffers must not be cached in that pool
    (vLLM frees its empty segments behind PyTorch's counters and sizes the KV cache from them) and must be reused
    during the load: while a pool is in use PyTorch never frees a ``record_stream``-ed block, so 48 x 16 MiB would
    take 768 MiB at the peak (streaming/devmem.py). The consumer lags on the GPU (20 ms of sleep per tensor) as
    vLLM's weight loaders may; every tensor's bytes are checked. ``in_pool=False`` is the control: the default
    scheme inside a pool shows both faults, so the bounds below do discriminate."""
    from safetensors.torch import save_file

    from vllm_fastload.streaming import devmem
    from vllm_fastload.streaming.pipeline import H2DPipeline

    n, size = 48, 16 * 2**20
    path_st = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.full((size,), i % 251, dtype=torch.uint8) for i in range(n)}, str(path_st))
    dev = torch.device("cuda", torch.cuda.current_device())
    params = {f"t{i}": torch.empty(size, dtype=torch.uint8, device=dev) for i in range(n)}
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    pool = torch.cuda.MemPool()
    pipe = None
    with torch.cuda.use_mem_pool(pool), devmem.outside_pools(in_pool):
        if path.startswith("direct"):
            ring = direct.Ring(4 * 2**20, 4, 4 if path.startswith("direct-pread") else None, path.endswith("-issue"))
            it = direct.stream_to_device([read_header(str(path_st))], dev, ring, StageTimes())
        else:
            from safetensors import safe_open

            with safe_open(str(path_st), "pt") as f:
                host = [(k, f.get_tensor(k)) for k in f.keys()]
            pipe = H2DPipeline(dev, pinned_slot_bytes=4 * 2**20, pinned_slots=4,
                               pipeline_thread=path == "pipeline-thread")
            it = pipe.run(iter(host))
        for name, t in it:
            params[name].copy_(t)
            torch.cuda._sleep(40_000_000)  # ~20 ms at the H200's ~2 GHz: the consumer's stream falls behind
            del t
        if pipe is not None:
            pipe.close()
        torch.cuda.synchronize()
        left_in_pool = pool.snapshot()
    grew = torch.cuda.max_memory_reserved(dev) - before
    wrong = [i for i in range(n) if not bool((params[f"t{i}"] == i % 251).all())]
    assert wrong == [], f"tensors {wrong} hold other bytes"
    if not in_pool:  # the control
        assert left_in_pool and grew > 8 * size, (len(left_in_pool), grew)
        return
    assert left_in_pool == [], f"{len(left_in_pool)} segment(s) of the streamer's buffers left in the pool"
    assert grew <= 8 * size, f"device memory grew by {grew / 2**20:.0f} MiB for {n} x {size // 2**20} MiB tensors"


def test_the_h2d_timeline_times_every_copy_on_the_gpu(tmp_path, monkeypatch):
    """``FASTLOAD_H2D_TIMELINE``: real CUDA events, one row per copy, copies in stream order, and an account whose
    parts add up (streaming/timeline.py)."""
    import json

    out = tmp_path / "timeline.json"
    monkeypatch.setenv("FASTLOAD_H2D_TIMELINE", str(out))
    expected = write_zoo(tmp_path / "model.safetensors")
    header = read_header(str(tmp_path / "model.safetensors"))
    times, stats = StageTimes(), {}
    got = dict(direct.stream_to_device([header], torch.device("cuda", torch.cuda.current_device()),
                                       direct.Ring(4096, 2, 2), times, None, stats))
    torch.cuda.synchronize()
    assert_zoo_bit_exact(got, expected)
    doc = json.loads(out.read_text())
    rows, s = doc["copies"], doc["summary"]
    _, where, _ = direct.split_into_pieces([header], 4096)
    assert len(rows) == sum(len(places) for places in where) == s["copies"]
    assert sum(r[5] for r in rows) == times.bytes == s["bytes"]
    for prev, row in zip(rows, rows[1:]):
        assert row[3] >= prev[4] - 1e-6  # one stream: a copy starts after the one before it ended
    for ask, got_s, issued, start, end, _ in rows:
        assert 0 <= ask <= got_s <= issued and start < end
        assert start >= ask - 1e-3  # the GPU started it after the thread asked for its bytes (clocks tied)
    assert s["idle_s"] == pytest.approx(s["idle_read_s"] + s["idle_issue_s"] + s["idle_launch_s"], abs=1e-5)
    assert s["span_s"] >= s["copying_s"] + s["idle_s"] - 1e-5


@pytest.mark.parametrize("issue_thread", [False, True], ids=["consumer-issues", "issue-thread"])
@pytest.mark.parametrize("threads, uring", [(None, False), (3, False), (3, True)], ids=["runai", "pread", "uring"])
def test_zoo_bit_exact_with_copies_and_events_through_the_cuda_driver(tmp_path, monkeypatch, threads, uring,
                                                                      issue_thread):
    """``FASTLOAD_H2D_DRIVER`` on real CUDA (streaming/cudriver.py): the untimed copies go through
    ``cuMemcpyHtoDAsync`` and the slots come back with driver events; a slow consumer stream holds the copies back,
    so a slot read into again before its copy finished would show in the bytes."""
    from vllm_fastload.streaming import cudriver
    from vllm_fastload.streaming.uring import unavailable

    if uring and unavailable():
        pytest.skip(f"no io_uring here: {unavailable()}")
    monkeypatch.setattr(cudriver, "ENABLED", True)
    expected = write_zoo(tmp_path / "model.safetensors")
    times, got = StageTimes(), {}
    for name, t in direct.stream_to_device([read_header(str(tmp_path / "model.safetensors"))],
                                           torch.device("cuda", torch.cuda.current_device()),
                                           direct.Ring(4096, 3, threads, issue_thread, uring), times, None, {}):
        got[name] = t
        torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    assert_zoo_bit_exact(got, expected)
    assert times.driver_copies > 0  # the driver was found and used, not the PyTorch fallback
    assert times.h2d_s > 0  # the timed sample (PyTorch events) still measured


@pytest.mark.parametrize("uring", [False, True], ids=["pread", "uring"])
def test_zoo_bit_exact_with_an_event_every_third_copy(tmp_path, monkeypatch, uring):
    """``EVENT_EVERY`` on real CUDA: slots given back with a later copy's event are never read into before their
    own copy finished (a slow consumer stream holds the copies back)."""
    from vllm_fastload.streaming.uring import unavailable

    if uring and unavailable():
        pytest.skip(f"no io_uring here: {unavailable()}")
    monkeypatch.setattr(direct, "EVENT_EVERY", 3)
    expected = write_zoo(tmp_path / "model.safetensors")
    got = {}
    for name, t in direct.stream_to_device([read_header(str(tmp_path / "model.safetensors"))],
                                           torch.device("cuda", torch.cuda.current_device()),
                                           direct.Ring(4096, 3, 3, uring=uring), StageTimes(), None, {}):
        got[name] = t
        torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    assert_zoo_bit_exact(got, expected)


def test_zoo_bit_exact_with_io_wq_affinity(tmp_path, monkeypatch):
    """``FASTLOAD_URING_IOWQ_AFF`` on real CUDA: the loading thread runs on the CPU the report names while the
    reads go on, the bytes are the checkpoint's, and the thread's CPUs are its own again after the load."""
    import os

    from vllm_fastload.streaming import uring

    if uring.unavailable():
        pytest.skip(f"no io_uring here: {uring.unavailable()}")
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("one CPU: nothing to keep the io-wq workers off")
    monkeypatch.setattr(uring, "IOWQ_AFFINITY", True)
    expected = write_zoo(tmp_path / "model.safetensors")
    got, seen, stats = {}, set(), {}
    for name, t in direct.stream_to_device([read_header(str(tmp_path / "model.safetensors"))],
                                           torch.device("cuda", torch.cuda.current_device()),
                                           direct.Ring(4096, 3, 3, uring=True), StageTimes(), None, stats):
        got[name] = t
        seen.add(frozenset(os.sched_getaffinity(0)))
    torch.cuda.synchronize()
    assert_zoo_bit_exact(got, expected)
    cpu = stats["uring_loader_cpu"]
    # pinned while the reader was open (the last tensors may come after its close, on the thread's own CPUs again)
    assert cpu in before and frozenset({cpu}) in seen and seen <= {frozenset({cpu}), frozenset(before)}, seen
    assert os.sched_getaffinity(0) == before


@pytest.mark.parametrize("uring", [False, True], ids=["pread", "uring"])
def test_zoo_bit_exact_through_a_prefetch_thread_onto_the_consumers_stream(tmp_path, uring):
    """``prefetch`` on real CUDA: the direct stream runs on the prefetch thread (reads, H2D copies, the waits of the
    consumer's stream), started before the consumer asks; the consumer, on a stream of its own that is not the
    default one, reads every tensor slowly on that stream and gets the checkpoint's bytes."""
    from vllm_fastload.streaming.prefetch import Prefetch
    from vllm_fastload.streaming.uring import unavailable

    if uring and unavailable():
        pytest.skip(f"no io_uring here: {unavailable()}")
    expected = write_zoo(tmp_path / "model.safetensors")
    device = torch.device("cuda", torch.cuda.current_device())
    consumer = torch.cuda.Stream(device)
    headers = [read_header(str(tmp_path / "model.safetensors"))]
    got = {}
    with torch.cuda.stream(consumer):
        def setup():
            torch.cuda.set_device(device)
            torch.cuda.set_stream(consumer)

        p = Prefetch(lambda: direct.stream_to_device(headers, device, direct.Ring(4096, 3, 3, uring=uring),
                                                     StageTimes()), 1 << 20, setup)
        try:
            for name, t in p:
                torch.cuda._sleep(1000)  # queued before the read of the tensor, on the consumer's stream
                got[name] = t.clone()
        finally:
            p.close()
        consumer.synchronize()
    assert_zoo_bit_exact(got, expected)


def test_zoo_bit_exact_copied_out_of_the_registered_page_cache(tmp_path, monkeypatch):
    """``FASTLOAD_PAGECACHE_DMA``: the copies read the shards' page cache itself (each shard registered read-only,
    started before the load as the loader starts it beside model construction, and without); the bytes are the
    checkpoint's, and every registration is unregistered after the load."""
    import time

    from vllm_fastload.streaming import pagecache

    calls = {"reg": 0, "unreg": 0}
    real = pagecache.cuda_register

    def counted(device):
        reg, unreg = real(device)
        return (lambda p, n: calls.__setitem__("reg", calls["reg"] + 1) or reg(p, n),
                lambda p: calls.__setitem__("unreg", calls["unreg"] + 1) or unreg(p))

    monkeypatch.setattr(pagecache, "cuda_register", counted)
    expected = write_zoo(tmp_path / "model.safetensors")
    header = read_header(str(tmp_path / "model.safetensors"))
    for early in (False, True):
        if early:
            pagecache.start_early([header.path], torch.cuda.current_device())
        got, stats = {}, {}
        for name, t in direct.stream_to_device([header], torch.device("cuda", torch.cuda.current_device()),
                                               direct.Ring(4096, 2, 2, pagecache=True), StageTimes(), None, stats):
            got[name] = t
            torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        assert_zoo_bit_exact(got, expected)
        assert "pagecache_register_s" in stats and pagecache._EARLY == []
    for _ in range(100):  # unregistered on a thread of its own after the copies
        if calls["unreg"] == calls["reg"]:
            break
        time.sleep(0.05)
    assert calls["reg"] == 2 and calls["unreg"] == 2
