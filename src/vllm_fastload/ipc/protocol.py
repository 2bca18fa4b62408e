"""Wire protocol between the preload daemon and its clients. No pickle crosses the socket.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON (an object with a ``"type"``).
File descriptors (the shared-memory segments) travel with a frame as SCM_RIGHTS ancillary data
(``socket.send_fds``/``recv_fds``, Python >= 3.9).

Conversation (client -> daemon / daemon -> client)::

    hello {version, fingerprint, mode, pid}  ->  manifest {version, fingerprint, segments, tensors, reprocess}
                                                  + one fd per segment        | error {reason, mismatched}
    attach {mode}                            ->  attached {clients}
    release {}                               ->  released {freed}
    status {}                                ->  status {...}
    bye {}                                   ->  (daemon closes)

The connection is the lease: a zero_copy client keeps it open for its lifetime; when it closes, the daemon
counts the client as gone.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any, Optional

PROTOCOL_VERSION = 1
#: Largest frame accepted (bytes); a manifest of ~100k tensors is a few tens of MB.
MAX_FRAME_BYTES = 256 * 2**20
MAX_FDS = 64
_LEN = struct.Struct(">I")


class ProtocolError(RuntimeError):
    """The peer sent something that is not a valid frame of this protocol (or closed mid-frame)."""


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if not fds and len(buf) == 0:
            data, got_fds, _flags, _addr = socket.recv_fds(sock, n - len(buf), MAX_FDS)
            fds.extend(got_fds)
        else:
            data = sock.recv(n - len(buf))
        if not data:
            raise ProtocolError(f"connection closed after {len(buf)} of {n} bytes")
        buf += data
    return bytes(buf)


def send(sock: socket.socket, msg: dict[str, Any], fds: Optional[list[int]] = None) -> None:
    """Send one frame (``msg`` must be JSON-serialisable, with a ``"type"``), optionally with file descriptors."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    data = _LEN.pack(len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [data], fds)
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Receive one frame: ``(message, file descriptors)``. Raises :class:`ProtocolError` on bad input and
    ``socket.timeout`` when the socket's timeout expires."""
    fds: list[int] = []
    try:
        (n,) = _LEN.unpack(_recv_exact(sock, 4, fds))
        if n > MAX_FRAME_BYTES:
            raise ProtocolError(f"peer announced a frame of {n} bytes (limit {MAX_FRAME_BYTES}); not this protocol?")
        body = _recv_exact(sock, n, fds) if n else b""
        try:
            msg = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ProtocolError(f"frame is not JSON ({e}); is the peer upstream vLLM's pickle-based daemon?") from None
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise ProtocolError(f"frame without a 'type': {str(msg)[:200]}")
    except BaseException:
        # descriptors that arrived with a frame that broke off (peer killed mid-frame, timeout) are closed, not
        # leaked: a leaked memfd would keep the daemon's memory alive in this process
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        raise
    return msg, fds


def request(sock: socket.socket, msg: dict[str, Any], expect: str) -> tuple[dict[str, Any], list[int]]:
    """Send ``msg`` and receive the reply; raise :class:`ProtocolError` when it is not of type ``expect``
    (an ``error`` reply's reason is in the message)."""
    send(sock, msg)
    reply, fds = recv(sock)
    if reply["type"] != expect:
        for fd in fds:
            try:
                import os

                os.close(fd)
            except OSError:
                pass
        if reply["type"] == "error":
            err = ProtocolError(reply.get("reason", "error"))
            err.reply = reply  # type: ignore[attr-defined]
            raise err
        raise ProtocolError(f"expected {expect!r}, got {reply['type']!r}")
    return reply, fds
