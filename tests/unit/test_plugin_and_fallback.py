import importlib.metadata as md
import logging

import pytest

vllm = pytest.importorskip("vllm")

from vllm.config.load import LoadConfig  # noqa: E402
from vllm.model_executor.model_loader.base_loader import BaseModelLoader  # noqa: E402
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader  # noqa: E402

from vllm_fastload import plugin  # noqa: E402
from vllm_fastload.errors import ConfigError, FallbackRefused, FastloadError  # noqa: E402
from vllm_fastload.fallback import fall_back  # noqa: E402
from vllm_fastload.streaming.loader import RunaiStreamerLoader  # noqa: E402


def test_entry_point_declared():
    eps = md.entry_points(group="vllm.general_plugins")
    ep = next(e for e in eps if e.name == "vllm_fastload")
    assert ep.value == "vllm_fastload.plugin:register"


def test_register_is_idempotent_and_replaces_builtin(caplog):
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER as reg
    from vllm.model_executor.model_loader import get_model_loader

    plugin.register()
    plugin.register()
    assert reg["runai_streamer"] is RunaiStreamerLoader
    assert issubclass(RunaiStreamerLoader, BaseModelLoader)
    assert isinstance(get_model_loader(LoadConfig(load_format="runai_streamer")), RunaiStreamerLoader)


def test_loader_init_validates_extra_config():
    with pytest.raises(ConfigError, match="concurrency"):
        RunaiStreamerLoader(LoadConfig(load_format="runai_streamer", model_loader_extra_config={"concurrency": "16"}))


def test_fallback_allowed_returns_default_loader_without_our_keys(caplog):
    lc = LoadConfig(load_format="runai_streamer", model_loader_extra_config={"fallback": True, "concurrency": 4})
    with caplog.at_level(logging.WARNING, logger="vllm.fastload"):
        loader = fall_back("runai_streamer", "no *.safetensors files in /m", True, lc)
    assert isinstance(loader, DefaultModelLoader)
    assert loader.load_config.load_format == "auto" and loader.load_config.model_loader_extra_config == {}
    assert lc.model_loader_extra_config == {"fallback": True, "concurrency": 4}  # caller's config untouched
    msg = caplog.records[-1].getMessage()
    assert caplog.records[-1].levelname == "WARNING"
    assert "no *.safetensors files in /m" in msg and "'auto'" in msg


def test_fallback_refused_names_reason():
    with pytest.raises(FallbackRefused, match=r"no \*.safetensors files in /m.*\"fallback\": false"):
        fall_back("runai_streamer", "no *.safetensors files in /m", False, LoadConfig())


def test_fallback_impossible_is_an_error_even_when_allowed():
    with pytest.raises(FastloadError, match="nothing to fall back to"):
        fall_back("runai_streamer", "no *.safetensors files in s3://b/m", True, LoadConfig(), possible=False)


@pytest.mark.parametrize("name", ["runai_streamer", "ipc_cache"])
def test_loader_classes_satisfy_the_installed_base_model_loader(name):
    import inspect

    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER as reg

    plugin.register()
    cls = reg[name]
    assert cls.__module__.startswith("vllm_fastload.") and issubclass(cls, BaseModelLoader)
    assert not getattr(cls, "__abstractmethods__", None)
    for meth in ("download_model", "load_weights", "load_model"):
        base = inspect.signature(getattr(BaseModelLoader, meth))
        ours = inspect.signature(getattr(cls, meth))
        # every parameter vLLM passes is accepted by ours
        for p in base.parameters:
            assert p in ours.parameters or any(
                q.kind in (q.VAR_POSITIONAL, q.VAR_KEYWORD) for q in ours.parameters.values()), (meth, p)
    assert isinstance(cls(LoadConfig(load_format=name)), BaseModelLoader)  # __init__ with defaults works


@pytest.mark.parametrize("broken, level", [(True, logging.WARNING), (False, logging.INFO)])
def test_step_down_is_never_silent(caplog, broken, level):
    """A fast path's own slower path (the pinned ring instead of direct reads): logged with the reason, loudly
    when something it relies on broke."""
    from vllm_fastload.fallback import step_down

    with caplog.at_level(logging.INFO, logger="vllm.fastload"):
        step_down("copying through the pinned ring instead of reading into pinned memory", "why", broken=broken)
    rec = caplog.records[-1]
    assert rec.levelno == level
    assert rec.getMessage() == "fastload: copying through the pinned ring instead of reading into pinned memory: why"


def test_an_ipc_cache_fallback_reads_the_disk_with_our_shard_rules(tmp_path, caplog, monkeypatch):
    """Issue 27, item 1: an ipc_cache engine that falls back loads through our runai_streamer (the index decides
    which copy of a name stored in two shards loads, as in the daemon), not through vLLM's default loader, which
    keeps the last copy it reads; the ipc_cache report says what loaded. The e2e twin serves a real engine
    (tests/e2e_cpu/test_ipc_cache_e2e.py, "after-kill")."""
    import json

    import torch

    from tests.conftest import fake_model_config, write_safetensors
    from vllm_fastload.errors import CacheUnavailable
    from vllm_fastload.ipc.engine import loader as ipc_loader

    a = write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"norm": torch.ones(4), "x": torch.zeros(2)})
    b = write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"norm": torch.zeros(4), "y": torch.ones(2)})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"norm": a.name, "x": a.name, "y": b.name}}))

    def no_daemon(*args, **kwargs):
        raise CacheUnavailable(f"no preload daemon at {tmp_path / 'none.sock'}")

    got = {}

    def streamer_load_model(self, vllm_config, model_config, prefix=""):
        class Sink(torch.nn.Module):
            def load_weights(self, weights):
                got.update((n, t.clone()) for n, t in weights)
                return {"norm", "x", "y"}

        sink = Sink()
        self.load_weights(sink, model_config)
        return sink

    monkeypatch.setattr(ipc_loader, "map_model", no_daemon)
    monkeypatch.setattr(RunaiStreamerLoader, "load_model", streamer_load_model)
    monkeypatch.setattr(RunaiStreamerLoader, "_check_all_loaded", lambda *a: None)
    report = tmp_path / "r.json"
    lc = LoadConfig(load_format="ipc_cache", model_loader_extra_config={
        "socket_path": str(tmp_path / "none.sock"), "report_path": str(report)})
    with caplog.at_level(logging.WARNING, logger="vllm.fastload"):
        ipc_loader.IpcCacheLoader(lc).load_model(vllm_config=None, model_config=fake_model_config(tmp_path))
    assert sorted(got) == ["norm", "x", "y"] and torch.equal(got["norm"], torch.ones(4))  # the indexed copy
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("ipc_cache cannot serve this load: no preload daemon at" in w and "Falling back to reading the "
               "checkpoint from disk (load format 'runai_streamer')" in w for w in warnings), warnings
    assert any("those copies are not loaded: 'norm'" in w for w in warnings), warnings
    r = json.loads(report.read_text())
    assert r["load_format"] == "ipc_cache" and r["format_used"] == "runai_streamer"
    assert r["fallback_reason"].startswith("no preload daemon at")
