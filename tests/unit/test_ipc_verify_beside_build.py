"""The checksum check of an ``ipc_cache`` load of a device segment (CUDA VMM) runs in a thread beside the
skeleton's construction (``mapping._Verifying``); of a CPU memfd, before it. Beside, it must really run at the same
time, a mismatch it finds must still reach the fallback policy before any tensor is installed, and the skeleton
built meanwhile must not stay registered.

Drives the real pieces in one process, as test_ipc_tp_mismatch does: a RankServer serving a packed segment, the
client's fetch, ``IpcCacheLoader.load_model`` with its fallback policy; only the skeleton build, the install and the
disk load are stand-ins. The segment here is a memfd; the ``beside`` fixture makes the load treat it as a device
segment would be treated (this machine has no GPU; the GPU benchmark runs the CUDA path).
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
from torch import nn

pytest.importorskip("vllm")

from tests.unit.test_ipc_tp_mismatch import ipc_loader, parallel, setup  # noqa: E402,F401
from vllm_fastload.errors import FallbackRefused  # noqa: E402
from vllm_fastload.ipc.engine import mapping  # noqa: E402
from vllm_fastload.ipc.memory.state import InstallError  # noqa: E402


@pytest.fixture
def beside(monkeypatch):
    """The check runs beside the build, as for a CUDA VMM segment."""
    monkeypatch.setattr(mapping, "_verify_beside_build", lambda transport: True)


def _disk(monkeypatch):
    """The fallback's disk load (our runai_streamer) answers "disk"."""
    monkeypatch.setattr("vllm_fastload.streaming.loader.RunaiStreamerLoader.load_model", lambda self, **kw: "disk")


def test_the_checksum_check_runs_while_the_skeleton_is_built(setup, monkeypatch, beside):
    srv, model_config, vllm_config = setup
    checking, building, seen = threading.Event(), threading.Event(), {}
    verify = mapping._verify

    def watched_verify(lease, path):
        checking.set()
        # a check that ran before the build (not beside it) would wait here in vain
        seen["build started during the check"] = building.wait(timeout=5)
        verify(lease, path)

    def build(*a):
        building.set()
        seen["check started before the build ended"] = checking.wait(timeout=30)
        return nn.Module()

    def apply(model, tensors, manifest, made=()):
        seen["install after the check"] = True
        raise InstallError("stop here")

    monkeypatch.setattr(mapping, "_verify", watched_verify)
    monkeypatch.setattr(mapping, "_build_model", build)
    monkeypatch.setattr(mapping, "_apply_entries", apply)
    _disk(monkeypatch)
    parallel(monkeypatch, 1, 0)
    assert ipc_loader(srv.path).load_model(vllm_config, model_config) == "disk"
    assert seen == {"build started during the check": True, "check started before the build ended": True,
                    "install after the check": True}


def test_a_mismatch_found_beside_the_build_refuses_the_load_and_forgets_the_skeleton(setup, monkeypatch, beside):
    """Corrupt the daemon's memory of ``w``: the load refuses (``fallback: false``) with the checksum's reason, the
    install never runs, and what the skeleton registered is removed; with the fallback, the disk load runs."""
    srv, model_config, vllm_config = setup
    forgotten, installed, built = [], [], []
    forget = mapping._forget_skeleton
    monkeypatch.setattr(mapping, "_build_model", lambda *a: built.append(1) or nn.Module())
    monkeypatch.setattr(mapping, "_apply_entries", lambda *a: installed.append(a))
    monkeypatch.setattr(mapping, "_forget_skeleton", lambda before: (forgotten.append(before), forget(before)))
    _disk(monkeypatch)
    parallel(monkeypatch, 1, 0)
    e = srv.state.manifest.tensors["w"]
    srv.state.segment.buf[e.offset + 8] ^= 0xFF  # inside the first checksum window
    with pytest.raises(FallbackRefused, match=r"tensor 'w' in the daemon's memory does not match its checksum sample"):
        ipc_loader(srv.path, fallback=False).load_model(vllm_config, model_config)
    assert installed == [] and len(built) == len(forgotten) == 1  # built beside the check, then forgotten
    assert ipc_loader(srv.path).load_model(vllm_config, model_config) == "disk"
    assert installed == [] and len(built) == len(forgotten) == 2


def test_a_failed_build_waits_for_the_check_before_the_mapping_is_closed(setup, monkeypatch, beside):
    """The check reads the mapping; a build that fails must not let ``lease.close()`` unmap it under the check."""
    srv, model_config, vllm_config = setup
    release, order = threading.Event(), []
    verify = mapping._verify

    def held_verify(lease, path):
        release.wait(timeout=30)
        verify(lease, path)
        order.append("check done")

    def build(*a):
        release.set()
        raise InstallError("the build failed")

    closing = mapping.MappedLease.close

    def close(self):
        order.append("close")
        closing(self)

    monkeypatch.setattr(mapping, "_verify", held_verify)
    monkeypatch.setattr(mapping, "_build_model", build)
    monkeypatch.setattr(mapping.MappedLease, "close", close)
    _disk(monkeypatch)
    parallel(monkeypatch, 1, 0)
    assert ipc_loader(srv.path).load_model(vllm_config, model_config) == "disk"
    assert order[:2] == ["check done", "close"]


