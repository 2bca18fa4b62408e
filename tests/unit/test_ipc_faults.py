"""Weight-cache faults on the CPU transport: a daemon killed during the hand-over, a client gone mid-transfer, a
daemon restarted under an attached engine. Real RankServer, real client; a daemon that must die runs in its own
process (tests/unit/ipc_fake_daemon.py) and is stopped by the PID this test started."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import unix_listener
from tests.unit.ipc_fake_daemon import fingerprint, make_state, weights
from vllm_fastload.errors import FastloadError
from vllm_fastload.ipc.daemon.server import RankServer, acquire
from vllm_fastload.ipc.engine.mapping import _Phases, fetch
from vllm_fastload.ipc.memory.layout import view_at
from vllm_fastload.ipc.wire import protocol
from vllm_fastload.ipc.wire.client import CacheUnavailable, status_of
from vllm_fastload.ipc.wire.messages import to_frame
from vllm_fastload.servers import ManagedProcess

REPO = Path(__file__).resolve().parents[2]
FP = fingerprint().to_dict()


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def wait_for(pred, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


@contextlib.contextmanager
def child(argv: list[str], log: Path, ready: str = "ready"):
    """A python child (repo on its path) stopped by its PID at the end, also when the test fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    p = ManagedProcess([sys.executable, *argv], log, env=env)
    try:
        assert wait_for(lambda: ready in p.log() or not p.alive(), 60), p.log()
        assert p.alive() or ready in p.log(), p.log()
        yield p
    finally:
        p.stop(5)


def fake_daemon(sock: Path, tmp_path: Path, *args: str, name: str = "daemon"):
    return child(["-m", "tests.unit.ipc_fake_daemon", str(sock), *args], tmp_path / f"{name}.log")


@pytest.fixture
def thread_errors(monkeypatch):
    """Exceptions that escaped any thread (the daemon's connection handlers) during the test."""
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    return errors


@pytest.fixture
def big_server(tmp_path):
    """The real RankServer in this process with a ~1 MB manifest (8000 tensors): larger than a Unix socket's
    buffers, so sending it blocks until the client reads."""
    path = tmp_path / "big.sock"
    lock = acquire(path)
    srv = RankServer(make_state(path, fingerprint(), weights(8000)), path)
    srv.bind()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.close()
    os.close(lock)


# --- (a) the daemon dies or stalls during the manifest transfer -------------------------------------------------
def test_daemon_killed_mid_manifest_is_named_quickly_and_leaks_no_fd(tmp_path):
    sock = tmp_path / "half.sock"
    with fake_daemon(sock, tmp_path, "--half-manifest") as d:
        before = open_fds()
        t = time.monotonic()
        with pytest.raises(CacheUnavailable) as e:
            fetch(str(sock), FP, 5, 30)
        took = time.monotonic() - t
        after = open_fds()
        d.proc.wait(10)
        assert d.proc.returncode == -signal.SIGKILL
    msg = str(e.value)
    assert f"daemon at {sock} closed the connection before sending the manifest (connection closed after" in msg
    assert "killed during the hand-over" in msg
    assert took < 5  # noticed at the close, not at state_timeout_s (30 s)
    assert after == before  # neither the socket nor the segment fd that came with the first bytes


def test_daemon_stalled_mid_manifest_is_not_answering_and_leaks_no_fd(tmp_path):
    path = tmp_path / "stall.sock"
    s = unix_listener(path)
    memfd = os.memfd_create("fake-segment")
    release = threading.Event()
    body = json.dumps(to_frame(make_state(path, fingerprint(), weights(200)).manifest)).encode()
    server_end: list[str] = []

    def stall():
        c, _ = s.accept()
        server_end.append(str(c.fileno()))
        try:
            protocol.recv(c)
            socket.send_fds(c, [len(body).to_bytes(4, "big") + body[:100]], [memfd])
        except OSError:  # on a loaded machine this thread may run after the client's 1 s ran out and it left
            pass
        release.wait(30)
        c.close()

    th = threading.Thread(target=stall, daemon=True)
    th.start()
    try:
        before = open_fds()
        t = time.monotonic()
        with pytest.raises(CacheUnavailable, match=f"daemon at {path} is not answering: it accepted the connection "
                                                   f"but sent no complete reply to hello within 1 s"):
            fetch(str(path), FP, 1, 30)
        assert time.monotonic() - t < 3  # connect_timeout_s, not state_timeout_s (30 s)
        # the fake daemon's accept may come after the client gave up (a loaded machine; CI saw it): wait for it
        assert wait_for(lambda: bool(server_end))
        assert open_fds() - before == set(server_end)  # only the fake daemon's end of the connection
    finally:
        release.set()
        th.join(10)
        s.close()
        os.close(memfd)


