"""The daemon's socket server and the client, without vLLM: protocol, fingerprint check, reference counting."""

import os
import pickle
import socket
import threading
from pathlib import Path

import pytest
import torch

from tests.conftest import make_fingerprint as fingerprint
from tests.conftest import unix_listener
from tests.unit.ipc_fake_daemon import make_state
from vllm_fastload.errors import FastloadError
from vllm_fastload.ipc.daemon.server import RankServer, acquire
from vllm_fastload.ipc.engine.mapping import fetch
from vllm_fastload.ipc.memory.layout import view_at
from vllm_fastload.ipc.wire import protocol
from vllm_fastload.ipc.wire.client import CacheUnavailable, FingerprintMismatch, status_of


@pytest.fixture
def server(tmp_path):
    w = torch.arange(1000, dtype=torch.float32)
    fp = fingerprint()
    path = tmp_path / "dev-target.sock"
    lock = acquire(path)
    st = make_state(path, fp, {"w": w})
    assert st.nbytes == 4000 and st.ready.is_set()
    srv = RankServer(st, path)
    srv.bind()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, fp, w
    srv.close()
    os.close(lock)


def test_fetch_maps_the_bytes_and_status_counts_clients(server):
    srv, fp, w = server
    lease = fetch(str(srv.path), fp.to_dict(), 2, 5)
    got = view_at(lease.segment.buf, lease.manifest.tensors["w"])
    assert torch.equal(got, w)
    assert lease.attach("zero_copy") == 1
    st = status_of(str(srv.path))
    assert st.clients == 1 and st.client_modes == ["zero_copy"] and st.attaches == 1
    lease.close()


def test_mismatch_lists_fields_and_is_counted(server):
    srv, fp, _ = server
    with pytest.raises(FingerprintMismatch) as e:
        fetch(str(srv.path), fingerprint(tp_size=2, tp_rank=1).to_dict(), 2, 5)
    assert e.value.mismatched == [["tp_size", 1, 2], ["tp_rank", 0, 1]]
    assert status_of(str(srv.path)).fingerprint_mismatches == 1


def test_copy_release_never_frees_memory_a_zero_copy_client_maps(server):
    srv, fp, w = server
    zc = fetch(str(srv.path), fp.to_dict(), 2, 5)
    zc.attach("zero_copy")
    cp = fetch(str(srv.path), fp.to_dict(), 2, 5)
    cp.attach("copy")
    assert cp.release() is False  # a zero_copy client still maps it
    cp.close()
    assert torch.equal(view_at(zc.segment.buf, zc.manifest.tensors["w"]), w)
    zc.close()
    cp2 = fetch(str(srv.path), fp.to_dict(), 2, 5)
    cp2.attach("copy")
    import time

    for _ in range(50):  # the zero_copy client's disconnect is seen by the daemon's connection thread
        if status_of(str(srv.path)).client_modes == ["copy"]:
            break
        time.sleep(0.05)
    assert cp2.release() is True
    cp2.close()
    st = status_of(str(srv.path))
    assert st.state == "released" and st.bytes == 0
    with pytest.raises(CacheUnavailable, match="released by a copy-mode client"):
        fetch(str(srv.path), fp.to_dict(), 2, 5)


def test_no_daemon_fails_within_connect_timeout(tmp_path):
    import time

    t = time.monotonic()
    with pytest.raises(CacheUnavailable, match="no preload daemon at .* within 0.5 s"):
        fetch(str(tmp_path / "none.sock"), {}, 0.5, 5)
    assert time.monotonic() - t < 5


def test_a_pickle_speaking_daemon_is_named(tmp_path):
    path = tmp_path / "upstream.sock"
    s = unix_listener(path)

    def serve():
        c, _ = s.accept()
        c.recv(65536)
        payload = pickle.dumps({"state": "x"})
        c.sendall(len(payload).to_bytes(4, "big") + payload)
        c.close()

    threading.Thread(target=serve, daemon=True).start()
    with pytest.raises(CacheUnavailable, match="pickle frames.*vllm-fastload preload"):
        fetch(str(path), fingerprint().to_dict(), 2, 5)
    s.close()


def test_a_daemon_of_another_protocol_version_is_named_with_both_versions(tmp_path):
    """The engine checks the manifest's version before its fields (they may differ between versions) and says
    which version each side speaks."""
    path = tmp_path / "old.sock"
    s = unix_listener(path)
    old = protocol.PROTOCOL_VERSION - 1

    def serve():
        c, _ = s.accept()
        protocol.recv(c)
        protocol.send(c, {"type": "manifest", "version": old, "fields": "of another version"})
        c.close()

    threading.Thread(target=serve, daemon=True).start()
    with pytest.raises(CacheUnavailable, match=f"protocol version mismatch: the daemon speaks version {old}, this "
                                               f"engine version {protocol.PROTOCOL_VERSION}; run the same"):
        fetch(str(path), fingerprint().to_dict(), 2, 5)
    s.close()


