"""RunaiStreamerLoader.load_weights on a small torch module, without a vLLM server."""

import json
import types

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config.load import LoadConfig  # noqa: E402

from tests.conftest import demo_plus_overlay, fake_model_config, write_safetensors  # noqa: E402
from vllm_fastload.errors import CheckpointError, ConfigError, FallbackRefused  # noqa: E402
from vllm_fastload.streaming.loader import RunaiStreamerLoader  # noqa: E402


class Sink(torch.nn.Module):
    """Holds one parameter per expected name; load_weights copies like vLLM's default weight_loader."""

    def __init__(self, shapes: dict):
        super().__init__()
        self.params = torch.nn.ParameterDict(
            {k.replace(".", "_"): torch.nn.Parameter(torch.empty(s, dtype=d), requires_grad=False)
             for k, (s, d) in shapes.items()})
        self.seen = {}

    def load_weights(self, weights):
        loaded = set()
        for name, t in weights:
            self.seen[name] = t
            self.params[name.replace(".", "_")].data.copy_(t)
            loaded.add("params." + name.replace(".", "_"))
        return loaded


def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "a.bias": torch.randn(7, generator=g),
        "mask": torch.randint(0, 2, (5,), generator=g).bool(),
        "ids": torch.randint(-1000, 1000, (3, 3), generator=g),
        "b.weight": torch.randn(16, 16, generator=g).to(torch.float16),
    }


def run(path, extra=None, report=None):
    extra = dict(extra or {})
    if report:
        extra["report_path"] = str(report)
    loader = RunaiStreamerLoader(LoadConfig(load_format="runai_streamer", model_loader_extra_config=extra))
    ts = tensors()
    sink = Sink({k: (v.shape, v.dtype) for k, v in ts.items()})
    loader.load_weights(sink, fake_model_config(path))
    return sink, ts


def test_streams_every_tensor_bit_exact_and_reports(tmp_path):
    ts = tensors()
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {k: ts[k] for k in ("a.weight", "a.bias")})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {k: ts[k] for k in ("mask", "ids", "b.weight")})
    sink, ts = run(tmp_path, report=tmp_path / "r.json")
    assert set(sink.seen) == set(ts)
    for k, v in ts.items():
        got = sink.seen[k]
        assert got.dtype == v.dtype and got.shape == v.shape
        assert got.view(torch.uint8).tolist() == v.view(torch.uint8).tolist() if v.numel() else True
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["tensors"] == 5 and r["bytes"] == sum(v.numel() * v.element_size() for v in ts.values())
    assert r["fallback_reason"] is None and r["shards"] == 2 and len(r["fingerprint"]) == 12
    # the CPU path has no pinned slots, H2D copies or producer thread: none of those stages is reported
    assert not {"slot_wait_s", "h2d_s", "memcpy_s", "consumer_wait_s"} & set(r["extra"])
    assert r["read_wait_s"] > 0 and r["consume_s"] >= 0
    # where the wall goes: preparation, then the first and the last tensor handed to the model, then the tail
    ex = r["extra"]
    assert 0 < ex["prepare_s"] <= ex["first_tensor_s"] <= ex["last_tensor_s"] <= r["wall_s"]
    assert isinstance(ex["other_threads"], list) and "MainThread" not in ex["other_threads"]


def test_the_report_names_the_threads_beside_the_load(tmp_path):
    import threading

    ts = tensors()
    write_safetensors(tmp_path / "model.safetensors", ts)
    stop = threading.Event()
    beside = threading.Thread(target=stop.wait, name="beside-the-load", daemon=True)
    beside.start()
    try:
        run(tmp_path, report=tmp_path / "r.json")
    finally:
        stop.set()
        beside.join()
    assert "beside-the-load" in json.loads((tmp_path / "r.json").read_text())["extra"]["other_threads"]


def test_missing_parameter_is_an_error(tmp_path):
    ts = tensors()
    ts.pop("mask")
    write_safetensors(tmp_path / "model.safetensors", ts)
    with pytest.raises(ValueError, match="not initialized from checkpoint.*mask"):
        run(tmp_path)


def test_bin_only_falls_back_loudly_or_refuses(tmp_path, caplog):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not used")
    with pytest.raises(FallbackRefused, match=r"no \*.safetensors files in .*pytorch_model.bin"):
        run(tmp_path, {"fallback": False})