def test_the_report_gives_the_check_and_the_wait_left_after_the_build(setup, monkeypatch, beside):
    srv, model_config, vllm_config = setup
    seen = {}

    def apply(model, tensors, manifest, made=()):
        return {}

    monkeypatch.setattr(mapping, "_build_model", lambda *a: nn.Module())
    monkeypatch.setattr(mapping, "_apply_entries", apply)
    monkeypatch.setattr(mapping, "_reprocess", lambda *a: None)
    real_report = mapping._report

    def report(*a):
        r = real_report(*a)
        seen.update(r.extra)
        return r

    monkeypatch.setattr(mapping, "_report", report)
    parallel(monkeypatch, 1, 0)
    model = ipc_loader(srv.path, fallback=False, mode="copy").load_model(vllm_config, model_config)
    assert isinstance(model, nn.Module)
    assert seen["verify_thread_s"] > 0 and 0 <= seen["verify_s"] <= seen["verify_thread_s"] + 0.05


def test_a_cpu_segment_is_checked_before_the_skeleton_is_built(setup, monkeypatch):
    """The memfd transport (no ``beside``): a corrupt segment is refused before any skeleton is built, and the
    report has no thread time."""
    srv, model_config, vllm_config = setup
    import torch

    assert mapping._verify_beside_build(mapping.get_transport(torch.device("cpu"))) is False
    built = []
    monkeypatch.setattr(mapping, "_build_model", lambda *a: built.append(1) or nn.Module())
    _disk(monkeypatch)
    parallel(monkeypatch, 1, 0)
    e = srv.state.manifest.tensors["w"]
    srv.state.segment.buf[e.offset + 8] ^= 0xFF
    with pytest.raises(FallbackRefused, match=r"tensor 'w' in the daemon's memory does not match its checksum sample"):
        ipc_loader(srv.path, fallback=False).load_model(vllm_config, model_config)
    assert built == []


def test_an_interrupt_during_the_build_is_not_turned_into_a_fallback_by_what_the_check_found(setup, monkeypatch,
                                                                                             beside):
    """From a helper's attack on a375540: Ctrl-C during the build while the check finds a corrupt daemon must stay a
    KeyboardInterrupt (the check's ChecksumMismatch is a CacheUnavailable, which the fallback policy would have
    answered with a disk load)."""
    srv, model_config, vllm_config = setup
    # Python's Ctrl-C handler for this test: a suite started as a background job of a non-interactive shell
    # (`bash -c 'make test &'`) inherits SIGINT ignored, and Python then installs no handler (SIG_IGN stays), so
    # the SIGINT below would be dropped and the build run its 10 s out (how this test failed in two new-user
    # trials, 2026-12-07)
    old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_during_build(srv, model_config, vllm_config, monkeypatch)
    finally:
        signal.signal(signal.SIGINT, old_handler)


def _interrupt_during_build(srv, model_config, vllm_config, monkeypatch):
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, []), "SIGINT blocked in the main thread"
    assert threading.current_thread() is threading.main_thread()
    verify = mapping._verify
    building = threading.Event()
    seen = {}

    def interrupting_verify(lease, path):
        seen["build_began"] = building.wait(timeout=10)
        seen["sent_at"] = time.monotonic()
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(0.3)
        verify(lease, path)

    def build(*a):
        seen["began_at"] = time.monotonic()
        building.set()
        for _ in range(200):
            time.sleep(0.05)
        seen["build_ended"] = True
        return nn.Module()

    monkeypatch.setattr(mapping, "_verify", interrupting_verify)
    monkeypatch.setattr(mapping, "_build_model", build)
    _disk(monkeypatch)
    parallel(monkeypatch, 1, 0)
    e = srv.state.manifest.tensors["w"]
    srv.state.segment.buf[e.offset + 8] ^= 0xFF
    try:
        with pytest.raises(KeyboardInterrupt):
            ipc_loader(srv.path).load_model(vllm_config, model_config)
    except pytest.fail.Exception:
        sent = seen.get("sent_at", 0) - seen.get("began_at", 0)
        pytest.fail(f"no KeyboardInterrupt: the build began {seen.get('build_began')}, SIGINT sent {sent:.3f} s after "
                    f"it began, the build ran to its end {seen.get('build_ended', False)}; SIGINT's handler now "
                    f"{signal.getsignal(signal.SIGINT)!r}")
