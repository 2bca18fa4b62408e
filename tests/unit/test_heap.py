"""``freeze_gc``: both loaders freeze the garbage collector's heap when their load starts (vllm_fastload.heap), so
vLLM's memory profiler's full collections after the load walk only what the load made; ``false`` leaves it."""

from __future__ import annotations

import gc
import types

import pytest

pytest.importorskip("vllm")

from vllm.config.load import LoadConfig  # noqa: E402
from vllm.model_executor.model_loader.base_loader import BaseModelLoader  # noqa: E402

from tests.unit.test_ipc_tp_mismatch import ipc_loader, parallel, setup  # noqa: E402,F401
from vllm_fastload.heap import freeze_heap  # noqa: E402
from vllm_fastload.streaming.loader import RunaiStreamerLoader  # noqa: E402


@pytest.fixture
def thawed():
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()


def test_freeze_heap_moves_live_objects_out_of_later_collections(thawed):
    kept = [object() for _ in range(10)]  # noqa: F841 (live: tracked lists and objects)
    freeze_heap()
    assert gc.get_freeze_count() > 1000  # everything this pytest process tracks, not a handful
    before = len(gc.get_objects(generation=2))
    gc.collect()
    assert len(gc.get_objects(generation=2)) <= before  # frozen objects are not promoted back


@pytest.mark.parametrize("freeze", [True, False])
def test_runai_streamer_load_freezes_the_heap_unless_told_not_to(thawed, monkeypatch, freeze):
    monkeypatch.setattr(BaseModelLoader, "load_model", lambda self, *a, **k: "model")
    loader = RunaiStreamerLoader(LoadConfig(load_format="runai_streamer",
                                            model_loader_extra_config={"freeze_gc": freeze}))
    assert loader.load_model(vllm_config=None, model_config=None) == "model"
    assert (gc.get_freeze_count() > 0) is freeze


@pytest.mark.parametrize("freeze", [True, False])
def test_ipc_cache_load_freezes_the_heap_unless_told_not_to(thawed, setup, monkeypatch, freeze):
    srv, model_config, vllm_config = setup
    stub = types.SimpleNamespace(load_config=types.SimpleNamespace(load_format="auto"),
                                 load_model=lambda **kw: "disk")
    monkeypatch.setattr("vllm_fastload.fallback.default_loader", lambda load_config: stub)
    parallel(monkeypatch, 2, 1)  # a fingerprint mismatch: the load falls back, the heap was frozen at its start
    assert ipc_loader(srv.path, freeze_gc=freeze).load_model(vllm_config, model_config) == "disk"
    assert (gc.get_freeze_count() > 0) is freeze


def test_freeze_gc_must_be_a_bool():
    from vllm_fastload.config import IpcCacheConfig
    from vllm_fastload.errors import ConfigError

    with pytest.raises(ConfigError, match=r"invalid value for key 'freeze_gc' of load format 'ipc_cache': 'yes' "
                                          r"\(str\).*Allowed: true or false \(JSON bool\)"):
        IpcCacheConfig.from_extra({"freeze_gc": "yes"})
