"""Health and metrics of the preload daemon's main process: ``GET /health`` and a Prometheus ``GET /metrics``,
built from each rank's ``status`` reply (:func:`.client.status_of`)."""

from __future__ import annotations

import errno
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

from ...errors import FastloadError
from ...log import logger
from ..wire.client import status_of
from ..wire.messages import StatusReply
from .rank import Limits, Throttle, accept_backoff

#: Prometheus metrics of the health port: (name, type, help, status key). Counters only ever grow while the daemon
#: runs (prometheus_client appends ``_total`` to a counter's name in the exposition).
METRICS = (
    ("tensors", "gauge", "tensors exported", "tensors"),
    ("bytes", "gauge", "bytes of weights held", "bytes"),
    ("attached_clients", "gauge", "engines attached now", "clients"),
    ("attaches", "counter", "attaches since start", "attaches"),
    ("fallbacks_seen", "counter", "engines refused with a fingerprint mismatch since start (they fell back)",
     "fingerprint_mismatches"),
    ("load_seconds", "gauge", "seconds the rank took to load and export", "load_seconds"),
)


def metrics_text(statuses: list[Optional[StatusReply]]) -> bytes:
    """Prometheus exposition of the ranks' statuses (prometheus_client; one sample per rank, label ``rank``):
    :data:`METRICS`, ``vllm_fastload_ready`` (1 when the rank serves) and ``vllm_fastload_fingerprint`` (info)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

    class Snapshot:
        def collect(self):
            ready = GaugeMetricFamily("vllm_fastload_ready", "1 when the rank serves", labels=["rank"])
            info = InfoMetricFamily("vllm_fastload_fingerprint", "fingerprint of the cached weights", labels=["rank"])
            fams = {name: (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                f"vllm_fastload_{name}", text, labels=["rank"]) for name, kind, text, _ in METRICS}
            for r, st in enumerate(statuses):
                ready.add_metric([str(r)], 1 if st and st.state == "ready" else 0)
                if not st:
                    continue
                for name, _, _, key in METRICS:
                    fams[name].add_metric([str(r)], getattr(st, key))
                info.add_metric([str(r)], {"short": st.fingerprint_short or "", "model": st.model})
            yield ready
            yield from fams.values()
            yield info

    reg = CollectorRegistry()
    reg.register(Snapshot())
    return generate_latest(reg)


class HealthServer(ThreadingHTTPServer):
    """The health/metrics HTTP server, bounded like the rank sockets: at most ``max_connections`` requests at once
    (more are answered 503 and closed at once), each connection closed ``timeout_s`` after it was accepted whatever
    it sends (idle and trickling clients included), and an accept error is logged and paused on, never fatal.
    The port is reachable from wherever ``host`` is; these bounds keep it from exhausting the process's file
    descriptors, which the rank sockets of this process share."""

    daemon_threads = True
    request_queue_size = 128  # socketserver's 5 would drop probes while a burst of connections is accepted

    def __init__(self, address: tuple[str, int], handler: Any, max_connections: int, timeout_s: float):
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self.max_connections = max_connections
        self._pause = 0.0
        self._log = Throttle()
        super().__init__(address, handler)

    def get_request(self) -> Any:
        """Accept one connection; on an accept error pause (doubling, :func:`.rank.accept_backoff`) before
        socketserver skips it, so the loop does not spin at the fd limit."""
        try:
            got = super().get_request()
        except OSError as e:
            self._pause = accept_backoff(self._pause)
            self._log("accept", logging.WARNING, "fastload: health server accept failed (%s: %s); pausing %.2f s, "
                      "still serving", type(e).__name__, e, self._pause)
            time.sleep(self._pause)
            raise
        self._pause = 0.0
        return got

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection in its own thread when a slot is free, else answer 503 and close it."""
        if not self._slots.acquire(blocking=False):
            body = b"busy: too many open connections to the health port\n"
            try:
                request.settimeout(0.2)
                request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: "
                                + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            except OSError:
                pass
            self.shutdown_request(request)
            self._log("full", logging.WARNING, "fastload: health server refused a connection from %s: %d open "
                      "(--weight-cache-max-connections)", client_address[0], self.max_connections)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Serve one connection under a deadline of ``timeout_s`` for the whole connection; frees its slot."""
        # A deadline for the whole connection, not per read: a client sending one byte now and then would
        # otherwise keep its slot for ever.
        killer = threading.Timer(self.timeout_s, _shutdown_quietly, args=(request,))
        killer.daemon = True
        killer.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            killer.cancel()
            self._slots.release()


def _shutdown_quietly(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def start_health_server(host: str, port: int, sockets: list[str], limits: Limits = Limits()) -> ThreadingHTTPServer:
    """``GET /health`` (200 when every rank is ready, else 503) and ``GET /metrics`` on ``host:port``, bounded by
    ``limits`` (:class:`HealthServer`: at most ``max_connections`` at once, each closed after ``idle_timeout_s``,
    at most 10 s). Raises :class:`FastloadError` naming the address when it cannot be bound (port in use)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            statuses = [status_of(p) for p in sockets] if sockets else []
            if self.path == "/health":
                ok = bool(statuses) and all(s and s.state == "ready" for s in statuses)
                body = json.dumps({"ready": ok, "ranks": [s.state if s else None for s in statuses]}).encode()
                self.send_response(200 if ok else 503)
                ctype = "application/json"
            elif self.path == "/metrics":
                body, ctype = metrics_text(statuses), "text/plain; version=0.0.4"
                self.send_response(200)
            else:
                body, ctype = b"not found\n", "text/plain"
                self.send_response(404)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    timeout_s = min(10.0, limits.idle_timeout_s)
    Handler.timeout = timeout_s  # per read (StreamRequestHandler); the server's deadline bounds the whole connection
    try:
        srv = HealthServer((host, port), Handler, limits.max_connections, timeout_s)
    except OSError as e:
        hint = "another preload daemon (`vllm-fastload status`) or another server uses it; pass another " \
            "--weight-cache-health-port" if e.errno == errno.EADDRINUSE else "check --weight-cache-health-host"
        raise FastloadError(f"cannot serve health on {host}:{port} ({e.strerror or e}): {hint}") from None
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    logger.info("fastload: health and metrics on http://%s:%d/health and /metrics (at most %d connections)", host,
                srv.server_address[1], limits.max_connections)
    return srv
