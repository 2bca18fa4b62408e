"""Client side of the protocol: connect (bounded wait), hello with our fingerprint, receive the manifest and the
segment's fd. It maps nothing: the engine maps the fd with the transport it resolved
(:func:`vllm_fastload.ipc.engine.mapping.fetch`)."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ...errors import CacheUnavailable, FastloadError, SocketDirError, UntrustedPeer
from ...log import logger
from . import messages, protocol
from .messages import MessageError, parse_reply, to_frame
from .paths import ENGINE_KEY, SocketDir, SocketDirSpec, upstream_sockets

__all__ = ["CacheUnavailable", "FingerprintMismatch", "Lease", "NoListener", "connect", "open_lease", "probe_status",
           "status_of"]


class NoListener(CacheUnavailable):
    """:func:`connect` found the socket but nothing listening on it until its timeout (connection refused): a
    socket its daemon left behind, or a daemon not listening yet."""


class FingerprintMismatch(CacheUnavailable):
    """The daemon holds other weights; ``mismatched`` lists ``[field, daemon value, engine value]``; the message
    names the daemon, each differing field and the fix."""

    def __init__(self, reason: str, mismatched: list):
        super().__init__(reason)
        self.mismatched = mismatched


def _exchange(conn: socket.socket, request: Any, expect: type) -> Any:
    """Send the request model ``request`` and return the reply, validated, as an ``expect`` model. Raises
    :class:`.protocol.ProtocolError` when the reply is invalid, of another type, or an ``error`` (its reason is
    the message); ``OSError`` and ``socket.timeout`` as the socket raises them."""
    protocol.send(conn, to_frame(request))
    raw, fds = protocol.recv(conn)
    protocol.close_fds(fds)
    reply = parse_reply(raw)
    if isinstance(reply, expect):
        return reply
    if isinstance(reply, messages.Error):
        raise protocol.ProtocolError(reply.reason)
    raise protocol.ProtocolError(f"expected {expect.model_fields['type'].default!r}, got {reply.type!r}")


@dataclass
class Lease:
    """An open connection to the daemon at ``path``, its validated manifest and, until :meth:`take_fd`, the fd of the
    manifest's segment (owned by the lease: :meth:`close` closes it). Keep the lease alive as long as tensors mapped
    from that fd are used.

    A ``zero_copy`` lease watches its connection after :meth:`attach` (:meth:`watch`): when the daemon goes away
    it logs a WARNING; a mapping stays valid (the kernel keeps the memory).
    """

    conn: socket.socket
    manifest: messages.Manifest
    path: str = "?"
    fd: int = -1
    _closing: threading.Event = field(default_factory=threading.Event, repr=False)
    _watcher: Optional[threading.Thread] = field(default=None, repr=False)

    def take_fd(self) -> int:
        """The segment's fd, handed to the caller (who must close it; a transport's ``open`` does)."""
        fd, self.fd = self.fd, -1
        return fd

    def attach(self, mode: messages.Mode) -> int:
        """Tell the daemon we use the cache in ``mode``; returns its client count. For ``zero_copy`` this starts
        :meth:`watch`, so no further request may be made on this lease (only :meth:`close`)."""
        try:
            reply = _exchange(self.conn, messages.Attach(mode=mode), messages.Attached)
        except (protocol.ProtocolError, OSError) as e:
            raise CacheUnavailable(f"daemon at {self.path} went away before the attach ({e}); see its log") from None
        if mode == "zero_copy":
            self.watch()
        return reply.clients

    def release(self) -> bool:
        """copy mode: we cloned everything; the daemon may free its memory. Returns whether it did (False, with a
        WARNING, when the daemon is gone: the copy is complete either way)."""
        try:
            reply = _exchange(self.conn, messages.Release(), messages.Released)
        except (protocol.ProtocolError, OSError) as e:
            logger.warning("fastload: the preload daemon at %s went away before the release (%s); this engine's "
                           "copy of the weights is complete", self.path, e)
            return False
        return reply.freed

    def watch(self) -> None:
        """Start a daemon thread that notices when the daemon closes this connection (killed, stopped, restarted)
        and logs a WARNING on ``vllm.fastload`` naming the socket. Idempotent. Call only after the last request on
        this lease: the thread reads the connection (the daemon sends nothing unasked)."""
        if self._watcher is not None:
            return
        self._watcher = threading.Thread(target=self._watch, args=(self.path,), name="fastload-lease-watch",
                                         daemon=True)
        self._watcher.start()

    def _watch(self, path: str) -> None:
        cause = "its connection closed"
        try:
            while self.conn.recv(4096):
                pass  # nothing is expected; a frame the daemon might send unasked is ignored
        except OSError as e:
            cause = f"{type(e).__name__}: {e}"
        if self._closing.is_set():
            return
        logger.warning(
            "fastload: the preload daemon at %s went away (%s). This engine keeps serving its mapped copy of the "
            "weights (the kernel keeps that memory). A restarted daemon will hold a second copy of the weights on "
            "this device until this engine restarts and maps the new daemon's copy.", path, cause)

    def close(self) -> None:
        """Say bye and close the connection and an fd not taken (a mapping made from the fd stays)."""
        self._closing.set()
        if self.fd >= 0:
            os.close(self.take_fd())
        try:
            protocol.send(self.conn, to_frame(messages.Bye()))
        except OSError:
            pass
        try:
            self.conn.shutdown(socket.SHUT_RDWR)  # wakes a watcher blocked in recv (close alone does not)
        except OSError:
            pass
        self.conn.close()
        if self._watcher is not None:
            self._watcher.join(5)


#: connect() errors a retry can cure: no socket yet (the daemon starts), nobody listening (a stale socket about to be
#: replaced), a full listen backlog, a slow accept.
_RETRYABLE = (FileNotFoundError, ConnectionRefusedError, BlockingIOError, InterruptedError, socket.timeout)


def check_peer(conn: socket.socket, path: str) -> None:
    """Refuse a daemon that runs as another user: only this uid or root may hand this process weights (another
    local user could otherwise answer on a socket path it redirected, with forged weights). Raises
    :class:`~vllm_fastload.errors.UntrustedPeer` naming the socket, the peer's pid and both uids."""
    pid, uid, _gid = protocol.peer_credentials(conn)
    if uid not in (os.getuid(), 0):
        raise UntrustedPeer(f"the process on {path} (pid {pid}) runs as uid {uid}, not as this user ({os.getuid()}) "
                            f"or root: its manifest and memory are not used. Check who owns the socket dir and that "
                            f"`vllm-fastload preload` runs as this user")


