"""``prefetch``: the load's stream started before vLLM builds the model (streaming/prefetch.py and the loader)."""

import json
import sys
import threading
import time
import types

import pytest
import torch

from vllm_fastload.streaming import prefetch
from vllm_fastload.streaming.prefetch import Prefetch, gpu_budget

GiB = 2**30


def wait_until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def produced(n, size=1024, log=None, fail_after=None):
    """A stream of ``n`` uint8 tensors of ``size`` bytes, tensor i filled with i; ``log`` gets what happened in
    which thread."""

    def gen():
        try:
            for i in range(n):
                if fail_after is not None and i == fail_after:
                    raise ValueError(f"shard cut short at tensor {i}")
                if log is not None:
                    log.append(("yield", i, threading.current_thread().name))
                yield f"t{i}", torch.full((size,), i % 256, dtype=torch.uint8)
        finally:
            if log is not None:
                log.append(("closed", threading.current_thread().name))

    return gen


def test_every_tensor_in_order_and_what_was_read_before_the_take():
    p = Prefetch(produced(20), budget_bytes=1 << 20)
    try:
        wait_until(lambda: p._produced == 20 * 1024)
        got = list(p)
    finally:
        p.close()
    assert [n for n, _ in got] == [f"t{i}" for i in range(20)]
    assert all(t.eq(i).all() for i, (_, t) in enumerate(got))
    assert p.bytes_before_take == 20 * 1024 and p.taken_at >= p.started


def test_the_thread_holds_at_most_the_budget_then_waits_for_the_consumer():
    log = []
    p = Prefetch(produced(10, log=log), budget_bytes=3 * 1024)
    try:
        wait_until(lambda: len(log) >= 4)  # the 4th tensor was made and waits for room
        time.sleep(0.2)
        assert p._produced == 3 * 1024 and p._held == 3 * 1024 and len(log) == 4
        it = iter(p)
        assert next(it)[0] == "t0"
        wait_until(lambda: p._produced == 4 * 1024)  # one taken: room for one more
        assert [n for n, _ in it] == [f"t{i}" for i in range(1, 10)]
    finally:
        p.close()
    assert p.bytes_before_take == 3 * 1024


def test_a_tensor_larger_than_the_budget_still_goes_through():
    p = Prefetch(produced(3, size=4096), budget_bytes=100)
    try:
        assert [n for n, _ in p] == ["t0", "t1", "t2"]
    finally:
        p.close()


def test_the_stream_error_is_raised_to_the_consumer_after_what_came_before():
    p = Prefetch(produced(5, fail_after=2), budget_bytes=1 << 20)
    names = []
    try:
        with pytest.raises(ValueError, match="shard cut short at tensor 2"):
            for name, _ in p:
                names.append(name)
    finally:
        p.close()
    assert names == ["t0", "t1"]


def test_close_before_the_take_stops_the_stream_in_its_own_thread():
    log = []
    p = Prefetch(produced(100, log=log), budget_bytes=2 * 1024, name="fastload-prefetch-test")
    wait_until(lambda: len(log) >= 3)
    p.close()
    assert not p._thread.is_alive()
    # the stream was closed (its reader stopped) by the thread that ran it, not left for the garbage collector
    assert log[-1] == ("closed", "fastload-prefetch-test") and len(log) < 100
    assert p._ready.empty()  # tensors the consumer never took are not kept
    p.close()  # idempotent


def held_until(release):
    """A stream of one tensor that ends only once ``release`` is set."""

    def gen():
        yield "t0", torch.zeros(4, dtype=torch.uint8)
        release.wait(10)

    return gen


def test_the_switch_interval_is_lowered_while_a_prefetch_runs(monkeypatch):
    monkeypatch.setattr(prefetch, "SWITCH_S", 0.0002)
    before = sys.getswitchinterval()
    ra, rb = threading.Event(), threading.Event()
    a = Prefetch(held_until(ra), budget_bytes=1024)
    b = Prefetch(held_until(rb), budget_bytes=1024)
    try:
        assert sys.getswitchinterval() == pytest.approx(0.0002)
        ra.set()
        a.close()
        assert sys.getswitchinterval() == pytest.approx(0.0002)  # b still runs
    finally:
        ra.set()
        rb.set()
        a.close()
        b.close()
    assert sys.getswitchinterval() == before


