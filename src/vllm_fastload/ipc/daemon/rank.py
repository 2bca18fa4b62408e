"""What every server of one rank shares: the rank's state (:class:`RankState`: what it serves, who uses it), the
connection limits, the throttled log and the accept loops' back-off. The socket server (:mod:`.server`), each
connection's conversation (:mod:`.conversation`) and the health port (:mod:`.health`) read them."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from ...log import logger
from ..memory.transport import Segment
from ..wire import messages


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


