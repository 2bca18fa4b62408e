"""The per-rank socket server of the preload daemon: the lock that makes one daemon per device, and the accept loop
with its connection limit over the rank's state (:mod:`.rank`); each accepted connection's conversation (the peer
check, the requests and their answers) is :mod:`.conversation`'s.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import stat
import threading
from pathlib import Path
from typing import Optional

from ...errors import FastloadError
from ...log import logger
from ..wire import messages, protocol
from ..wire.paths import DAEMON_FLAG, SocketDir, SocketDirSpec, file_kind
from .conversation import Conversation, reply
from .rank import Limits, RankState, Throttle, accept_backoff


class RankServer:
    """Serves one rank's segment on its Unix socket (one thread per connection, at most ``max_connections``).

    Connections that are not an attached zero_copy lease must send a complete frame every ``idle_timeout_s``
    seconds (``attach_timeout_s`` between the manifest and the attach, while the engine maps); a frame must arrive
    whole within ``idle_timeout_s`` of its first byte. Every request is validated (:mod:`.messages`) and must fit
    the conversation (attach after the manifest; release after a copy-mode attach); anything else is answered
    with an error frame. The accept loop survives every accept error (logged, with a pause).
    ``sdir``: the opened socket directory (default: ``path``'s directory, opened and checked here); ``limits``:
    the connection limits."""

    def __init__(self, state: RankState, path: Path, sdir: Optional[SocketDir] = None, limits: Limits = Limits()):
        self.state, self.path = state, Path(path)
        self._own_dir = sdir is None
        self.sdir = sdir or SocketDir.open(SocketDirSpec(self.path.parent, "the directory of the socket", DAEMON_FLAG))
        self.limits = limits
        self.sock: Optional[socket.socket] = None
        self.stop = threading.Event()
        # one budget for the request bytes all connections buffer at once (each frame at most MAX_REQUEST_BYTES)
        self.recv_budget = protocol.ByteBudget(protocol.RECV_BUDGET_BYTES)
        self._body: Optional[tuple[messages.Manifest, bytes]] = None  # the manifest's encoded frame (_manifest_body)
        self._body_lock = threading.Lock()
        self._next_id = 0
        self._active = 0
        self._log = Throttle()

    def bind(self) -> None:
        """Create the 0600 listening socket (after the stale-socket check of :func:`acquire`), through the socket
        directory's descriptor."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            s.bind(self.sdir.entry(self.path.name))
        finally:
            os.umask(old)
        os.chmod(self.path.name, 0o600, dir_fd=self.sdir.fd)
        s.listen(64)
        s.settimeout(0.5)
        self.sock = s

    def serve_forever(self) -> None:
        """Accept until :attr:`stop` is set. An accept error (the process's fd limit, out of memory) is logged and
        followed by a pause; then accepting goes on."""
        assert self.sock is not None
        pause = 0.0
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self.stop.is_set():
                    break
                pause = accept_backoff(pause)
                self._log("accept", logging.WARNING, "fastload: accept on %s failed (%s: %s); pausing %.2f s, still "
                          "serving. At the fd limit (EMFILE) raise LimitNOFILE / ulimit -n or lower "
                          "--weight-cache-max-connections", self.path, type(e).__name__, e, pause)
                self.stop.wait(pause)
                continue
            pause = 0.0
            with self.state.lock:
                full = self._active >= self.limits.max_connections
                if not full:
                    self._active += 1
            if full:
                self._refuse_full(conn)
                continue
            try:
                threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
            except RuntimeError as e:  # no thread could be started (a thread limit)
                with self.state.lock:
                    self._active -= 1
                self._log("thread", logging.WARNING, "fastload: cannot start a connection thread (%s); refused one "
                          "connection", e)
                conn.close()

    def _refuse_full(self, conn: socket.socket) -> None:
        """Tell a connection beyond ``max_connections`` why it is closed (without blocking the accept loop)."""
        most = self.limits.max_connections
        reason = (f"the daemon already serves {most} connections (--weight-cache-max-connections); "
                  f"this one is refused: retry later, or raise the limit")
        try:
            conn.settimeout(0.2)
            reply(conn, messages.Error(reason=reason))
        except OSError:
            pass
        conn.close()
        self._log("full", logging.WARNING, "fastload: refused a connection on %s: %d connections open "
                  "(--weight-cache-max-connections %d)", self.path, most, most)

    def _handle(self, conn: socket.socket) -> None:
        """Serve one connection to its end (:class:`.conversation.Conversation`), then count it as closed."""
        with self.state.lock:
            self._next_id += 1
            cid = self._next_id
        try:
            Conversation(conn, cid, self.state, self.limits, self.recv_budget, self._manifest_body, self._log).run()
        finally:
            with self.state.lock:
                self._active -= 1

    def warm(self, manifest: messages.Manifest) -> None:
        """Encode ``manifest``'s frame now (the daemon calls it when its load is done, before it is ready)."""
        self._manifest_body(manifest)

    def _manifest_body(self, manifest: messages.Manifest) -> bytes:
        """The encoded frame of ``manifest``, made once per manifest object: encoding a 100k-tensor manifest takes
        about a second, which every engine's hello would otherwise wait for."""
        with self._body_lock:
            cached = self._body
            if cached is None or cached[0] is not manifest:
                cached = self._body = (manifest, protocol.encode(messages.to_frame(manifest)))
        return cached[1]

    def close(self) -> None:
        """Stop accepting, remove the socket file, free the segment."""
        self.stop.set()
        if self.sock is not None:
            self.sock.close()
        if self.sdir.fd >= 0:
            self.sdir.unlink(self.path.name)
        if self._own_dir:
            self.sdir.close()
        with self.state.lock:
            if self.state.segment is not None:
                self.state.segment.close()
                self.state.segment = None


def lock_name(path: Path) -> str:
    """The name of the lock file of socket ``path`` in its directory."""
    return path.name + ".lock"


def _lock_held(path: Path) -> FastloadError:
    return FastloadError(f"another preload daemon already serves this device (lock {path}.lock is held); stop it "
                         f"first or use another --weight-cache-socket-dir")


def check_lock_free(path: Path, sdir: SocketDir) -> None:
    """Raise the "another preload daemon" error when the lock of socket ``path`` is held now (taken and given back
    at once: a pre-check before anything else binds, such as the health port)."""
    try:
        fd = sdir.open_file(lock_name(path), os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _lock_held(path) from None
    finally:
        os.close(fd)


def acquire(path: Path, sdir: Optional[SocketDir] = None) -> int:
    """Take the per-device lock ``<socket>.lock`` (held for the daemon's life) and clear a stale socket, both
    through the socket directory ``sdir`` (default: ``path``'s directory, opened and checked here).

    Raises :class:`FastloadError` when another daemon holds the lock, a live daemon answers on the socket, or
    something other than a socket (a file, folder or link) sits at its name: that is never removed.
    Returns the lock's file descriptor.
    """
    path = Path(path)
    own = sdir is None
    sdir = sdir or SocketDir.open(SocketDirSpec(path.parent, "the directory of the socket", DAEMON_FLAG))
    try:
        fd = sdir.open_file(lock_name(path), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _lock_held(path) from None
        st = sdir.lstat(path.name)
        if st is not None and not stat.S_ISSOCK(st.st_mode):
            # only a socket is ours to replace: a file, folder or link there is someone's, or a mistake to look at
            os.close(fd)
            raise FastloadError(f"{path} is not a socket (a {file_kind(st.st_mode)}); the daemon will not remove it: "
                                f"move it away, or start the daemon with another --weight-cache-socket-dir")
        if st is not None:
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(2)
            try:
                probe.connect(sdir.entry(path.name))
                os.close(fd)
                raise FastloadError(f"a live daemon answers on {path}; refusing to replace it")
            except (ConnectionRefusedError, FileNotFoundError):
                logger.warning("fastload: removing stale socket %s (no listener)", path)
                sdir.unlink(path.name)
            finally:
                probe.close()
        return fd
    finally:
        if own:
            sdir.close()