def test_second_lock_holder_is_refused(server):
    srv, _, _ = server
    with pytest.raises(FastloadError, match="another preload daemon already serves this device"):
        acquire(srv.path)


def test_stale_socket_is_replaced(tmp_path):
    path = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # file left behind, nobody listening
    fd = acquire(path)
    assert not path.exists()
    os.close(fd)


def test_oversized_frame_is_rejected():
    a, b = socket.socketpair()
    a.sendall((protocol.MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
    with pytest.raises(protocol.ProtocolError, match="frame of"):
        protocol.recv(b)
    a.close()
    b.close()


def test_engine_connecting_during_the_load_waits_bounded_by_state_timeout(server):
    import time

    srv, fp, w = server
    srv.state.ready.clear()
    srv.state.loading = True
    assert status_of(str(srv.path)).state == "loading"
    with pytest.raises(CacheUnavailable, match=r"was still loading after 0.3 s \(state_timeout_s\)"):
        fetch(str(srv.path), fp.to_dict(), 2, 0.3)  # the daemon said "loading" at once: not "not answering"
    threading.Timer(0.5, srv.state.ready.set).start()
    t = time.monotonic()
    lease = fetch(str(srv.path), fp.to_dict(), 2, 10)
    assert time.monotonic() - t >= 0.4
    assert torch.equal(view_at(lease.segment.buf, lease.manifest.tensors["w"]), w)
    lease.close()


def test_eight_clients_attach_at_once_all_correct_and_counted(server):
    srv, fp, w = server
    results, errors = [], []

    def client():
        try:
            lease = fetch(str(srv.path), fp.to_dict(), 5, 10)
            lease.attach("zero_copy")
            results.append((lease, torch.equal(view_at(lease.segment.buf, lease.manifest.tensors["w"]), w)))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and len(results) == 8 and all(ok for _, ok in results)
    st = status_of(str(srv.path))
    assert st.clients == 8 and st.attaches == 8
    for lease, _ in results:
        lease.close()


@pytest.mark.parametrize("problem", ["group-writable", "world-writable", "other-owner"])
def test_socket_dir_must_be_private(tmp_path, problem):
    from vllm_fastload.ipc.wire.paths import ensure_socket_dir

    d = tmp_path / "socks"
    d.mkdir(mode=0o700)
    if problem == "group-writable":
        os.chmod(d, 0o770)
        match = "writable by group or others.*chmod 700"
    elif problem == "world-writable":
        os.chmod(d, 0o707)
        match = "writable by group or others.*chmod 700"
    else:
        if os.getuid() != 0:
            pytest.skip("needs root to chown")
        os.chown(d, 65534, 65534)
        match = "owned by uid 65534, not by this user"
    with pytest.raises(FastloadError, match=match):
        ensure_socket_dir(str(d))


def test_a_socket_path_longer_than_unix_allows_is_named_with_the_fix(tmp_path):
    """GPU sockets are named by UUID (~40 chars): a long socket dir must fail clearly, not with 'AF_UNIX path too
    long'."""
    import tempfile

    from vllm_fastload.errors import FastloadError
    from vllm_fastload.ipc.wire.paths import MAX_SOCKET_PATH, socket_path

    ident = "gpu-GPU-b92c24e2-f10f-0ceb-9335-6cf88fa62a98"
    short = Path(tempfile.mkdtemp(prefix="fl", dir="/tmp"))
    ok = socket_path(short, ident)
    assert len(str(ok)) <= MAX_SOCKET_PATH
    deep = tmp_path / ("d" * (MAX_SOCKET_PATH - len(str(tmp_path))))
    with pytest.raises(FastloadError,
                       match=r"socket path .* is \d+ bytes; Unix sockets allow 107.*socket dir of at most \d+ bytes"):
        socket_path(deep, ident)
    s = socket.socket(socket.AF_UNIX)  # and the limit is the kernel's: the longest accepted path binds
    edge = short / ("e" * (MAX_SOCKET_PATH - len(str(short)) - 1))
    try:
        s.bind(str(edge))
    finally:
        s.close()
        edge.unlink()
        short.rmdir()


def test_preload_with_a_too_long_socket_dir_fails_at_once_and_creates_nothing(tmp_path, capsys, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_fastload.cli import main as cli_main

    def no_config(self):
        raise AssertionError("the socket path must be checked before vLLM's config setup")

    monkeypatch.setattr(EngineArgs, "create_engine_config", no_config)
    d = tmp_path / ("x" * 100)
    assert cli_main(["preload", "--model", str(tmp_path), "--weight-cache-socket-dir", str(d)]) == 2
    err = capsys.readouterr().err
    assert "Unix sockets allow 107" in err and "use a socket dir of at most" in err
    assert not d.exists()
