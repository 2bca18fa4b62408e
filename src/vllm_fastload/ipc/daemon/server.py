"""The per-rank socket server of the preload daemon: the lock that makes one daemon per device, the peer check,
and the conversation with each engine (:mod:`.messages` validates every request, :mod:`.protocol` frames them).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ...errors import FastloadError
from ...log import logger
from ..memory.transport import Segment
from ..wire import messages, protocol
from ..wire.paths import DAEMON_FLAG, SocketDir, SocketDirSpec, file_kind


@dataclass
class RankState:
    """What one rank serves and who uses it (guarded by ``lock``)."""

    fingerprint: dict
    segment: Optional[Segment]
    manifest: Optional[messages.Manifest]
    model: str
    device: str
    socket: str
    load_s: float
    nbytes: int
    started: float = field(default_factory=time.time)
    clients: dict = field(default_factory=dict)  # connection id -> mode
    attaches: int = 0
    mismatches: int = 0
    released: bool = False
    loading: bool = False
    ready: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def status(self) -> messages.StatusReply:
        """The ``status`` reply (``vllm-fastload status``, ``/health``, ``/metrics``)."""
        with self.lock:
            man = self.manifest
            return messages.StatusReply(
                model=self.model, device=self.device, socket=self.socket, fingerprint=self.fingerprint,
                fingerprint_short=man.fingerprint_short if man else None,
                content_digest=man.content_digest if man else None, tensors=len(man.tensors) if man else 0,
                bytes=self.nbytes if not self.released else 0,
                state="loading" if self.loading else "released" if self.released else "ready",
                clients=len(self.clients), client_modes=sorted(self.clients.values()), attaches=self.attaches,
                fingerprint_mismatches=self.mismatches, load_seconds=round(self.load_s, 3),
                uptime_s=round(time.time() - self.started, 1), pid=os.getpid())


#: Defaults of the connection limits (flags ``--weight-cache-max-connections``, ``-idle-timeout-s``,
#: ``-attach-timeout-s``).
MAX_CONNECTIONS = 256
IDLE_TIMEOUT_S = 30.0
ATTACH_TIMEOUT_S = 600.0
@dataclass(frozen=True)
class Limits:
    """The daemon's connection limits (flags ``--weight-cache-max-connections``, ``--weight-cache-idle-timeout-s``,
    ``--weight-cache-attach-timeout-s``): per server (each rank's socket, the health port), seconds."""

    max_connections: int = MAX_CONNECTIONS
    idle_timeout_s: float = IDLE_TIMEOUT_S
    attach_timeout_s: float = ATTACH_TIMEOUT_S


#: Longest pause of an accept loop after an accept error (EMFILE: the fd limit is reached).
MAX_ACCEPT_BACKOFF_S = 1.0


class Throttle:
    """At most one log line per ``key`` every ``every_s`` seconds; the lines in between are counted and the next
    one says how many were left out (a flood of bad clients must not flood the log)."""

    def __init__(self, every_s: float = 10.0):
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, key: str, level: int, fmt: str, *args: Any) -> None:
        """Log ``fmt % args`` at ``level`` unless a line of ``key`` was logged less than ``every_s`` ago."""
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -1e9) < self.every_s:
                self._skipped[key] = self._skipped.get(key, 0) + 1
                return
            self._last[key] = now
            skipped = self._skipped.pop(key, 0)
        if skipped:
            fmt += " (%d more like this in the last %g s)"
            args = (*args, skipped, self.every_s)
        logger.log(level, fmt, *args)


def accept_backoff(previous: float) -> float:
    """The pause after an accept error: doubling from 50 ms up to :data:`MAX_ACCEPT_BACKOFF_S`. The pending
    connection that failed to be accepted stays in the backlog, so without a pause the loop would spin."""
    return min(MAX_ACCEPT_BACKOFF_S, max(0.05, previous * 2))