def test_a_switch_interval_set_meanwhile_by_someone_else_stays(monkeypatch):
    monkeypatch.setattr(prefetch, "SWITCH_S", 0.0002)
    before = sys.getswitchinterval()
    release = threading.Event()
    p = Prefetch(held_until(release), budget_bytes=1024)
    try:
        sys.setswitchinterval(0.02)
        release.set()
        p.close()
        assert sys.getswitchinterval() == pytest.approx(0.02)
    finally:
        release.set()
        p.close()
        sys.setswitchinterval(before)


def test_an_interrupted_close_can_be_repeated_and_the_interval_comes_back_with_the_thread(monkeypatch):
    monkeypatch.setattr(prefetch, "SWITCH_S", 0.0002)
    before = sys.getswitchinterval()
    release = threading.Event()
    p = Prefetch(held_until(release), budget_bytes=1024)
    join = p._thread.join
    monkeypatch.setattr(p._thread, "join", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        p.close()  # a second Ctrl-C while close() waits
    assert p._thread.is_alive() and not p._closed
    monkeypatch.setattr(p._thread, "join", join)
    release.set()
    p.close()
    assert not p._thread.is_alive() and sys.getswitchinterval() == before


def test_a_closed_prefetch_cannot_be_iterated():
    p = Prefetch(produced(3), budget_bytes=1 << 20)
    p.close()
    with pytest.raises(RuntimeError, match="before it is closed"):
        next(iter(p))


def test_gpu_budget_is_what_is_left_of_the_engines_share():
    # an H100 alone: 90% of 80 GiB, 16 GiB of weights -> the whole checkpoint may be held
    assert gpu_budget(79 * GiB, 80 * GiB, 0.9, 16 * GiB) == 16 * GiB
    # another process holds 40 GiB: what is left of the 72 GiB share is 32 - 16 - 2
    assert gpu_budget(40 * GiB, 80 * GiB, 0.9, 16 * GiB) == 14 * GiB
    # no room beside the weights
    assert gpu_budget(20 * GiB, 80 * GiB, 0.9, 16 * GiB) == 0
    # the largest tensor (held beyond the budget) comes off too
    assert gpu_budget(40 * GiB, 80 * GiB, 0.9, 16 * GiB, largest=GiB) == 13 * GiB
    # a 24 GiB share of which 1 GiB is in use: 23 - 16 - 2
    assert gpu_budget(79 * GiB, 80 * GiB, 0.3, 16 * GiB) == 5 * GiB
    with pytest.raises(ValueError, match="budget_bytes"):
        Prefetch(produced(1), budget_bytes=-1)


def test_host_budget_stays_within_a_containers_limit():
    # a host with 256 GiB available: a quarter of what is left after 16 GiB of weights, at most the weights
    assert prefetch.host_budget(256 * GiB, None, None, 16 * GiB) == 16 * GiB
    # the same in a pod limited to 28 GiB of which 2 GiB are used: (26 - 16 - 1) / 4
    assert prefetch.host_budget(256 * GiB, 28 * GiB, 2 * GiB, 16 * GiB, largest=GiB) == 9 * GiB // 4
    assert prefetch.host_budget(256 * GiB, 16 * GiB, 2 * GiB, 16 * GiB) == 0


# --- the loader ------------------------------------------------------------------------------------------------
pytest.importorskip("vllm")

from vllm.config.load import LoadConfig  # noqa: E402
from vllm.model_executor.model_loader.base_loader import BaseModelLoader  # noqa: E402

from tests.conftest import fake_model_config, log_records, write_safetensors  # noqa: E402
from tests.unit.test_loader_inprocess import Sink, tensors  # noqa: E402
from vllm_fastload.streaming.loader import RunaiStreamerLoader  # noqa: E402


def fake_vllm_config(world_size=1, device="cpu"):
    return types.SimpleNamespace(parallel_config=types.SimpleNamespace(world_size=world_size),
                                 load_config=types.SimpleNamespace(device=None),
                                 device_config=types.SimpleNamespace(device=device),
                                 cache_config=types.SimpleNamespace(gpu_memory_utilization=0.9))


@pytest.fixture
def ckpt(tmp_path):
    ts = tensors()
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {k: ts[k] for k in ("a.weight", "a.bias")})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {k: ts[k] for k in ("mask", "ids", "b.weight")})
    return tmp_path, ts


