"""Wire protocol between the preload daemon and its clients: framing and file-descriptor passing. No pickle
crosses the socket.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON (an object with a ``"type"``).
File descriptors (the shared-memory segments) travel with a frame as SCM_RIGHTS ancillary data
(``socket.send_fds``/``recv_fds``, Python >= 3.9).

Conversation (client -> daemon / daemon -> client)::

    hello {version, fingerprint, pid}        ->  manifest {version, fingerprint, segment, tensors, reprocess}
                                                  + the segment's fd          | error {reason, mismatched}
    attach {mode}        (after the manifest) ->  attached {clients}
    release {}      (after attach in copy)   ->  released {freed}
    status {}                                ->  status {...}
    bye {}                                   ->  (daemon closes)

Every message's fields are defined (and validated on receipt) in :mod:`.messages`; a message that is not valid
there, or not allowed at this point of the conversation, is answered ``error {reason}`` naming the field.
The connection is the lease: a zero_copy client keeps it open for its lifetime; when it closes, the daemon
counts the client as gone.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from typing import Any, Optional

from ...errors import FastloadError

#: The version both sides must speak (:func:`.messages.check_version`); raised whenever a message changes in a way
#: the other side would refuse or misread (4: the manifest's tensors are a table of columns, checksums integers,
#: and its one segment is ``segment``, not a list; 5: checksum windows of 512 bytes, so a version-4 daemon's
#: checksums would read as corrupt memory; 6: the ``kept_param`` kind, which a version-5 engine would refuse;
#: 7: the constructor's small tensors stay out of the table, ``constructed`` says so; a version-6 engine would
#: lack them).
PROTOCOL_VERSION = 7
#: Largest frame accepted (bytes): room for the manifest of a model with a hundred thousand tensors, small enough
#: that a peer announcing a huge frame is refused before anything is allocated.
MAX_FRAME_BYTES = 256 * 2**20
#: Largest frame a daemon accepts from an engine (bytes): requests (hello with the fingerprint, attach, status,
#: release) are a few KiB; only the daemon's replies (the manifest) need :data:`MAX_FRAME_BYTES`.
MAX_REQUEST_BYTES = 4 * 2**20
#: Bytes one daemon server buffers for frames being received, across all its connections at once: with
#: :data:`MAX_REQUEST_BYTES` per frame, many peers that each announce a full frame cannot grow the daemon past it.
RECV_BUDGET_BYTES = 64 * 2**20
MAX_FDS = 64
_LEN = struct.Struct(">I")
_CRED = struct.Struct("3i")


class ProtocolError(FastloadError):
    """The peer sent something that is not a valid frame of this protocol (:class:`PeerClosed`: it closed)."""


class PeerClosed(ProtocolError):
    """The peer closed the connection: between frames, or in the middle of one (the message says after how many of
    the frame's bytes)."""


class ByteBudget:
    """The bytes that frames being received may hold at once, shared by the connections of one server
    (thread-safe). A frame's announced length is taken before its body is read and given back once it is parsed
    or has failed."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        """Reserve ``n`` bytes; False (nothing reserved) when that would pass :attr:`limit`."""
        with self._lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a connected Unix socket (``SO_PEERCRED``: the
    kernel's record from ``connect``/``listen``, which the peer cannot forge)."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


def _recv_exact(sock: socket.socket, n: int, fds: list[int], deadline: list[float],
                frame_timeout_s: Optional[float]) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if deadline:
            left = deadline[0] - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"frame incomplete after {frame_timeout_s:g} s")
            sock.settimeout(left)
        if not fds and len(buf) == 0:
            data, got_fds, _flags, _addr = socket.recv_fds(sock, n - len(buf), MAX_FDS)
            fds.extend(got_fds)
        else:
            data = sock.recv(n - len(buf))
        if not data:
            raise PeerClosed(f"connection closed after {len(buf)} of {n} bytes")
        buf += data
        if frame_timeout_s is not None and not deadline:
            # the frame's first bytes are here: the rest must follow within frame_timeout_s (a peer that sends
            # half a frame and stalls must not hold the connection forever)
            deadline.append(time.monotonic() + frame_timeout_s)
    return bytes(buf)


def encode(msg: dict[str, Any]) -> bytes:
    """The body of one frame: ``msg`` (JSON-serialisable, with a ``"type"``) as compact UTF-8 JSON."""
    return json.dumps(msg, separators=(",", ":")).encode()


def send(sock: socket.socket, msg: dict[str, Any], fds: Optional[list[int]] = None) -> None:
    """Send one frame (``msg`` must be JSON-serialisable, with a ``"type"``), optionally with file descriptors."""
    send_body(sock, encode(msg), fds)


def send_body(sock: socket.socket, body: bytes, fds: Optional[list[int]] = None) -> None:
    """Send one frame whose body :func:`encode` made (a daemon encodes its manifest once for every engine)."""
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    data = _LEN.pack(len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [data], fds)
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def recv(sock: socket.socket, frame_timeout_s: Optional[float] = None, limit: int = MAX_FRAME_BYTES,
         budget: Optional[ByteBudget] = None) -> tuple[dict[str, Any], list[int]]:
    """Receive one frame: ``(message, file descriptors)``. The wait for the frame's first byte is bounded by the
    socket's timeout; with ``frame_timeout_s`` the whole frame must arrive within that many seconds of its first
    byte (the socket's timeout is restored afterwards). ``limit``: the largest frame accepted (bytes); ``budget``:
    the bytes shared with other connections that the frame's body must fit in while it is received. Raises
    :class:`ProtocolError` on bad input, a frame over ``limit`` or one the budget has no room for
    (:class:`PeerClosed` when the peer closed the connection) and ``socket.timeout`` when a wait expires."""
    fds: list[int] = []
    deadline: list[float] = []
    old_timeout = sock.gettimeout()
    taken = 0
    try:
        (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, fds, deadline, frame_timeout_s))
        if n > limit:
            raise ProtocolError(f"peer announced a frame of {n} bytes (limit {limit}); not this protocol?")
        if budget is not None:
            if not budget.take(n):
                raise ProtocolError(f"frame of {n} bytes refused: frames of other connections already hold "
                                    f"{budget.used} of the {budget.limit} bytes this daemon buffers at once; retry")
            taken = n
        body = _recv_exact(sock, n, fds, deadline, frame_timeout_s) if n else b""
        try:
            msg = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ProtocolError(f"frame is not JSON ({e}); is the peer upstream vLLM's pickle-based daemon?") from None
        except RecursionError:
            raise ProtocolError("frame nests JSON arrays/objects deeper than the parser allows; no message of this "
                                "protocol does") from None
        except ValueError:  # an integer longer than Python converts (sys.get_int_max_str_digits, 4300 digits)
            raise ProtocolError("frame holds an integer too long to convert; no message of this protocol does") \
                from None
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise ProtocolError(f"frame without a 'type': {_preview(msg)}")
    except BaseException:
        # descriptors that arrived with a frame that broke off (peer killed mid-frame, timeout) are closed, not
        # leaked: a leaked memfd would keep the daemon's memory alive in this process
        close_fds(fds)
        raise
    finally:
        if taken:
            budget.give(taken)
        if deadline:
            try:
                sock.settimeout(old_timeout)
            except OSError:
                pass
    return msg, fds


def _preview(value: Any, limit: int = 200) -> str:
    """``repr`` of a decoded JSON value cut to ``limit`` characters (without walking a deep value twice)."""
    try:
        text = repr(value)
    except RecursionError:
        return f"<a deeply nested {type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def close_fds(fds: list[int]) -> None:
    """Close received file descriptors, ignoring ones already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
