"""vLLM's in-place ``reload_weights`` on an ipc_cache model (issue 16), in one process, without a server.

A skeleton built like :func:`vllm_fastload.ipc.engine.mapping._build_model` builds it (under ``torch.device("meta")``,
vLLM's ``record_metadata_for_reloading`` called inside, as ``initialize_model`` does), tensors installed by the real
:func:`vllm_fastload.ipc.memory.state.install` as views into a real memfd segment (the daemon's side packed by the real
``pack``, the engine's side mapped by the real ``MemfdTransport.open``), and vLLM 0.32's real ``reload_weights``
with layerwise reload. The end-to-end version with servers: tests/e2e_cpu/test_ipc_reload_e2e.py.
"""

from __future__ import annotations

import copy
import os
import pickle
import types

import pytest
import torch
from torch import nn

pytest.importorskip("vllm")

from vllm.config.load import LoadConfig  # noqa: E402
from vllm.model_executor.model_loader.reload import inplace, layerwise  # noqa: E402
from vllm.model_executor.model_loader.weight_utils import default_weight_loader  # noqa: E402

from vllm_fastload.ipc.daemon.export import pack  # noqa: E402
from vllm_fastload.ipc.engine import mapping  # noqa: E402
from vllm_fastload.ipc.engine.loader import IpcCacheLoader  # noqa: E402
from vllm_fastload.ipc.engine.reload import (  # noqa: E402
    ReloadRefused,
    checkpoint_loader,
    guard_direct_loads,
    record_restore_device,
    refuse_shared_writes,
    shared_write_segments,
)
from vllm_fastload.ipc.memory.layout import views  # noqa: E402
from vllm_fastload.ipc.memory.memfd import MemfdTransport  # noqa: E402
from vllm_fastload.ipc.memory.state import install  # noqa: E402
from vllm_fastload.ipc.memory.transport import Transport  # noqa: E402

CPU = torch.device("cpu")


class Tiny(nn.Module):
    """Two layers with parameters, and vLLM's usual ``load_weights`` (each parameter's ``weight_loader``)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 3, bias=False)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(3), requires_grad=False)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, w in weights:
            p = params[name]
            getattr(p, "weight_loader", default_weight_loader)(p, w)
        return set(params)


def originals() -> dict[str, torch.Tensor]:
    return {"proj.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4), "norm.weight": torch.ones(3)}


def skeleton() -> Tiny:
    """The skeleton as ``mapping._build_model`` makes it: built and recorded for reloading on the meta device."""
    with torch.device("meta"):
        model = Tiny()
        layerwise.record_metadata_for_reloading(model)
    return model


@pytest.fixture
def mapped():
    """``(model, daemon_segment, engine_segment)``: a skeleton whose parameters view a MAP_PRIVATE mapping of the
    daemon's memfd, as a zero_copy engine on CPU serves them."""
    daemon_seg, entries = pack(originals())
    engine_seg = MemfdTransport().open(os.dup(daemon_seg.fd), MemfdTransport().describe(daemon_seg, CPU), CPU)
    model = skeleton()
    install(model, {k: ("param", v) for k, v in views(engine_seg.buf, entries).items()}, {}, [])
    yield model, daemon_seg, engine_seg
    daemon_seg.close()


def daemon_bytes(seg) -> bytes:
    return bytes(seg.buf.numpy())


def vllm_config(load_format="ipc_cache", extra=None):
    return types.SimpleNamespace(model_config=types.SimpleNamespace(quantization=None, dtype=torch.float32),
                                 load_config=LoadConfig(load_format=load_format, model_loader_extra_config=extra or {}),
                                 lora_config=None)


def new_weights():
    return [("proj.weight", torch.full((3, 4), 7.0)), ("norm.weight", torch.full((3,), 2.0))]


def test_the_meta_skeleton_records_meta_as_restore_device_and_the_reload_fails_without_the_fix(mapped):
    """The cause of "Cannot copy out of meta tensor": initialize_model records the default device, meta in the
    skeleton, as the device vLLM materializes each layer on during a reload."""
    model, _, _ = mapped
    assert {layerwise.get_layerwise_info(m).restore_device.type for m in model.modules()} == {"meta"}
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        inplace.reload_weights(vllm_config(), model, iter(new_weights()), None, True)


def test_with_the_real_device_recorded_a_zero_copy_cpu_reload_is_private_to_the_engine(mapped):
    model, daemon_seg, engine_seg = mapped
    before = daemon_bytes(daemon_seg)
    mapped_ptr = model.proj.weight.data_ptr()
    assert record_restore_device(model, CPU) == len(list(model.modules()))
    assert {layerwise.get_layerwise_info(m).restore_device for m in model.modules()} == {CPU}
    # memfd is mapped copy-on-write: a reload may write, the writes stay in this process
    assert not MemfdTransport.shares_writes
    private = leased(types.SimpleNamespace(segment=engine_seg, path="s"), MemfdTransport())
    assert shared_write_segments(model, [private]) == []
    inplace.reload_weights(vllm_config(), model, iter(new_weights()), None, True)
    assert torch.equal(model.proj.weight, torch.full((3, 4), 7.0))
    assert torch.equal(model.norm.weight, torch.full((3,), 2.0))
    assert model.proj.weight.data_ptr() == mapped_ptr  # written in place (CUDA graphs keep their addresses)
    assert daemon_bytes(daemon_seg) == before  # the daemon's pages are untouched
    fresh = views(MemfdTransport().open(os.dup(daemon_seg.fd), MemfdTransport().describe(daemon_seg, CPU), CPU).buf,
                  pack(originals())[1])
    assert all(torch.equal(fresh[k], v) for k, v in originals().items())  # another engine maps the originals