def connect(path: str, timeout_s: float, spec: Optional[SocketDirSpec] = None) -> socket.socket:
    """Connect to the daemon socket ``path``, retrying until ``timeout_s`` while the daemon may be starting (no
    socket yet, nobody listening). The socket's directory is opened without following a symbolic link and checked
    (:class:`.paths.SocketDir`), the socket itself must not be a link, and the peer must run as this user or root
    (:func:`check_peer`). ``spec``: the socket's directory (``path``'s parent) and where it came from, for
    messages (default: "the directory of socket ``path``").

    Raises :class:`CacheUnavailable` naming the path and the last error at the timeout, at once for errors a retry
    cannot cure; :class:`~vllm_fastload.errors.SocketDirError` and :class:`~vllm_fastload.errors.UntrustedPeer` at
    once."""
    sock_path = Path(path)
    spec = spec or SocketDirSpec(sock_path.parent, f"the directory of socket {path}", ENGINE_KEY)
    if spec.path != sock_path.parent:
        raise ValueError(f"socket {path} is not in the socket dir {spec.path}")
    deadline = time.monotonic() + timeout_s
    last: Optional[BaseException] = None
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            with SocketDir.open(spec) as sd:
                st = sd.lstat(sock_path.name)
                if st is None:
                    raise FileNotFoundError(path)
                if not stat.S_ISSOCK(st.st_mode):
                    kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a socket"
                    raise CacheUnavailable(f"{path} is {kind}; a daemon's socket is created by `vllm-fastload preload` "
                                           f"itself: remove {path} and restart the daemon")
                s.connect(sd.entry(sock_path.name))
            check_peer(s, path)
            return s
        except _RETRYABLE as e:
            s.close()
            last = e
        except PermissionError as e:
            s.close()
            raise CacheUnavailable(f"this user (uid {os.getuid()}) may not connect to {path} ({e.strerror}); run the "
                                   f"engine as the user of `vllm-fastload preload`") from None
        except (SocketDirError, UntrustedPeer, CacheUnavailable):
            s.close()
            raise
        except OSError as e:
            s.close()
            raise CacheUnavailable(
                f"cannot connect to the preload daemon at {path} ({type(e).__name__}: {e})") from None
        if time.monotonic() >= deadline:
            what = "no socket" if isinstance(last, FileNotFoundError) else f"{type(last).__name__}: {last}"
            theirs = upstream_sockets(sock_path.parent)
            beside = (f"; found {len(theirs)} socket(s) of vLLM's own weight-cache daemon (`vllm preload`, vLLM >= "
                      f"0.31: another protocol), e.g. {theirs[0]}: with vllm-fastload installed, --load-format "
                      f"ipc_cache is this plugin's and cannot map it; run `vllm-fastload preload <same engine args>` "
                      f"instead of `vllm preload`, or set VLLM_PLUGINS to a list without vllm_fastload to use vLLM's "
                      f"own (README, \"Beside vLLM's own weight cache\")") if theirs else ""
            error = NoListener if isinstance(last, ConnectionRefusedError) else CacheUnavailable
            raise error(f"no preload daemon at {path} within {timeout_s:g} s ({what}); start "
                        f"`vllm-fastload preload <same engine args>` first{beside}")
        time.sleep(0.1)


