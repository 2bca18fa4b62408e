"""RunaiStreamerLoader.load_weights on a small torch module, without a vLLM server."""

import json
import types

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config.load import LoadConfig  # noqa: E402

from tests.conftest import write_safetensors  # noqa: E402
from vllm_fastload.errors import CheckpointError, ConfigError, FallbackRefused  # noqa: E402
from vllm_fastload.streaming.loader import RunaiStreamerLoader  # noqa: E402


class Sink(torch.nn.Module):
    """Holds one parameter per expected name; load_weights copies like vLLM's default weight_loader."""

    def __init__(self, shapes: dict):
        super().__init__()
        self.params = torch.nn.ParameterDict(
            {k.replace(".", "_"): torch.nn.Parameter(torch.empty(s, dtype=d), requires_grad=False) for k, (s, d) in shapes.items()})
        self.seen = {}

    def load_weights(self, weights):
        loaded = set()
        for name, t in weights:
            self.seen[name] = t
            self.params[name.replace(".", "_")].data.copy_(t)
            loaded.add("params." + name.replace(".", "_"))
        return loaded


def model_config(path, quantization=None):
    return types.SimpleNamespace(model=str(path), model_weights=None, revision=None, dtype=torch.bfloat16,
                                 quantization=quantization, architectures=["Sink"], hf_config=types.SimpleNamespace())


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
    loader.load_weights(sink, model_config(path))
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
    bad = write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {k: ts[k] for k in ("mask", "ids", "b.weight")})
    with open(bad, "ab") as f:
        f.write(b"junk")
    loader = RunaiStreamerLoader(LoadConfig(load_format="runai_streamer"))
    sink = Sink({k: (v.shape, v.dtype) for k, v in ts.items()})
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: 4 bytes of trailing data"):
        loader.load_weights(sink, model_config(tmp_path))
    assert sink.seen == {}


def test_page_cache_readers_are_shared_among_the_ranks_of_a_host(tmp_path, monkeypatch):
    """fs_strategy auto on a warm page cache: one reader per CPU, split among this host's ranks (each reads the
    whole checkpoint at TP > 1)."""
    from vllm.distributed import parallel_state

    from vllm_fastload.streaming import loader as streaming_loader

    write_safetensors(tmp_path / "model.safetensors", tensors())
    monkeypatch.delenv("RUNAI_STREAMER_CONCURRENCY", raising=False)
    monkeypatch.delenv("RUNAI_STREAMER_FS_STRATEGY", raising=False)
    monkeypatch.setattr(streaming_loader.os, "cpu_count", lambda: 32)
    assert streaming_loader._ranks_on_this_host() == 1  # no distributed state: a load outside an engine
    run(tmp_path, report=tmp_path / "one.json")
    assert json.loads((tmp_path / "one.json").read_text())["extra"]["concurrency"] == 32
    # 4 ranks on 2 nodes: 2 on this host, 16 readers each
    monkeypatch.setattr(parallel_state, "get_world_group", lambda: types.SimpleNamespace(world_size=4))
    monkeypatch.setattr(parallel_state, "get_node_count", lambda: 2)
    run(tmp_path, report=tmp_path / "two.json")
    assert json.loads((tmp_path / "two.json").read_text())["extra"]["concurrency"] == 16