def test_memory_limit_below_largest_tensor_names_it(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", tensors())
    with pytest.raises(ConfigError, match=r"largest tensor 'a.weight' \(4096 bytes"):
        run(tmp_path, {"memory_limit": 100})


def test_malformed_shard_fails_before_loading_anything(tmp_path):
    ts = tensors()
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {k: ts[k] for k in ("a.weight", "a.bias")})
    bad = write_safetensors(tmp_path / "model-00002-of-00002.safetensors",
                            {k: ts[k] for k in ("mask", "ids", "b.weight")})
    with open(bad, "ab") as f:
        f.write(b"junk")
    loader = RunaiStreamerLoader(LoadConfig(load_format="runai_streamer"))
    sink = Sink({k: (v.shape, v.dtype) for k, v in ts.items()})
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: 4 bytes of trailing data"):
        loader.load_weights(sink, fake_model_config(tmp_path))
    assert sink.seen == {}


def test_page_cache_readers_are_shared_among_the_ranks_of_a_host(tmp_path, monkeypatch):
    """fs_strategy auto on a warm page cache: one reader per CPU, split among this host's ranks (each reads the
    whole checkpoint at TP > 1)."""
    from vllm.distributed import parallel_state

    from vllm_fastload.streaming import runai_env

    write_safetensors(tmp_path / "model.safetensors", tensors())
    monkeypatch.delenv("RUNAI_STREAMER_CONCURRENCY", raising=False)
    monkeypatch.delenv("RUNAI_STREAMER_FS_STRATEGY", raising=False)
    monkeypatch.setattr(runai_env.os, "cpu_count", lambda: 32)
    assert runai_env._ranks_on_this_host() == 1  # no distributed state: a load outside an engine
    run(tmp_path, report=tmp_path / "one.json")
    assert json.loads((tmp_path / "one.json").read_text())["extra"]["concurrency"] == 32
    # 4 ranks on 2 nodes: 2 on this host, 16 readers each
    monkeypatch.setattr(parallel_state, "get_world_group", lambda: types.SimpleNamespace(world_size=4))
    monkeypatch.setattr(parallel_state, "get_node_count", lambda: 2)
    run(tmp_path, report=tmp_path / "two.json")
    assert json.loads((tmp_path / "two.json").read_text())["extra"]["concurrency"] == 16


# --- issue 15: bad input, round 2 -----------------------------------------------------------------------------------
def test_demo_model_plus_overlay_without_index_is_refused_before_reading(demo_model, tmp_path):
    d = demo_plus_overlay(demo_model, tmp_path)
    loader = RunaiStreamerLoader(LoadConfig(load_format="runai_streamer"))
    sink = Sink({})
    with pytest.raises(CheckpointError) as e:
        loader.load_weights(sink, fake_model_config(d))
    assert str(e.value).startswith(f"tensor 'model.norm.weight' is stored in 2 shards ({d}/model.safetensors, "
                                   f"{d}/overlay.safetensors) and no safetensors index (model.safetensors.index.json) "
                                   f"says which copy to load")
    assert sink.seen == {}


def _shared_norm(tmp_path, assigned):
    """tensors() split over two shards that both hold a 'norm' (zeros in shard 1, ones in shard 2); the index
    assigns it to shard ``assigned``."""
    ts = tensors()
    ts["norm"] = torch.ones(300, dtype=torch.bfloat16)
    s1 = write_safetensors(tmp_path / "model-00001-of-00002.safetensors",
                           {"a.weight": ts["a.weight"], "a.bias": ts["a.bias"],
                            "norm": torch.zeros(300, dtype=torch.bfloat16)})
    s2 = write_safetensors(tmp_path / "model-00002-of-00002.safetensors",
                           {k: ts[k] for k in ("mask", "ids", "b.weight", "norm")})
    wm = {k: s1.name for k in ("a.weight", "a.bias")} | {k: s2.name for k in ("mask", "ids", "b.weight")}
    wm["norm"] = (s1 if assigned == 1 else s2).name
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return ts, s1, s2


