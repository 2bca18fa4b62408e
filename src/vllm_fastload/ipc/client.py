"""Client side of the protocol: connect (bounded wait), hello with our fingerprint, receive and map the segment."""

from __future__ import annotations

import mmap
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Optional

from ..errors import FastloadError
from . import protocol
from .shm import map_segment


class CacheUnavailable(FastloadError):
    """No usable daemon answer (no socket, timeout, refused, released, other protocol); message says which."""


class FingerprintMismatch(CacheUnavailable):
    """The daemon holds other weights; ``mismatched`` lists ``[field, daemon value, engine value]``."""

    def __init__(self, reason: str, mismatched: list):
        super().__init__(reason)
        self.mismatched = mismatched


@dataclass
class Lease:
    """An open connection and the mapped segment; keep it alive as long as mapped tensors are used."""

    conn: socket.socket
    manifest: dict
    segment: mmap.mmap

    def attach(self, mode: str) -> int:
        """Tell the daemon we use the cache in ``mode``; returns its client count."""
        reply, _ = protocol.request(self.conn, {"type": "attach", "mode": mode}, "attached")
        return int(reply["clients"])

    def release(self) -> bool:
        """copy mode: we cloned everything; the daemon may free its memory. Returns whether it did."""
        reply, _ = protocol.request(self.conn, {"type": "release"}, "released")
        return bool(reply["freed"])

    def close(self) -> None:
        """Say bye and close the connection (the mapping stays until :attr:`segment` is closed)."""
        try:
            protocol.send(self.conn, {"type": "bye"})
        except OSError:
            pass
        self.conn.close()


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


def fetch(path: str, fingerprint: dict, mode: str, connect_timeout_s: float, state_timeout_s: float) -> Lease:
    """Connect, send hello with ``fingerprint``, receive the manifest and map its segment.

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
            raise CacheUnavailable(f"daemon at {path} closed the connection before sending the manifest (it may have "
                                   f"died while loading; see its log)") from None
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
    mm = map_segment(fds[0], int(reply["segments"][0]["size"]))
    return Lease(conn, reply, mm)


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