def building(monkeypatch, seen, fail=False):
    """vLLM's ``load_model`` stand-in: builds the model, noting whether the prefetch read everything meanwhile,
    then calls ``load_weights`` as vLLM does."""

    def load_model(self, vllm_config, model_config):
        pre = self._prefetched
        seen["prefetch"] = pre
        if pre is not None:  # construction takes a while: the stream reads meanwhile
            wait_until(lambda: pre.prefetch._produced == sum(v.numel() * v.element_size() for v in tensors().values()))
        if fail:
            raise RuntimeError("CUDA out of memory while building the model")
        ts = tensors()
        sink = Sink({k: (v.shape, v.dtype) for k, v in ts.items()})
        self.load_weights(sink, model_config)
        return sink

    monkeypatch.setattr(BaseModelLoader, "load_model", load_model)


def loader_with(tmp_path, **extra):
    return RunaiStreamerLoader(LoadConfig(load_format="runai_streamer", model_loader_extra_config={
        "report_path": str(tmp_path / "r.json"), **extra}))


def assert_received(sink, ts):
    """``sink`` received every tensor of ``ts`` (name -> tensor) with its dtype, its shape and its bytes."""
    assert set(sink.seen) == set(ts)
    for k, v in ts.items():
        assert sink.seen[k].dtype == v.dtype and sink.seen[k].shape == v.shape
        assert torch.equal(sink.seen[k].view(torch.uint8), v.view(torch.uint8)) if v.numel() else True


def test_weights_read_while_the_model_is_built_load_bit_exact(ckpt, monkeypatch):
    path, ts = ckpt
    seen = {}
    building(monkeypatch, seen)
    loader = loader_with(path, prefetch=True)
    with log_records() as logs:
        sink = loader.load_model(fake_vllm_config(), fake_model_config(path))
    assert seen["prefetch"] is not None and set(sink.seen) == set(ts)
    assert_received(sink, ts)
    total = sum(v.numel() * v.element_size() for v in ts.values())
    r = json.loads((path / "r.json").read_text())
    ex = r["extra"]
    assert r["tensors"] == 5 and r["bytes"] == total and r["fallback_reason"] is None
    assert ex["prefetched_bytes"] == total and ex["prefetch_budget_bytes"] >= total and ex["prefetch_s"] > 0
    # wall_s spans the stream from its start, as its marks do; the weights phase is load_weights' own share
    assert 0 < r["weights_phase_s"] < r["wall_s"] and ex["prefetch_s"] < r["wall_s"]
    assert 0 < ex["prepare_s"] <= ex["first_tensor_s"] <= ex["last_tensor_s"] <= r["wall_s"]
    assert "MainThread" in ex["other_threads"]  # the stream ran beside vLLM's thread, not in it
    assert f"{total / 2**30:.2f} GiB of it read beside model construction" in r["line"]
    assert f"weights phase {r['weights_phase_s']:.3f} s" in r["line"]
    assert any(r["line"] in m.getMessage() for m in logs)
    assert not any(t.name == "fastload-prefetch" for t in threading.enumerate())
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_weights_read_from_object_storage_while_the_model_is_built_load_bit_exact(ckpt, monkeypatch, moto_s3):
    """The same from ``s3://`` (a moto S3 on 127.0.0.1): runai reads the bucket on the prefetch thread with the
    environment the load set on vLLM's thread, every byte of every tensor arrives, all of it before
    ``load_weights``."""
    pytest.importorskip("moto")
    path, ts = ckpt
    for k, v in moto_s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RUNAI_STREAMER_S3_ENDPOINT", moto_s3.endpoint)
    uri = moto_s3.upload_dir(path, "prefetch", "m")
    seen = {}
    building(monkeypatch, seen)
    sink = loader_with(path, prefetch=True).load_model(fake_vllm_config(), fake_model_config(uri))
    assert seen["prefetch"] is not None and set(sink.seen) == set(ts)
    assert_received(sink, ts)
    total = sum(v.numel() * v.element_size() for v in ts.values())
    r = json.loads((path / "r.json").read_text())
    assert r["source"] == uri and r["bytes"] == total and r["fallback_reason"] is None
    assert r["extra"]["prefetched_bytes"] == total