def test_record_restore_device_is_a_no_op_on_a_vllm_without_layerwise_reload(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_layerwise(name, *a, **kw):
        if name.endswith("reload.layerwise"):
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_layerwise)
    assert record_restore_device(nn.Linear(2, 2), CPU) == 0


class SharedWrites(Transport):
    """A transport whose mappings share writes with the daemon, as CUDA VMM's do (simulated on CPU)."""

    name = "shared-test"
    shares_writes = True


def leased(lease, transport):
    """A zero_copy lease as :func:`.mapping.zero_copy_leases` lists it: its segment, socket path and transport."""
    return types.SimpleNamespace(segment=lease.segment, path=lease.path, transport=transport)


def shared_model():
    """A model whose parameters view the daemon's own MAP_SHARED segment, as a CUDA zero_copy engine's do."""
    daemon_seg, entries = pack(originals())
    model = skeleton()
    install(model, {k: ("param", v) for k, v in views(daemon_seg.buf, entries).items()}, {}, [])
    record_restore_device(model, CPU)
    return model, daemon_seg, types.SimpleNamespace(segment=daemon_seg, path="/run/fl/gpu-X-r0-target.sock")


def test_transports_declare_whether_writes_reach_the_daemon():
    from vllm_fastload.ipc.memory.cuda_vmm import CudaVmmTransport

    assert CudaVmmTransport.shares_writes and not MemfdTransport.shares_writes
    assert Transport.shares_writes  # a new backend is taken as shared until it says otherwise


def test_a_zero_copy_reload_on_a_shares_writes_transport_is_refused_before_the_model_is_touched(monkeypatch):
    model, daemon_seg, lease = shared_model()
    before = daemon_bytes(daemon_seg)
    params = {k: v for k, v in model.named_parameters()}
    monkeypatch.setattr(mapping, "_LEASES", [leased(lease, SharedWrites())])
    loader = IpcCacheLoader(LoadConfig(load_format="ipc_cache", model_loader_extra_config={}))
    monkeypatch.setattr(inplace, "get_model_loader", lambda load_config: loader)
    with pytest.raises(ReloadRefused, match=r"would write into the preload daemon's memory at "
                                            r"/run/fl/gpu-X-r0-target.sock .*\"mode\": \"copy\""):
        inplace.reload_weights(vllm_config(), model, None, None, True)
    with pytest.raises(ReloadRefused):  # the loader's own in-place load_weights as well
        loader.load_weights(model, vllm_config().model_config)
    assert daemon_bytes(daemon_seg) == before
    assert {k: v for k, v in model.named_parameters()} == params  # still the mapped tensors, none on meta
    assert not any(p.is_meta for p in model.parameters())
    daemon_seg.close()


def test_a_direct_load_weights_on_a_shared_zero_copy_engine_is_refused_and_writes_nothing(monkeypatch):
    """An RL trainer's weight sync calls the model's own load_weights (collective_rpc), not reload_weights: once
    the zero_copy lease is kept (mapping._keep_lease, what map_model does last), that call refuses before it
    reads a weight, naming the daemon's socket and the fix, and the daemon's memory is unchanged."""
    model, daemon_seg, lease = shared_model()
    before = daemon_bytes(daemon_seg)
    monkeypatch.setattr(mapping, "_LEASES", [])
    mapping._keep_lease(leased(lease, SharedWrites()), CPU, model)
    read = []

    def weights():
        read.append(1)
        yield from new_weights()

    with pytest.raises(ReloadRefused, match=r"model.load_weights on an ipc_cache zero_copy engine would write into "
                                            r"the preload daemon's memory at /run/fl/gpu-X-r0-target.sock .*"
                                            r"\"mode\": \"copy\""):
        model.load_weights(weights())
    with pytest.raises(ReloadRefused):
        model.load_weights(weights=new_weights())  # by keyword, as OpenRLHF's and verl's syncs call it
    assert read == [] and daemon_bytes(daemon_seg) == before
    assert torch.equal(model.proj.weight, originals()["proj.weight"])
    # once per model (a second lease of the same model keeps the one guard); a guarded model still pickles and
    # deep-copies, and its copy refuses too
    guard = vars(model)["load_weights"]
    assert guard_direct_loads(model, leased(lease, SharedWrites())) and vars(model)["load_weights"] is guard
    twin = copy.deepcopy(model)
    with pytest.raises(ReloadRefused, match="gpu-X-r0-target.sock"):
        twin.load_weights(new_weights())
    assert pickle.loads(pickle.dumps(guard)).path == lease.path
    daemon_seg.close()