def test_daemon_killed_between_manifest_and_attach_is_cache_unavailable(tmp_path):
    sock = tmp_path / "d.sock"
    with fake_daemon(sock, tmp_path) as d:
        lease = fetch(str(sock), FP, 5, 10)
        os.kill(d.pid, signal.SIGKILL)
        d.proc.wait(10)
        with pytest.raises(CacheUnavailable, match=f"daemon at {sock} went away before the attach"):
            lease.attach("zero_copy")
        # what was mapped stays readable and correct
        assert torch.equal(view_at(lease.segment.buf, lease.manifest.tensors["w"]), weights()["w"])
        lease.close()


# --- (b) a client goes away mid-transfer -----------------------------------------------------------------------
def test_client_gone_mid_manifest_leaves_the_daemon_serving_others(big_server, records, thread_errors):
    srv = big_server
    before = open_fds()
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(str(srv.path))
    protocol.send(c, {"type": "hello", "version": protocol.PROTOCOL_VERSION, "fingerprint": FP,
                      "pid": os.getpid()})
    data, fds, _, _ = socket.recv_fds(c, 4096, 4)
    assert len(data) > 0 and len(fds) == 1  # the segment came with the first bytes
    os.close(fds[0])
    c.close()  # gone, with ~1 MB of the manifest unread
    assert wait_for(lambda: any("disconnected while the daemon was sending" in r.getMessage() for r in records))
    assert wait_for(lambda: open_fds() == before), "the daemon did not close its end"
    assert thread_errors == []
    st = status_of(str(srv.path))
    assert st.clients == 0 and st.state == "ready"
    phases = _Phases()
    lease = fetch(str(srv.path), FP, 2, 10, phases=phases)
    assert set(phases) == {"lease_s", "map_s"} and phases["lease_s"] > 0  # the seconds of its two steps
    assert lease.attach("zero_copy") == 1
    assert torch.equal(view_at(lease.segment.buf, lease.manifest.tensors["w"]), weights()["w"])
    assert len(lease.manifest.tensors) == 8001
    lease.close()
    assert wait_for(lambda: status_of(str(srv.path)).clients == 0)


def test_attached_client_killed_is_no_longer_counted(big_server, tmp_path, thread_errors):
    srv = big_server
    code = ("import json, sys, time; from vllm_fastload.ipc.engine.mapping import fetch; "
            "l = fetch(sys.argv[1], json.loads(sys.argv[2]), 5, 30); l.attach('zero_copy'); "
            "print('attached', flush=True); time.sleep(600)")
    with child(["-c", code, str(srv.path), json.dumps(FP)], tmp_path / "client.log", ready="attached") as p:
        st = status_of(str(srv.path))
        assert st.clients == 1 and st.client_modes == ["zero_copy"]
        os.kill(p.pid, signal.SIGKILL)
        p.proc.wait(10)
        assert wait_for(lambda: status_of(str(srv.path)).clients == 0)
    assert thread_errors == []
    lease = fetch(str(srv.path), FP, 2, 10)
    assert lease.attach("zero_copy") == 1
    lease.close()