def open_lease(path: str, fingerprint: dict, connect_timeout_s: float, state_timeout_s: float,
               spec: Optional[SocketDirSpec] = None) -> Lease:
    """Connect (:func:`connect`; ``spec``: the socket's directory and where it came from), send hello with
    ``fingerprint`` (a :meth:`~vllm_fastload.fingerprint.Fingerprint.to_dict`), receive and validate the manifest
    and the fd of its segment. Returns the :class:`Lease` holding both; nothing is mapped.

    Raises :class:`FingerprintMismatch` (the daemon holds other weights), :class:`CacheUnavailable` (with the
    reason: a timeout, a refusal, another protocol or protocol version, a manifest that does not fit the fds)
    and what :func:`connect` raises.
    """
    conn = connect(path, connect_timeout_s, spec)
    try:
        raw, fds = _hello(conn, path, fingerprint, connect_timeout_s, state_timeout_s)
    except BaseException:
        conn.close()
        raise
    try:
        manifest = _manifest_of(raw, fds, path)
    except BaseException:
        protocol.close_fds(fds)
        conn.close()
        raise
    conn.settimeout(None)
    protocol.close_fds(fds[1:])  # the manifest's first segment is the rank's one; more are not used
    return Lease(conn, manifest, path, fds[0])


def _hello(conn: socket.socket, path: str, fingerprint: dict, connect_timeout_s: float,
           state_timeout_s: float) -> tuple[dict[str, Any], list[int]]:
    """Send hello with ``fingerprint`` on ``conn`` and return the daemon's answer, ``(message, fds)`` as received
    (waiting up to ``state_timeout_s`` more while the daemon says it is loading). Raises
    :class:`CacheUnavailable` saying what happened (no answer, still loading, closed, another protocol)."""
    # The first answer to hello comes at once: the manifest (or a refusal) from a ready daemon, a "loading" status
    # from one still loading (then the manifest within state_timeout_s). Nothing within connect_timeout_s: the
    # process holding the socket accepted the connection but does not answer (stopped, hung).
    conn.settimeout(connect_timeout_s)
    waited = "connect_timeout_s"
    try:
        hello = messages.Hello.model_validate({"version": protocol.PROTOCOL_VERSION, "fingerprint": fingerprint,
                                               "pid": os.getpid()}, strict=False)
        try:
            protocol.send(conn, to_frame(hello))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the peer closed without reading hello: what it sent before closing (if anything) says who it is
        raw, fds = protocol.recv(conn)
        if raw.get("type") == "status" and raw.get("state") == "loading" and not fds:
            logger.info("fastload: the preload daemon at %s is still loading; waiting up to %g s for its weights "
                        "(state_timeout_s)", path, state_timeout_s)
            conn.settimeout(state_timeout_s)
            waited = "state_timeout_s"
            raw, fds = protocol.recv(conn)
        return raw, fds
    except TimeoutError:
        if waited == "connect_timeout_s":
            raise CacheUnavailable(
                f"daemon at {path} is not answering: it accepted the connection but sent no complete reply to "
                f"hello within {connect_timeout_s:g} s (connect_timeout_s); a stopped (SIGSTOP) or hung process "
                f"holds the socket (`vllm-fastload status` says the same): restart `vllm-fastload preload`") from None
        raise CacheUnavailable(f"daemon at {path} was still loading after {state_timeout_s:g} s (state_timeout_s): "
                               f"raise state_timeout_s, or start the engine once the daemon logged \"fastload: "
                               f"ready\"") from None
    except protocol.PeerClosed as e:
        raise CacheUnavailable(f"daemon at {path} closed the connection before sending the manifest ({e}; it may "
                               f"have died while loading or been killed during the hand-over; see its log)") from None
    except protocol.ProtocolError as e:
        raise CacheUnavailable(f"the process on {path} does not speak vllm-fastload's protocol ({e}). vLLM's own "
                               f"`vllm preload` daemon uses pickle frames, which this loader never reads; start "
                               f"`vllm-fastload preload` instead") from None
    except OSError as e:
        raise CacheUnavailable(f"daemon at {path} closed the connection during the hand-over ({e})") from None