def test_the_zoo_read_while_the_model_is_built_loads_bit_exact(tmp_path, monkeypatch):
    """Every dtype, odd lengths, unaligned offsets and zero-element tensors (``write_zoo``) through the prefetch
    thread on CPU: bit for bit, all of it read before ``load_weights``."""
    from tests.conftest import assert_zoo_bit_exact, write_zoo

    expected = write_zoo(tmp_path / "model.safetensors")
    total = sum(len(raw) for _, _, raw in expected.values())
    seen = {}

    def load_model(self, vllm_config, model_config):
        seen["prefetch"] = pre = self._prefetched
        wait_until(lambda: pre.prefetch._produced == total)
        sink = Sink({k: (shape, dtype) for k, (dtype, shape, _) in expected.items()})
        self.load_weights(sink, model_config)
        return sink

    monkeypatch.setattr(BaseModelLoader, "load_model", load_model)
    sink = loader_with(tmp_path, prefetch=True).load_model(fake_vllm_config(), fake_model_config(tmp_path))
    assert seen["prefetch"] is not None
    assert_zoo_bit_exact(sink.seen, expected)
    assert json.loads((tmp_path / "r.json").read_text())["extra"]["prefetched_bytes"] == total


def test_without_prefetch_the_weights_are_read_in_load_weights(ckpt, monkeypatch):
    path, ts = ckpt
    seen = {}
    building(monkeypatch, seen)
    sink = loader_with(path).load_model(fake_vllm_config(), fake_model_config(path))
    assert seen["prefetch"] is None and set(sink.seen) == set(ts)
    ex = json.loads((path / "r.json").read_text())["extra"]
    assert "prefetched_bytes" not in ex and "MainThread" not in ex["other_threads"]


@pytest.mark.parametrize("why, extra, config", [
    ("2 ranks (TP x PP) share the model", {}, {"world_size": 2}),
    ("content_hash / expected_content_digest", {"content_hash": True}, {}),
])
def test_a_load_that_cannot_prefetch_says_why_and_reads_in_load_weights(ckpt, monkeypatch, why, extra, config):
    path, ts = ckpt
    seen = {}
    building(monkeypatch, seen)
    with log_records() as logs:
        sink = loader_with(path, prefetch=True, **extra).load_model(fake_vllm_config(**config), fake_model_config(path))
    assert seen["prefetch"] is None and set(sink.seen) == set(ts)
    msgs = [m.getMessage() for m in logs]
    assert any("prefetch off for this load" in m and why in m for m in msgs), msgs


def test_a_failure_while_the_model_is_built_stops_the_prefetch(ckpt, monkeypatch):
    path, _ = ckpt
    seen = {}
    building(monkeypatch, seen, fail=True)
    loader = loader_with(path, prefetch=True)
    with pytest.raises(RuntimeError, match="out of memory while building"):
        loader.load_model(fake_vllm_config(), fake_model_config(path))
    assert seen["prefetch"] is not None and not seen["prefetch"].prefetch._thread.is_alive()
    assert loader._prefetched is None and sys.getswitchinterval() == pytest.approx(0.005)
    assert not (path / "r.json").exists()  # no report for a load that did not happen


def test_a_bad_checkpoint_fails_before_the_model_is_built(ckpt, monkeypatch):
    path, _ = ckpt
    (path / "model-00002-of-00002.safetensors").write_bytes(b"\xff" * 16)
    seen = {}
    building(monkeypatch, seen)
    with pytest.raises(Exception, match="model-00002-of-00002.safetensors"):
        loader_with(path, prefetch=True).load_model(fake_vllm_config(), fake_model_config(path))
    assert "prefetch" not in seen  # vLLM's load_model (the model's construction) never ran


