"""Client side of the protocol: connect (bounded wait), hello with our fingerprint, receive and map the segment."""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import FastloadError
from ..log import logger
from . import protocol
from .shm import Segment, open_segment


class CacheUnavailable(FastloadError):
    """No usable daemon answer (no socket, timeout, refused, released, other protocol); message says which."""


class FingerprintMismatch(CacheUnavailable):
    """The daemon holds other weights; ``mismatched`` lists ``[field, daemon value, engine value]``."""

    def __init__(self, reason: str, mismatched: list):
        super().__init__(reason)
        self.mismatched = mismatched


@dataclass
class Lease:
    """An open connection and the mapped segment; keep it alive as long as mapped tensors are used.

    A ``zero_copy`` lease watches its connection after :meth:`attach` (:meth:`watch`): when the daemon goes away
    it logs a WARNING; the mapping stays valid (the kernel keeps the memory).
    """

    conn: socket.socket
    manifest: dict
    segment: Segment
    _closing: threading.Event = field(default_factory=threading.Event, repr=False)
    _watcher: Optional[threading.Thread] = field(default=None, repr=False)

    def attach(self, mode: str) -> int:
        """Tell the daemon we use the cache in ``mode``; returns its client count. For ``zero_copy`` this starts
        :meth:`watch`, so no further request may be made on this lease (only :meth:`close`)."""
        try:
            reply, _ = protocol.request(self.conn, {"type": "attach", "mode": mode}, "attached")
        except (protocol.ProtocolError, OSError) as e:
            raise CacheUnavailable(f"daemon at {self._path()} went away before the attach ({e}); see its log") from None
        if mode == "zero_copy":
            self.watch()
        return int(reply["clients"])

    def release(self) -> bool:
        """copy mode: we cloned everything; the daemon may free its memory. Returns whether it did (False, with a
        WARNING, when the daemon is gone: the copy is complete either way)."""
        try:
            reply, _ = protocol.request(self.conn, {"type": "release"}, "released")
        except (protocol.ProtocolError, OSError) as e:
            logger.warning("fastload: the preload daemon at %s went away before the release (%s); this engine's "
                           "copy of the weights is complete", self._path(), e)
            return False
        return bool(reply["freed"])

    def _path(self) -> str:
        """The daemon's socket path (the peer address of the connection), ``"?"`` when unknown."""
        try:
            return self.conn.getpeername() or "?"
        except OSError:
            return "?"

    def watch(self) -> None:
        """Start a daemon thread that notices when the daemon closes this connection (killed, stopped, restarted)
        and logs a WARNING on ``vllm.fastload`` naming the socket. Idempotent. Call only after the last request on
        this lease: the thread reads the connection (the daemon sends nothing unasked)."""
        if self._watcher is not None:
            return
        self._watcher = threading.Thread(target=self._watch, args=(self._path(),), name="fastload-lease-watch",
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
        """Say bye and close the connection (the mapping stays until :attr:`segment` is closed)."""
        self._closing.set()
        try:
            protocol.send(self.conn, {"type": "bye"})
        except OSError:
            pass
        try:
            self.conn.shutdown(socket.SHUT_RDWR)  # wakes a watcher blocked in recv (close alone does not)
        except OSError:
            pass
        self.conn.close()
        if self._watcher is not None:
            self._watcher.join(5)


def connect(path: str, timeout_s: float) -> socket.socket:
    """Connect to the daemon socket, retrying until ``timeout_s`` (the daemon may be starting).
    Raises :class:`CacheUnavailable` naming the path and the last error."""
    deadline = time.monotonic() + timeout_s
    last: Optional[BaseException] = None
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            s.connect(path)
            return s
        except (FileNotFoundError, ConnectionRefusedError, socket.timeout, OSError) as e:
            s.close()
            last = e
        if time.monotonic() >= deadline:
            what = "no socket" if isinstance(last, FileNotFoundError) else f"{type(last).__name__}: {last}"
            raise CacheUnavailable(f"no preload daemon at {path} within {timeout_s:g} s ({what}); start "
                                   f"`vllm-fastload preload <same engine args>` first")
        time.sleep(0.1)


def fetch(path: str, fingerprint: dict, mode: str, connect_timeout_s: float, state_timeout_s: float,
          device: Any = None) -> Lease:
    """Connect, send hello with ``fingerprint``, receive the manifest and map its segment on ``device``
    (a ``torch.device``; default CPU).

    Raises :class:`FingerprintMismatch` or :class:`CacheUnavailable` (with the reason).
    """
    conn = connect(path, connect_timeout_s)
    conn.settimeout(state_timeout_s)
    try:
        protocol.send(conn, {"type": "hello", "version": protocol.PROTOCOL_VERSION, "fingerprint": fingerprint,
                             "mode": mode, "pid": os.getpid()})
        reply, fds = protocol.recv(conn)
    except socket.timeout:
        conn.close()
        raise CacheUnavailable(f"daemon at {path} sent no manifest within {state_timeout_s:g} s (state_timeout_s)") from None
    except protocol.ProtocolError as e:
        conn.close()
        if "connection closed" in str(e):
            raise CacheUnavailable(f"daemon at {path} closed the connection before sending the manifest ({e}; it may "
                                   f"have died while loading or been killed during the hand-over; see its log)") from None
        raise CacheUnavailable(f"the process on {path} does not speak vllm-fastload's protocol ({e}). vLLM's own "
                               f"`vllm preload` daemon uses pickle frames, which this loader never reads; start "
                               f"`vllm-fastload preload` instead") from None
    except OSError as e:
        conn.close()
        raise CacheUnavailable(f"daemon at {path} closed the connection during the hand-over ({e})") from None
    if reply["type"] == "error":
        conn.close()
        if reply.get("mismatched"):
            raise FingerprintMismatch(reply["reason"], reply["mismatched"])
        raise CacheUnavailable(f"daemon at {path}: {reply.get('reason')}")
    if reply["type"] != "manifest" or len(fds) != len(reply.get("segments", [])) or not fds:
        for fd in fds:
            os.close(fd)
        conn.close()
        raise CacheUnavailable(f"daemon at {path} sent {reply['type']!r} with {len(fds)} segment(s); expected a manifest")
    conn.settimeout(None)
    import torch

    try:
        seg = open_segment(fds[0], reply["segments"][0], torch.device(device or "cpu"))
    except BaseException:
        conn.close()
        raise
    return Lease(conn, reply, seg)


def status_of(path: str, timeout_s: float = 2.0) -> Optional[dict[str, Any]]:
    """The daemon's ``status`` reply, or None when nothing answers on ``path``."""
    try:
        conn = connect(path, timeout_s)
    except CacheUnavailable:
        return None
    try:
        conn.settimeout(timeout_s)
        reply, _ = protocol.request(conn, {"type": "status"}, "status")
        return reply
    except (OSError, protocol.ProtocolError):
        return None
    finally:
        conn.close()