@dataclass
class _Client:
    """One connection's place in the conversation: who it is (``SO_PEERCRED``), whether it got the manifest, in
    which mode it attached and whether it released the cache (copy mode, at most once)."""

    cid: int
    pid: int
    uid: int
    got_manifest: bool = False
    mode: Optional[messages.Mode] = None
    released: bool = False


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
            _reply(conn, messages.Error(reason=reason))
        except OSError:
            pass
        conn.close()
        self._log("full", logging.WARNING, "fastload: refused a connection on %s: %d connections open "
                  "(--weight-cache-max-connections %d)", self.path, most, most)

    def _timeout_for(self, c: _Client) -> Optional[float]:
        """How long the daemon waits for this connection's next frame."""
        if c.mode == "zero_copy":
            return None  # the connection is the lease: open as long as the engine maps the memory
        if c.got_manifest and c.mode is None:
            return self.limits.attach_timeout_s
        return self.limits.idle_timeout_s

    def _handle(self, conn: socket.socket) -> None:
        st = self.state
        with st.lock:
            self._next_id += 1
            c = _Client(self._next_id, -1, -1)
        try:
            c.pid, c.uid, _ = protocol.peer_credentials(conn)
            if c.uid not in (os.getuid(), 0):
                self._log("peer", logging.WARNING, "fastload: refused a connection from pid %d running as uid %d (not "
                          "the daemon's uid %d, nor root)", c.pid, c.uid, os.getuid())
                conn.settimeout(1.0)
                _reply(conn, messages.Error(reason=f"peer uid {c.uid} is not the daemon's uid "
                                     f"{os.getuid()} (or root); run the engine as the same user as "
                                     f"`vllm-fastload preload`"))
                return
            while self._serve_one(conn, c):
                pass
        except OSError as e:  # the client went away while we were sending (killed mid-transfer): not our failure
            logger.info("fastload: client %d disconnected while the daemon was sending to it (%s: %s); still serving",
                        c.cid, type(e).__name__, e)
        except Exception as e:  # noqa: BLE001 - a bug handling one client must not take the daemon down
            logger.exception("fastload: internal error serving client %d (pid %d); closed its connection", c.cid, c.pid)
            try:
                _reply(conn, messages.Error(reason=f"internal error in the daemon ({type(e).__name__}: "
                                     f"{e}); see its log"))
            except OSError:
                pass
        finally:
            with st.lock:
                was = st.clients.pop(c.cid, None)
                self._active -= 1
                left = len(st.clients)
            if was is not None:
                logger.info("fastload: client %d (pid %d, %s mode) detached; %d engine(s) attached", c.cid, c.pid, was,
                            left)
            conn.close()

    def _serve_one(self, conn: socket.socket, c: _Client) -> bool:
        """Receive and answer one frame of client ``c``. Returns False when the connection is done."""
        raw = self._receive(conn, c)
        if raw is None:
            return False
        try:
            msg = messages.parse_request(raw)
        except messages.MessageError as e:
            self._log("invalid", logging.WARNING, "fastload: client %d (pid %d) sent an invalid message: %s",
                      c.cid, c.pid, e)
            _reply(conn, messages.Error(reason=str(e)))
            return True
        if isinstance(msg, messages.Status):
            _reply(conn, self.state.status())
        elif isinstance(msg, messages.Hello):
            if self._hello(conn, msg):
                c.got_manifest = True
        elif isinstance(msg, messages.Attach):
            self._attach(conn, c, msg)
        elif isinstance(msg, messages.Release):
            self._answer_release(conn, c)
        else:  # bye
            return False
        return True

    def _receive(self, conn: socket.socket, c: _Client) -> Optional[dict[str, Any]]:
        """The next frame of client ``c`` (fds it carried closed), or None when the connection is done: the client
        closed it, or sent no complete frame in time or a bad one (answered with an error frame, logged)."""
        timeout = self._timeout_for(c)
        conn.settimeout(timeout)
        try:
            raw, fds = protocol.recv(conn, frame_timeout_s=self.limits.idle_timeout_s,
                                     limit=protocol.MAX_REQUEST_BYTES, budget=self.recv_budget)
        except TimeoutError:
            what = "between the manifest and the attach (--weight-cache-attach-timeout-s)" if timeout == \
                self.limits.attach_timeout_s and c.got_manifest else "(--weight-cache-idle-timeout-s)"
            self._log("idle", logging.INFO, "fastload: closed client %d (pid %d): no complete frame within %g s %s",
                      c.cid, c.pid, timeout or self.limits.idle_timeout_s, what)
            conn.settimeout(1.0)
            _reply(conn, messages.Error(reason=f"no complete frame within {timeout or self.limits.idle_timeout_s:g}"
                                 f" s {what}; closing the connection"))
            return None
        except protocol.PeerClosed:
            return None
        except protocol.ProtocolError as e:
            self._log("frame", logging.WARNING, "fastload: closed client %d (pid %d): %s", c.cid, c.pid, e)
            conn.settimeout(1.0)
            _reply(conn, messages.Error(reason=f"bad frame: {e}; closing the connection"))
            return None
        protocol.close_fds(fds)
        return raw

    def _attach(self, conn: socket.socket, c: _Client, msg: messages.Attach) -> None:
        """Answer client ``c``'s attach: counted in ``msg.mode`` after the manifest, at most once; else refused."""
        if not c.got_manifest or c.mode is not None:
            why = "attach before this connection received the manifest (send hello first)" if not c.got_manifest \
                else f"this connection is already attached ({'released' if c.released else c.mode})"
            _reply(conn, messages.Error(reason=f"attach refused: {why}"))
            return
        st = self.state
        c.mode = msg.mode
        with st.lock:
            st.clients[c.cid] = msg.mode
            st.attaches += 1
            n = len(st.clients)
        logger.info("fastload: client %d (pid %d, uid %d) attached in %s mode; %d engine(s) attached", c.cid, c.pid,
                    c.uid, msg.mode, n)
        _reply(conn, messages.Attached(clients=n))

    def _answer_release(self, conn: socket.socket, c: _Client) -> None:
        """Answer client ``c``'s release: only once, after a copy-mode attach (:meth:`_release`); else refused."""
        if c.mode != "copy" or c.released:
            self._log("release", logging.WARNING, "fastload: refused a release from client %d (pid %d, uid %d): "
                      "only a connection that received the manifest and attached in copy mode may release",
                      c.cid, c.pid, c.uid)
            _reply(conn, messages.Error(reason="release refused: only a connection that received "
                                 "the manifest and attached in copy mode may release the daemon's memory"))
            return
        _reply(conn, messages.Released(freed=self._release(c)))
        c.released = True

    def _hello(self, conn: socket.socket, msg: messages.Hello) -> bool:
        """Answer a valid hello with the manifest (True) or an error (False)."""
        from ...fingerprint import Fingerprint

        st = self.state
        if not st.ready.is_set():
            # at once, so the engine tells "busy loading" (wait up to its state_timeout_s) from "not answering"
            # (a stopped or hung daemon: nothing within its connect_timeout_s)
            _reply(conn, st.status())
        st.ready.wait()  # an engine that connects while the daemon loads waits (bounded by its state_timeout_s)
        theirs = msg.to_fingerprint()
        mine = Fingerprint.from_dict(st.fingerprint)
        diff = mine.mismatched_fields(theirs)
        if diff:
            with st.lock:
                st.mismatches += 1
            logger.warning("fastload: refused client pid %s (it falls back to disk): fingerprint mismatch: %s",
                           msg.pid, mine.explain(theirs))
            _reply(conn, messages.Error(reason="fingerprint mismatch: " + mine.explain(theirs),
                                 mismatched=[[n, a, b] for n, a, b in diff]))
            return False
        # Take what to send under the lock, send outside it: a client that stops reading must not block the
        # status, attach and hello of every other client.
        with st.lock:
            seg = st.segment
            fd = -1 if st.released or seg is None else os.dup(seg.fd)
            manifest = st.manifest
        if fd < 0:
            _reply(conn, messages.Error(reason="the daemon's cache was released by a copy-mode "
                                 "client; restart `vllm-fastload preload` to fill it again"))
            return False
        try:
            protocol.send_body(conn, self._manifest_body(manifest), fds=[fd])
        finally:
            os.close(fd)
        return True

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

    def _release(self, c: _Client) -> bool:
        """Copy-mode client ``c`` is done: free the segment unless a zero_copy client still maps it; logged."""
        st = self.state
        with st.lock:
            st.clients.pop(c.cid, None)
            mapped = sum(m == "zero_copy" for m in st.clients.values())
            if mapped or st.segment is None:
                freed = False
            else:
                st.segment.close()
                st.segment = None
                st.released = True
                freed = True
        if freed:
            logger.warning("fastload: client %d (pid %d, uid %d, copy mode) released the cache: %.2f GiB freed; later "
                           "engines load from disk until the daemon is restarted", c.cid, c.pid, c.uid,
                           st.nbytes / 2**30)
        else:
            logger.info("fastload: client %d (pid %d, uid %d, copy mode) is done; the cache stays (%d zero_copy "
                        "client(s) map it)", c.cid, c.pid, c.uid, mapped)
        return freed

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


def _reply(conn: socket.socket, message: Any, fds: Optional[list[int]] = None) -> None:
    """Send one reply model of :mod:`.messages` (with ``fds``)."""
    protocol.send(conn, messages.to_frame(message), fds)


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