@pytest.mark.parametrize("assigned", [1, 2])
@pytest.mark.parametrize("extra", [{}, {"concurrency": 1}, {"concurrency": 8, "fs_strategy": "sync_buffered"}])
def test_with_an_index_each_name_loads_once_from_its_shard_whatever_the_read_order(tmp_path, caplog, assigned, extra):
    ts, s1, s2 = _shared_norm(tmp_path, assigned)
    extra = {**extra, "report_path": str(tmp_path / "r.json")}
    loader = RunaiStreamerLoader(LoadConfig(load_format="runai_streamer", model_loader_extra_config=extra))
    names = []
    sink = Sink({k: (v.shape, v.dtype) for k, v in ts.items()})
    real = sink.load_weights
    sink.load_weights = lambda weights: real((names.append(n) or (n, t)) for n, t in weights)
    with caplog.at_level("WARNING", logger="vllm.fastload"):
        loader.load_weights(sink, fake_model_config(tmp_path))
    assert sorted(names) == sorted(ts)  # each name once: 6 tensors, not 7
    want = 0.0 if assigned == 1 else 1.0
    assert sink.seen["norm"].tolist() == [want] * 300
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["tensors"] == 6 and r["bytes"] == sum(v.numel() * v.element_size() for v in ts.values())
    kept, ignored = (s1, s2) if assigned == 1 else (s2, s1)
    [w] = [rec.getMessage() for rec in caplog.records
           if rec.levelname == "WARNING" and "also holds" in rec.getMessage()]
    assert w == (f"fastload: {ignored} also holds 1 tensor(s) that {tmp_path}/model.safetensors.index.json assigns to "
                 f"another shard; those copies are not loaded: 'norm' (loaded from {kept.name})")


def test_fan_out_entries_hold_each_name_once(tmp_path):
    """At TP > 1 the fan-out splits the headers the loader passes: the ignored copy is not among them."""
    from vllm_fastload.checkpoint import read_checkpoint, select_shards
    from vllm_fastload.streaming.fanout import entries_of

    _shared_norm(tmp_path, 2)
    entries = entries_of(list(read_checkpoint(select_shards(str(tmp_path))).headers))
    assert sorted((f, t.name) for f, t in entries if t.name == "norm") == [(1, "norm")]
    assert len(entries) == 6


def test_shards_without_tensors_fail_before_reading(tmp_path):
    from tests.conftest import write_raw

    write_raw(tmp_path / "model.safetensors", {"__metadata__": {"format": "pt"}}, b"")
    with pytest.raises(CheckpointError, match=r"the selected shard\(s\) hold no tensors \(model.safetensors"):
        run(tmp_path)


def test_zero_element_tensor_inside_another_fails_naming_file_and_tensor(tmp_path):
    from tests.conftest import write_raw

    write_raw(tmp_path / "model.safetensors", {"a.weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                                               "z": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}}, b"\0" * 16)
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}/model.safetensors: tensor 'z' has zero elements but its "
                                              r"data_offsets \[8, 8\] lie inside tensor 'a.weight' \[0, 16\]"):
        run(tmp_path)


def test_missing_hf_blob_fails_in_download_model_before_the_model_is_built(tmp_path):
    snap = tmp_path / "models--org--m" / "snapshots" / "r1"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to("../../blobs/abc")
    loader = RunaiStreamerLoader(LoadConfig(load_format="runai_streamer"))
    with pytest.raises(CheckpointError, match=r"incomplete or evicted download; download it again \(`hf download "
                                              r"org/m --revision r1`\)"):
        loader.download_model(fake_model_config(snap))


def test_missing_local_weights_path_is_an_error_not_a_hub_download():
    """A reload_weights weights_path (or --model) that is a local path not on disk: vLLM's default loader would
    take it for a hub repository id and try to download it; refuse naming the path instead."""
    from types import SimpleNamespace

    import pytest
    from vllm.config import LoadConfig

    from vllm_fastload.errors import CheckpointError
    from vllm_fastload.streaming.loader import RunaiStreamerLoader

    loader = RunaiStreamerLoader(LoadConfig(load_format="runai_streamer"))
    with pytest.raises(CheckpointError, match="/no/such/checkpoint does not exist: pass the model directory"):
        loader._why_not(SimpleNamespace(model="/no/such/checkpoint", model_weights=None))