def test_no_room_for_a_prefetch_says_so_and_reads_the_headers_again_in_load_weights(ckpt, monkeypatch):
    path, ts = ckpt
    seen = {}
    building(monkeypatch, seen)
    monkeypatch.setattr(prefetch, "host_available", lambda: 0)
    with log_records() as logs:
        sink = loader_with(path, prefetch=True).load_model(fake_vllm_config(), fake_model_config(path))
    assert seen["prefetch"] is None and set(sink.seen) == set(ts)
    msgs = [m.getMessage() for m in logs]
    assert any("prefetch off for this load" in m and "host memory: 0.0 GiB available" in m and "no room beside" in m
               for m in msgs), msgs
    assert "prefetched_bytes" not in json.loads((path / "r.json").read_text())["extra"]


def test_a_vllm_config_without_a_device_turns_the_prefetch_off(ckpt, monkeypatch):
    path, ts = ckpt
    seen = {}
    building(monkeypatch, seen)
    cfg = fake_vllm_config()
    cfg.device_config = types.SimpleNamespace()
    with log_records() as logs:
        sink = loader_with(path, prefetch=True).load_model(cfg, fake_model_config(path))
    assert seen["prefetch"] is None and set(sink.seen) == set(ts)
    assert any("vllm_config names no device" in m.getMessage() for m in logs)


def test_the_prefetch_thread_changes_no_environment_beside_construction(ckpt, monkeypatch):
    """runai reads its settings from the environment; the stream's variables are set on vLLM's thread before the
    prefetch thread starts, so that thread's scoped_environ changes nothing while the model is built (glibc's
    setenv is not safe beside another thread's getenv), and they are put back after the load."""
    import collections.abc
    import os

    from vllm_fastload import storage

    path, ts = ckpt
    writes = []

    class Recording(collections.abc.MutableMapping):
        def __getitem__(self, k):
            return os.environ[k]

        def __setitem__(self, k, v):
            writes.append((threading.current_thread().name, k))
            os.environ[k] = v

        def __delitem__(self, k):
            writes.append((threading.current_thread().name, k))
            del os.environ[k]

        def __iter__(self):
            return iter(os.environ)

        def __len__(self):
            return len(os.environ)

    class Os:  # storage's os module, its environ recorded
        environ = Recording()

        def __getattr__(self, name):
            return getattr(os, name)

    monkeypatch.setattr(storage, "os", Os())
    monkeypatch.setenv("RUNAI_STREAMER_CONCURRENCY", "3")
    seen = {}
    building(monkeypatch, seen)
    during = {}
    inner = BaseModelLoader.load_model

    def load_model(self, vllm_config, model_config):
        during.update(os.environ)
        return inner(self, vllm_config, model_config)

    monkeypatch.setattr(BaseModelLoader, "load_model", load_model)
    sink = loader_with(path, prefetch=True, concurrency=5).load_model(fake_vllm_config(), fake_model_config(path))
    assert set(sink.seen) == set(ts)
    assert writes and all(name == "MainThread" for name, _ in writes), writes
    assert during["RUNAI_STREAMER_CONCURRENCY"] == "5"  # the load's own value, set before construction
    assert os.environ["RUNAI_STREAMER_CONCURRENCY"] == "3"  # and put back


def test_a_checkpoint_of_empty_tensors_is_not_prefetched_and_says_why(tmp_path, monkeypatch):
    write_safetensors(tmp_path / "model.safetensors", {"a": torch.empty(0), "b": torch.empty(0, 3)})
    seen = {}

    def load_model(self, vllm_config, model_config):
        seen["prefetch"] = self._prefetched
        return "built"

    monkeypatch.setattr(BaseModelLoader, "load_model", load_model)
    with log_records() as logs:
        assert loader_with(tmp_path, prefetch=True).load_model(fake_vllm_config(), fake_model_config(tmp_path)) \
            == "built"
    assert seen["prefetch"] is None
    assert any("the checkpoint holds no tensor bytes" in m.getMessage() for m in logs)