# --- (c) the daemon is restarted while an engine is attached -------------------------------------------------------
def test_attached_engine_warns_when_its_daemon_goes_away_and_keeps_its_copy(tmp_path, records):
    sock = tmp_path / "r.sock"
    with fake_daemon(sock, tmp_path, name="first") as d:
        lease = fetch(str(sock), FP, 5, 10)
        assert lease.attach("zero_copy") == 1
        assert not [r for r in records if r.levelno >= logging.WARNING]
        os.kill(d.pid, signal.SIGKILL)
        d.proc.wait(10)

        def warned():
            return [r for r in records if r.levelno == logging.WARNING and "went away" in r.getMessage()]

        assert wait_for(warned, 5), [r.getMessage() for r in records]
        msg = warned()[0].getMessage()
        assert f"the preload daemon at {sock} went away" in msg
        assert "keeps serving its mapped copy of the weights" in msg
        assert "a second copy of the weights on this device" in msg
        assert warned()[0].name == "vllm.fastload"
    # restarted daemon (same socket: the stale one is replaced); the old mapping is untouched
    with fake_daemon(sock, tmp_path, name="second"):
        assert torch.equal(view_at(lease.segment.buf, lease.manifest.tensors["w"]), weights()["w"])
        lease2 = fetch(str(sock), FP, 5, 10)
        assert lease2.attach("zero_copy") == 1  # the first engine is not a client of the new daemon
        n = len(warned())
        lease2.close()  # our own close is not a daemon going away
        time.sleep(0.3)
        assert len(warned()) == n
    lease.close()


def test_a_stalled_client_does_not_block_other_clients(big_server):
    """A client that stops reading mid-manifest must not hold the daemon's state lock (status, attach and hello of
    everyone else would wait until it dies)."""
    srv = big_server
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stalled.connect(str(srv.path))
    try:
        protocol.send(stalled, {"type": "hello", "version": protocol.PROTOCOL_VERSION, "fingerprint": FP,
                                "pid": os.getpid()})
        time.sleep(0.5)  # the daemon is now blocked sending ~1 MB nobody reads
        st = status_of(str(srv.path), timeout_s=3)
        assert st is not None and st.state == "ready"
    finally:
        stalled.close()  # unblocks the daemon (EPIPE)


def test_a_frozen_daemon_is_not_answering_after_connect_timeout_not_state_timeout(tmp_path):
    """Issue 27, item 3: a SIGSTOPped daemon's socket still accepts (the kernel's backlog), so connecting succeeds;
    the engine must not wait state_timeout_s (300 s by default) for it, but say "not answering" after
    connect_timeout_s, as `vllm-fastload status` does. Stands in: a listener nobody accepts from."""
    path = tmp_path / "frozen.sock"
    s = unix_listener(path, backlog=8)
    try:
        t = time.monotonic()
        with pytest.raises(CacheUnavailable, match=r"is not answering: .* within 1 s \(connect_timeout_s\); a stopped "
                                                   r"\(SIGSTOP\) or hung process holds the socket"):
            fetch(str(path), FP, 1, 60)
        assert time.monotonic() - t < 5
    finally:
        s.close()


@pytest.mark.parametrize("make,kind", [(lambda p: p.write_text("data"), "a regular file"),
                                       (lambda p: p.mkdir(), "a directory")])
def test_the_daemon_never_removes_what_is_not_a_socket_at_its_name(tmp_path, make, kind):
    """A regular file at the socket's name was deleted as a "stale socket", a folder raised IsADirectoryError
    (adversarial pass, 2026-12-02): only a socket without a listener is removed."""
    d = tmp_path / "s"
    d.mkdir(mode=0o700)
    make(d / "cpu-r0.sock")
    with pytest.raises(FastloadError, match=rf"cpu-r0.sock is not a socket \({kind}\); the daemon will not remove "
                                            rf"it: move it away, or start the daemon with another "
                                            rf"--weight-cache-socket-dir"):
        acquire(d / "cpu-r0.sock")
    assert (d / "cpu-r0.sock").exists()
    assert fcntl_free(d / "cpu-r0.sock.lock")


def fcntl_free(lock: Path) -> bool:
    """The per-device lock is not left held by the refused start."""
    import fcntl

    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
