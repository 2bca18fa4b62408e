"""Beside vLLM's own weight cache (issue 27, item 9): vLLM >= 0.31 ships its own `vllm preload` daemon (sockets
`vllm_weight_cache_<hash>.sock` in `$TMPDIR/vllm_weight_cache_<uid>`, 8-byte length + pickle frames). With this
plugin installed `--load-format ipc_cache` is ours; an engine that finds only upstream's socket says so in one line
with the command to run instead, and never unpickles what such a socket sends."""

import os
import pickle
import socket
import struct
import threading

import pytest

from tests.conftest import make_fingerprint
from vllm_fastload.errors import CacheUnavailable
from vllm_fastload.ipc.engine.mapping import fetch


def upstream_daemon(path):
    """A stand-in for upstream's daemon: answers any request with a pickled dict in its framing. It reads the
    request first, as a daemon does: one that closed before the request arrived would make the engine's send fail
    (EPIPE) before it could read the answer, a race and not what this test is about."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(4)

    def serve():
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return
            try:
                c.recv(65536)
            except OSError:
                pass
            payload = pickle.dumps({"status": "ok", "handles": []})
            c.sendall(struct.pack("!Q", len(payload)) + payload)
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    return s


@pytest.fixture
def short_tmp():
    """A short directory under /tmp (Unix socket paths stop at 107 bytes; pytest's tmp_path is long)."""
    import shutil
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp(prefix="flup", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_only_an_upstream_socket_beside_ours_is_named_with_the_command(short_tmp, monkeypatch):
    import tempfile

    tmp_path = short_tmp
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # upstream's default directory is under the temp dir
    theirs = tmp_path / f"vllm_weight_cache_{os.getuid()}"
    theirs.mkdir(mode=0o700)
    up = upstream_daemon(theirs / "vllm_weight_cache_0123abcd.sock")
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    try:
        with pytest.raises(CacheUnavailable) as e:
            fetch(str(ours / "gpu-x-r0-target.sock"), make_fingerprint().to_dict(), 0.3, 5)
    finally:
        up.close()
    msg = str(e.value)
    assert "found 1 socket(s) of vLLM's own weight-cache daemon (`vllm preload`" in msg
    assert str(theirs / "vllm_weight_cache_0123abcd.sock") in msg
    assert "run `vllm-fastload preload <same engine args>` instead of `vllm preload`" in msg and "VLLM_PLUGINS" in msg


def test_an_upstream_daemon_on_our_path_is_refused_without_unpickling(tmp_path):
    d = tmp_path / "socks"
    d.mkdir(mode=0o700)
    path = d / "gpu-x-r0-target.sock"
    up = upstream_daemon(path)
    try:
        with pytest.raises(CacheUnavailable, match=r"does not speak vllm-fastload's protocol .* uses pickle frames, "
                                                   r"which this loader never reads; start `vllm-fastload preload`"):
            fetch(str(path), make_fingerprint().to_dict(), 1, 5)
    finally:
        up.close()


def test_no_socket_at_all_says_nothing_about_upstream(tmp_path):
    d = tmp_path / "socks"
    d.mkdir(mode=0o700)
    with pytest.raises(CacheUnavailable) as e:
        fetch(str(d / "gpu-x-r0-target.sock"), make_fingerprint().to_dict(), 0.2, 5)
    assert "no preload daemon at" in str(e.value) and "vllm preload" not in str(e.value)


def test_a_daemon_that_closed_before_reading_hello_is_still_named_by_what_it_sent():
    """An upstream daemon that answers and closes before the engine's hello arrives: the engine's send fails
    (EPIPE), and what the daemon sent before closing still says who it is (pickle frames, never unpickled)."""
    from vllm_fastload.ipc.wire.client import _hello

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    payload = pickle.dumps({"status": "ok", "handles": []})
    theirs.sendall(struct.pack("!Q", len(payload)) + payload)
    theirs.close()
    try:
        with pytest.raises(CacheUnavailable, match=r"does not speak vllm-fastload's protocol .* uses pickle frames"):
            _hello(ours, "/x/gpu-x-r0-target.sock", make_fingerprint().to_dict(), 1, 5)
    finally:
        ours.close()


def test_a_daemon_that_closed_without_a_word_is_said_to_have_closed():
    from vllm_fastload.ipc.wire.client import _hello

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.close()
    try:
        with pytest.raises(CacheUnavailable, match="closed the connection before sending the manifest"):
            _hello(ours, "/x/gpu-x-r0-target.sock", make_fingerprint().to_dict(), 1, 5)
    finally:
        ours.close()