def test_reload_picks_the_read_path_for_the_device_the_model_had_when_asked(tmp_path, monkeypatch):
    """vLLM's reload_weights calls get_all_weights, then moves the layers to the meta device, then iterates: the
    device (which decides pinned direct reads and the fan-out on a GPU) is the one at the call."""
    ts = tensors()
    write_safetensors(tmp_path / "model.safetensors", ts)
    seen = []
    real = RunaiStreamerLoader._reads_into_pinned

    def spy(self, device, headers):
        seen.append(device.type)
        return real(self, device, headers)

    monkeypatch.setattr(RunaiStreamerLoader, "_reads_into_pinned", spy)
    loader = RunaiStreamerLoader(LoadConfig(load_format="runai_streamer", model_loader_extra_config={}))
    sink = Sink({k: (v.shape, v.dtype) for k, v in ts.items()})
    it = loader.get_all_weights(fake_model_config(tmp_path), sink)
    # what vLLM's initialize_layerwise_reload does before iterating: the layers' tensors go to the meta device
    sink.params = torch.nn.ParameterDict({k: torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
                                          for k, p in sink.params.items()})
    assert sorted(n for n, _ in it) == sorted(ts) and seen == ["cpu"]


@pytest.mark.parametrize("sleep_mode", [True, False])
def test_the_stream_runs_outside_pools_exactly_when_vllm_loads_inside_its_sleep_pool(tmp_path, sleep_mode):
    """With ``enable_cumem_allocator`` (vLLM's sleep mode) the whole stream runs inside ``devmem.outside_pools``, so
    the buffers it gives back stay out of vLLM's sleep pool; without it, no helper-thread hop per tensor."""
    from vllm_fastload.streaming import devmem

    ts = tensors()
    write_safetensors(tmp_path / "model.safetensors", ts)
    during = []  # devmem's count of open outside_pools contexts whenever the model receives a tensor
    loader = RunaiStreamerLoader(LoadConfig(load_format="runai_streamer", model_loader_extra_config={}))
    sink = Sink({k: (v.shape, v.dtype) for k, v in ts.items()})
    config = fake_model_config(tmp_path)
    config.enable_cumem_allocator = sleep_mode
    real_load = sink.load_weights
    sink.load_weights = lambda weights: real_load((during.append(devmem._outside) or (n, t)) for n, t in weights)
    loader.load_weights(sink, config)
    assert len(during) == len(ts) and set(during) == {1 if sleep_mode else 0}
    assert devmem._outside == 0  # closed with the stream


def test_a_shard_cut_short_while_read_names_the_shard_the_tensor_and_the_fix(tmp_path):
    """Issue 27, item 5: a shard truncated under the reader (a copy into the model folder still running) gave
    runai's bare "ValueError: Could not receive response from libstreamer due to: b'End of file reached'"."""
    import os

    g = torch.Generator().manual_seed(1)
    ts = {f"t{i:02d}": torch.randn(2**20, generator=g) for i in range(24)}  # 24 x 4 MiB
    path = write_safetensors(tmp_path / "model.safetensors", ts)
    loader = RunaiStreamerLoader(LoadConfig(load_format="runai_streamer", model_loader_extra_config={
        "memory_limit": 0, "concurrency": 1}))
    sink = Sink({k: (v.shape, v.dtype) for k, v in ts.items()})
    real = sink.load_weights

    def cut_after_first(weights):
        def gen():
            for i, (n, t) in enumerate(weights):
                if i == 0:
                    os.truncate(path, 8 * 2**20)
                yield n, t
        return real(gen())

    sink.load_weights = cut_after_first
    with pytest.raises(CheckpointError) as e:
        loader.load_weights(sink, fake_model_config(tmp_path))
    msg = str(e.value)
    assert msg.startswith(f"{path}: file is truncated: {8 * 2**20} bytes, but its header declares")
    assert "tensor 't01'" in msg and "The shard changed while this load read it (the reader said:" in msg
    assert "is a copy or download into the model folder still running? Let it finish" in msg


def test_closing_the_timed_stream_closes_the_stream_inside_at_once():
    from vllm_fastload.report import LoadReport
    from vllm_fastload.streaming.loader import _timed_edges

    def inner():
        yield "a", 1
        yield "b", 2

    it = inner()
    report = LoadReport(load_format="runai_streamer", source="x")
    timed = _timed_edges(it, report, 0.0)
    assert next(timed) == ("a", 1)
    timed.close()
    # the reader behind the stream is let go now, not when the last reference to it goes (held here on purpose)
    assert it.gi_frame is None
    assert "first_tensor_s" in report.extra and "last_tensor_s" not in report.extra