def test_vllms_reload_with_a_weights_iterator_is_refused_without_writing_the_daemons_memory(monkeypatch):
    """vLLM 0.32's reload_weights with a weights iterator never asks the loader (no get_all_weights, so no
    refuse_shared_writes) and puts the layers on the meta device before it calls the model's load_weights: the
    guard refuses there, after that step. The daemon's memory is kept; this engine is left without weights (the
    documented gap, reload.guard_direct_loads)."""
    model, daemon_seg, lease = shared_model()
    before = daemon_bytes(daemon_seg)
    monkeypatch.setattr(mapping, "_LEASES", [])
    mapping._keep_lease(leased(lease, SharedWrites()), CPU, model)
    with pytest.raises(ReloadRefused, match="model.load_weights on an ipc_cache zero_copy engine"):
        inplace.reload_weights(vllm_config(), model, iter(new_weights()), None, True)
    assert daemon_bytes(daemon_seg) == before
    daemon_seg.close()


class ReadOnlyLoads(Tiny):
    """A model whose load_weights is a property without a setter: the guard cannot be set."""

    @property
    def load_weights(self):
        return super().load_weights


def test_a_model_that_does_not_take_the_guard_is_named_in_a_warning(caplog):
    daemon_seg, entries = pack(originals())
    model = ReadOnlyLoads()
    with caplog.at_level("WARNING", logger="vllm.fastload"):
        assert not guard_direct_loads(model, leased(types.SimpleNamespace(segment=daemon_seg, path="/s.sock"),
                                                    SharedWrites()))
    assert "could not make ReadOnlyLoads.load_weights refuse" in caplog.text and "/s.sock" in caplog.text
    daemon_seg.close()


def test_a_direct_load_weights_is_left_alone_where_writes_stay_in_the_engine(mapped, monkeypatch):
    """The CPU memfd is mapped copy-on-write: the model's own load_weights writes this engine's pages only, so it
    is not wrapped (zero_copy on CPU), and copy mode never keeps a lease."""
    model, daemon_seg, engine_seg = mapped
    before = daemon_bytes(daemon_seg)
    monkeypatch.setattr(mapping, "_LEASES", [])
    mapping._keep_lease(leased(types.SimpleNamespace(segment=engine_seg, path="s"), MemfdTransport()), CPU, model)
    assert "load_weights" not in vars(model)
    assert model.load_weights(new_weights()) == {"proj.weight", "norm.weight"}
    assert torch.equal(model.proj.weight, torch.full((3, 4), 7.0))
    assert daemon_bytes(daemon_seg) == before
    assert not guard_direct_loads(nn.Linear(2, 2), leased(types.SimpleNamespace(segment=engine_seg, path="s"),
                                                           SharedWrites()))  # no load_weights to guard


def test_the_decision_looks_at_the_models_own_tensors():
    model, daemon_seg, lease = shared_model()
    assert shared_write_segments(model, [leased(lease, SharedWrites())]) == [lease.path]
    assert shared_write_segments(model, [leased(lease, MemfdTransport())]) == []  # a private mapping
    copy = skeleton()  # copy mode and fallback loads: the engine's own memory
    install(copy, {k: ("param", v.clone()) for k, v in views(daemon_seg.buf, pack(originals())[1]).items()}, {}, [])
    assert shared_write_segments(copy, [leased(lease, SharedWrites())]) == []
    refuse_shared_writes(copy, [leased(lease, SharedWrites())])  # raises nothing
    gone = types.SimpleNamespace(segment=types.SimpleNamespace(buf=None, size=0), path="p")
    assert shared_write_segments(model, [leased(gone, SharedWrites())]) == []
    daemon_seg.close()


def test_the_reload_streams_the_checkpoint_with_runai_streamer_and_the_shared_keys(caplog):
    from vllm_fastload.config import IpcCacheConfig
    from vllm_fastload.streaming.loader import RunaiStreamerLoader

    extra = {"mode": "zero_copy", "socket_dir": "/tmp/x", "connect_timeout_s": 1, "fallback": False,
             "report_path": "/tmp/r.json"}
    load_config = LoadConfig(load_format="ipc_cache", model_loader_extra_config=extra)
    with caplog.at_level("INFO", logger="vllm.fastload"):
        loader = checkpoint_loader(load_config, IpcCacheConfig.from_extra(extra))
    assert isinstance(loader, RunaiStreamerLoader) and loader.load_config.load_format == "runai_streamer"
    assert loader.load_config.model_loader_extra_config == {"fallback": False, "report_path": "/tmp/r.json",
                                                            "expected_content_digest": None, "freeze_gc": True}
    assert load_config.model_loader_extra_config == extra  # the engine's own config is left as it is
    assert "reload_weights reads the checkpoint from disk with runai_streamer" in caplog.text