def _manifest_of(raw: dict[str, Any], fds: list[int], path: str) -> messages.Manifest:
    """The validated manifest of the daemon's answer to hello (``raw`` with ``fds``: its segment's). Raises
    :class:`FingerprintMismatch` for the daemon's refusal of our fingerprint, :class:`CacheUnavailable` for another
    refusal, another protocol version, an invalid reply, or not exactly one fd."""
    try:
        if raw.get("type") == "manifest" and type(raw.get("version")) is int:
            messages.check_version(raw["version"], "daemon", "engine")  # before fields that may differ by version
        reply = parse_reply(raw)
        if not isinstance(reply, (messages.Manifest, messages.Error)):
            raise MessageError(f"expected a manifest, got {reply.type!r}")
    except MessageError as e:
        raise CacheUnavailable(f"daemon at {path} sent an unusable reply to hello ({e})") from None
    if isinstance(reply, messages.Error):
        if reply.mismatched:
            fields = ", ".join(f"{n} (daemon {a!r}, engine {b!r})" for n, a, b in reply.mismatched)
            raise FingerprintMismatch(
                f"fingerprint mismatch with the daemon at {path}: {fields}; restart `vllm-fastload preload` with this "
                f"engine's args, or start the engine with the daemon's", reply.mismatched)
        raise CacheUnavailable(f"daemon at {path}: {reply.reason}")
    if len(fds) != 1:
        raise CacheUnavailable(f"daemon at {path} sent a manifest with {len(fds)} file descriptors, not its "
                               f"segment's one")
    return reply


def status_of(path: str, timeout_s: float = 2.0) -> Optional[messages.StatusReply]:
    """The daemon's ``status`` reply (validated), or None when nothing usable answers on ``path`` (no daemon, a
    daemon of another user, an invalid reply; :func:`probe_status` says which)."""
    return probe_status(path, timeout_s)[0]


#: :func:`probe_status`'s reason for a socket nothing listens on.
NOT_LISTENING = "not answering: nothing listens (a stale socket: remove it once no daemon of it runs)"


def probe_status(path: str, timeout_s: float = 2.0) -> tuple[Optional[messages.StatusReply], str]:
    """``(reply, "")`` with the daemon's validated ``status`` reply, or ``(None, reason)``: :data:`NOT_LISTENING`
    when nothing listens on ``path`` within ``timeout_s`` seconds; otherwise what went wrong with a listener that is
    there (not this user's, no reply within ``timeout_s``, or a reply that is not a valid status: a daemon of
    another protocol version or another program), which ``vllm-fastload status`` prints so that nobody removes a
    live daemon's socket as stale. Raises nothing."""
    try:
        conn = connect(path, timeout_s)
    except NoListener:
        return None, NOT_LISTENING
    except FastloadError as e:
        return None, f"unusable: {e}"
    try:
        conn.settimeout(timeout_s)
        return _exchange(conn, messages.Status(), messages.StatusReply), ""
    except TimeoutError:
        return None, (f"a listener accepted but sent no status reply within {timeout_s:g} s (a daemon busy or hung, "
                      f"or another program): not a stale socket")
    except (OSError, protocol.ProtocolError) as e:
        return None, (f"a listener answered, but not with a valid status reply ({e}): a daemon of another "
                      f"vllm-fastload version or another program, not a stale socket")
    finally:
        conn.close()
