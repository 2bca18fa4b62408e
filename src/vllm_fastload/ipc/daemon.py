"""``vllm-fastload preload <engine args>``: one daemon per local rank keeps post-processed weights resident.

Each rank builds the model exactly as the engine will (vLLM's engine-argument parser, its ``VllmConfig``, its
parallel state), loads it (through our ``runai_streamer`` unless ``--load-format`` says otherwise), runs
post-processing, collects what the model holds (:mod:`.state`), packs it into one shared-memory segment
(:mod:`.shm`), drops the model and serves the segment over a 0600 Unix socket until SIGTERM/SIGINT.
Flag names follow upstream ``vllm preload`` (``--weight-cache-socket-dir``, ``--weight-cache-health-port``,
``--weight-cache-health-host``).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional

from ..errors import FastloadError
from ..log import logger
from . import protocol
from .client import status_of
from .paths import default_socket_dir, device_identity, ensure_socket_dir, socket_path
from .shm import Segment, pack

DEFAULT_LOAD_FORMAT = "runai_streamer"


@dataclass
class RankState:
    """What one rank serves and who uses it (guarded by ``lock``)."""

    fingerprint: dict
    segment: Optional[Segment]
    manifest: dict
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

    def status(self) -> dict:
        """JSON-ready status (``vllm-fastload status``, ``/metrics``)."""
        with self.lock:
            return {"type": "status", "model": self.model, "device": self.device, "socket": self.socket,
                    "fingerprint": self.fingerprint, "fingerprint_short": self.manifest.get("fingerprint_short"),
                    "tensors": len(self.manifest.get("tensors", {})), "bytes": self.nbytes if not self.released else 0,
                    "state": "loading" if self.loading else "released" if self.released else "ready",
                    "clients": len(self.clients),
                    "client_modes": sorted(self.clients.values()), "attaches": self.attaches,
                    "fingerprint_mismatches": self.mismatches, "load_seconds": round(self.load_s, 3),
                    "uptime_s": round(time.time() - self.started, 1), "pid": os.getpid()}


def finish_online_quantization(model: Any, model_config: Any) -> bool:
    """What vLLM's ``BaseModelLoader.load_model`` does between ``load_weights`` and post-processing when a quant
    method quantizes online (``uses_meta_device``, e.g. ``--quantization fp8``): process the layers the layerwise
    loader deferred (attention layers, layers with padding, weights absent from the checkpoint) with
    ``finalize_layerwise_processing``. Like the layerwise quantization during ``load_weights``, this counts as
    loading here: its results are exported as processed. Returns whether it ran (vLLM 0.26 and later)."""
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_processing
    except ImportError:
        return False
    online = any(getattr(getattr(m, "quant_method", None), "uses_meta_device", False) for m in model.modules())
    if online:
        finalize_layerwise_processing(model, model_config)
    return online


def rank_loader(load_config: Any) -> Any:
    """The model loader of ``load_config`` as a vLLM worker gets it: vLLM's general plugins (this package among
    them) are loaded first, because a rank process started with ``spawn`` has none yet, and ``runai_streamer``
    would resolve to vLLM's built-in loader of that name (``vllm.plugins.load_general_plugins``, idempotent)."""
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return get_model_loader(load_config)


def build_and_export(vllm_config: Any, local_rank: int, rank: int, world_size: int, init_method: str) -> tuple[Segment, dict, float]:
    """Load this rank's model like the engine does, post-process, pack. Returns (segment, manifest, seconds)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype

    from ..fingerprint import of_model
    from .state import collect, object_states, snapshot

    t0 = time.perf_counter()
    pc = vllm_config.parallel_config
    if current_platform.device_type == "cuda":
        torch.cuda.set_device(local_rank)
    init_distributed_environment(world_size=world_size, rank=rank, distributed_init_method=init_method,
                                 local_rank=local_rank, backend=current_platform.dist_backend)
    mc, lc = vllm_config.model_config, vllm_config.load_config
    with set_current_vllm_config(vllm_config):
        ensure_model_parallel_initialized(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        _, fp = of_model(mc, vllm_config)
        device = torch.device(vllm_config.device_config.device if lc.device is None else lc.device)
        loader = rank_loader(lc)
        with set_default_torch_dtype(mc.dtype):
            with device:
                model = initialize_model(vllm_config=vllm_config, model_config=mc)
            constructed = object_states(model)  # what the engine's skeleton will start from
            loader.load_weights(model, mc)
            finish_online_quantization(model, mc)
            snap = snapshot(model)
            process_weights_after_loading(model, mc, device)
        exp = collect(model, snap, constructed)
        tensors = {k: t for k, (_, t) in exp.tensors.items()}
        unloaded = [k for k, t in tensors.items() if t.device.type == "meta"]
        if unloaded:
            raise FastloadError(f"{len(unloaded)} tensor(s) were never loaded in the daemon (still on the meta device), "
                                f"e.g. {unloaded[0]!r}; this checkpoint/quantization is not supported by the preload "
                                f"daemon yet — serve it with --load-format runai_streamer")
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        # One export buffer per rank (one fd, one CUDA allocation): engines open one handle and build every
        # tensor by offset. Peak memory during the copy is twice the weights; the model is freed right after.
        segment, entries = pack(tensors, device)
        for k, (kind, _) in exp.tensors.items():
            entries[k]["kind"] = kind
        del model, snap, tensors
        exp.tensors.clear()
        if device.type == "cuda":
            import gc

            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    meta = segment.meta()
    if device.type == "cuda":
        meta["device"] = device_identity("cuda", device.index)
    manifest = {"type": "manifest", "version": protocol.PROTOCOL_VERSION, "fingerprint": fp.to_dict(),
                "fingerprint_short": fp.short(), "segments": [meta],
                "tensors": entries, "aliases": exp.aliases, "reprocess": exp.reprocess, "attrs": exp.attrs,
                "object_attrs": exp.object_attrs}
    by_dtype: dict[str, int] = {}
    for e in entries.values():
        by_dtype[e["dtype"]] = by_dtype.get(e["dtype"], 0) + int(e["nbytes"])
    logger.info("fastload: rank %d: %d tensors exported as is (bytes by dtype: %s), %d module(s) re-processed by the "
                "engine: %s", rank, len(entries), ", ".join(f"{d}={n}" for d, n in sorted(by_dtype.items())),
                len(exp.reprocess), ", ".join(exp.reprocess[:6]) + (" ..." if len(exp.reprocess) > 6 else ""))
    return segment, manifest, time.perf_counter() - t0


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


class RankServer:
    """Serves one rank's segment on its Unix socket (one thread per connection)."""

    def __init__(self, state: RankState, path: Path):
        self.state, self.path = state, Path(path)
        self.sock: Optional[socket.socket] = None
        self.stop = threading.Event()
        self._next_id = 0

    def bind(self) -> None:
        """Create the 0600 listening socket (after the stale-socket check of :func:`acquire`)."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            s.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        s.listen(64)
        s.settimeout(0.5)
        self.sock = s

    def serve_forever(self) -> None:
        """Accept until :attr:`stop` is set."""
        assert self.sock is not None
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        st = self.state
        with st.lock:
            self._next_id += 1
            cid = self._next_id
        try:
            peer = _peer_uid(conn)
            if peer not in (os.getuid(), 0):
                protocol.send(conn, {"type": "error", "reason": f"peer uid {peer} is not the daemon's uid {os.getuid()} "
                                     f"(or root); run the engine as the same user as `vllm-fastload preload`"})
                return
            conn.settimeout(None)
            while True:
                try:
                    msg, fds = protocol.recv(conn)
                except (protocol.ProtocolError, OSError):
                    return
                for fd in fds:
                    os.close(fd)
                kind = msg["type"]
                if kind == "status":
                    protocol.send(conn, st.status())
                elif kind == "hello":
                    self._hello(conn, msg)
                elif kind == "attach":
                    mode = msg.get("mode", "zero_copy")
                    with st.lock:
                        st.clients[cid] = mode
                        st.attaches += 1
                        n = len(st.clients)
                    protocol.send(conn, {"type": "attached", "clients": n})
                elif kind == "release":
                    protocol.send(conn, {"type": "released", "freed": self._release(cid)})
                elif kind == "bye":
                    return
                else:
                    protocol.send(conn, {"type": "error", "reason": f"unknown message type {kind!r}"})
        except OSError as e:  # the client went away while we were sending (killed mid-transfer): not our failure
            logger.info("fastload: client %d disconnected while the daemon was sending to it (%s: %s); still serving",
                        cid, type(e).__name__, e)
        finally:
            with st.lock:
                st.clients.pop(cid, None)
            conn.close()

    def _hello(self, conn: socket.socket, msg: dict) -> None:
        from ..fingerprint import Fingerprint

        st = self.state
        st.ready.wait()  # an engine that connects while the daemon loads waits (bounded by its state_timeout_s)
        if msg.get("version") != protocol.PROTOCOL_VERSION:
            protocol.send(conn, {"type": "error", "reason": f"protocol version {msg.get('version')} != "
                                 f"{protocol.PROTOCOL_VERSION}; upgrade vllm-fastload on both sides"})
            return
        try:
            theirs = Fingerprint.from_dict(msg["fingerprint"])
        except (KeyError, TypeError) as e:
            protocol.send(conn, {"type": "error", "reason": f"malformed fingerprint: {e}"})
            return
        mine = Fingerprint.from_dict(st.fingerprint)
        diff = mine.mismatched_fields(theirs)
        if diff:
            with st.lock:
                st.mismatches += 1
            logger.warning("fastload: refused client pid %s (it falls back to disk): fingerprint mismatch: %s",
                           msg.get("pid"), mine.explain(theirs))
            protocol.send(conn, {"type": "error", "reason": "fingerprint mismatch: " + mine.explain(theirs),
                                 "mismatched": [[n, a, b] for n, a, b in diff]})
            return
        # Take what to send under the lock, send outside it: a client that stops reading must not block the
        # status, attach and hello of every other client.
        with st.lock:
            seg = st.segment
            fd = -1 if st.released or seg is None else os.dup(seg.fd)
            manifest = st.manifest
        if fd < 0:
            protocol.send(conn, {"type": "error", "reason": "the daemon's cache was released by a copy-mode "
                                 "client; restart `vllm-fastload preload` to fill it again"})
            return
        try:
            protocol.send(conn, manifest, fds=[fd])
        finally:
            os.close(fd)

    def _release(self, cid: int) -> bool:
        """A copy-mode client is done: free the segment unless a zero_copy client still maps it."""
        st = self.state
        with st.lock:
            st.clients.pop(cid, None)
            if any(m == "zero_copy" for m in st.clients.values()) or st.segment is None:
                return False
            st.segment.close()
            st.segment = None
            st.released = True
            return True

    def close(self) -> None:
        """Stop accepting, remove the socket file, free the segment."""
        self.stop.set()
        if self.sock is not None:
            self.sock.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        with self.state.lock:
            if self.state.segment is not None:
                self.state.segment.close()
                self.state.segment = None


def acquire(path: Path) -> int:
    """Take the per-device lock ``<socket>.lock`` (held for the daemon's life) and clear a stale socket.

    Raises :class:`FastloadError` when another daemon holds the lock or a live daemon answers on the socket.
    Returns the lock's file descriptor.
    """
    lock_path = Path(str(path) + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FastloadError(f"another preload daemon already serves this device (lock {lock_path} is held); "
                            f"stop it first or use another --weight-cache-socket-dir") from None
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(2)
        try:
            probe.connect(str(path))
            os.close(fd)
            raise FastloadError(f"a live daemon answers on {path}; refusing to replace it")
        except (ConnectionRefusedError, FileNotFoundError):
            logger.warning("fastload: removing stale socket %s (no listener)", path)
            path.unlink(missing_ok=True)
        finally:
            probe.close()
    return fd


def serve_rank(vllm_config: Any, local_rank: int, rank: int, world_size: int, init_method: str,
               socket_dir: Path, ready: Any = None) -> int:
    """Run one rank: lock, bind the socket (engines that connect now wait for the load), load, export, serve
    until SIGTERM/SIGINT. A signal during the load aborts it. Socket and lock are removed on every exit.
    Returns the exit code."""
    from vllm.platforms import current_platform

    identity = device_identity(current_platform.device_type, local_rank)
    path = socket_path(socket_dir, identity)
    lock_fd = acquire(path)
    state = RankState(fingerprint={}, segment=None, manifest={}, model=vllm_config.model_config.model,
                      device=identity, socket=str(path), load_s=0.0, nbytes=0, loading=True)
    server = RankServer(state, path)
    stopping = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stopping.set()
        if state.loading:
            raise KeyboardInterrupt(f"signal {signum} while loading")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server.bind()
        threading.Thread(target=server.serve_forever, daemon=True).start()
        logger.info("fastload: serving on %s (engines that connect now wait until the load is done)", path)
        try:
            segment, manifest, seconds = build_and_export(vllm_config, local_rank, rank, world_size, init_method)
        except KeyboardInterrupt:
            logger.warning("fastload: rank %d: load aborted by a signal", rank)
            return 130
        with state.lock:
            state.segment, state.manifest, state.load_s = segment, manifest, seconds
            state.fingerprint = manifest["fingerprint"]
            state.nbytes = sum(e["nbytes"] for e in manifest["tensors"].values())
            state.loading = False
        state.ready.set()
        logger.info("fastload: rank %d exported %d tensors (%.2f GiB) in %.2f s", rank, len(manifest["tensors"]),
                    state.nbytes / 2**30, seconds)
        if ready is not None:
            ready.put((rank, str(path)))
        else:
            logger.info("fastload: ready")
        while not stopping.wait(0.5):
            pass
        return 0
    finally:
        server.close()
        os.close(lock_fd)
        Path(str(path) + ".lock").unlink(missing_ok=True)
        logger.info("fastload: rank %d stopped; socket and shared memory removed", rank)


# --- health and metrics (main process) ------------------------------------------------------------------
def metrics_text(statuses: list[Optional[dict]]) -> bytes:
    """Prometheus exposition of the ranks' statuses (prometheus_client)."""
    from prometheus_client import CollectorRegistry, Gauge, Info, generate_latest

    reg = CollectorRegistry()
    g = {k: Gauge(f"vllm_fastload_{k}", h, ["rank"], registry=reg) for k, h in (
        ("tensors", "tensors exported"), ("bytes", "bytes held in shared memory"),
        ("attached_clients", "clients attached now"), ("attaches_total", "attaches since start"),
        ("fallbacks_seen_total", "clients refused with a fingerprint mismatch (they fell back)"),
        ("load_seconds", "seconds the rank took to load and export"), ("ready", "1 when the rank serves"))}
    info = Info("vllm_fastload_fingerprint", "fingerprint of the cached weights", ["rank"], registry=reg)
    for r, st in enumerate(statuses):
        lab = str(r)
        g["ready"].labels(lab).set(1 if st and st.get("state") == "ready" else 0)
        if not st:
            continue
        g["tensors"].labels(lab).set(st["tensors"])
        g["bytes"].labels(lab).set(st["bytes"])
        g["attached_clients"].labels(lab).set(st["clients"])
        g["attaches_total"].labels(lab).set(st["attaches"])
        g["fallbacks_seen_total"].labels(lab).set(st["fingerprint_mismatches"])
        g["load_seconds"].labels(lab).set(st["load_seconds"])
        info.labels(lab).info({"short": st.get("fingerprint_short") or "", "model": str(st["model"])})
    return generate_latest(reg)


def start_health_server(host: str, port: int, sockets: list[str]) -> ThreadingHTTPServer:
    """``GET /health`` (200 when every rank is ready, else 503) and ``GET /metrics`` on ``host:port``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            statuses = [status_of(p) for p in sockets] if sockets else []
            if self.path == "/health":
                ok = bool(statuses) and all(s and s.get("state") == "ready" for s in statuses)
                body = json.dumps({"ready": ok, "ranks": [s and s.get("state") for s in statuses]}).encode()
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

    srv = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _rank_main(args: tuple) -> None:  # multiprocessing target (spawn)
    sys.exit(serve_rank(*args))


def add_daemon_flags(parser: Any) -> Any:
    """The daemon's own flags (names as upstream ``vllm preload``); every other flag is a vLLM engine arg."""
    parser.add_argument("--weight-cache-socket-dir", default=None,
                        help="directory of the daemons' sockets (default $XDG_RUNTIME_DIR/vllm-fastload or "
                             "/tmp/vllm-fastload-<uid>); created 0700, must be owned by you")
    parser.add_argument("--weight-cache-health-port", type=int, default=None,
                        help="serve GET /health and /metrics on this port (off when not given)")
    parser.add_argument("--weight-cache-health-host", default="0.0.0.0",
                        help="address of the health server (0.0.0.0 as upstream; use 127.0.0.1 unless a probe "
                             "from outside the host needs it)")
    return parser


def main(argv: list[str]) -> int:
    """``vllm-fastload preload``: parse vLLM's engine args plus our flags, start one daemon per local rank."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm-fastload preload",
                                    description="Keep post-processed weights resident for --load-format ipc_cache.")
    add_daemon_flags(parser)
    parser = EngineArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    # Socket names carry the device identity (a GPU UUID): check the path length before vLLM's config setup and
    # before creating the directory, so a too-long --weight-cache-socket-dir fails at once and leaves nothing.
    from vllm.platforms import current_platform as _platform

    socket_path(Path(args.weight_cache_socket_dir) if args.weight_cache_socket_dir else default_socket_dir(),
                device_identity(_platform.device_type, 0))
    if not any(a.split("=", 1)[0] in ("--load-format", "--load_format") for a in argv):
        args.load_format = DEFAULT_LOAD_FORMAT
    engine_args = EngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config()
    pc = vllm_config.parallel_config
    world = pc.tensor_parallel_size * pc.pipeline_parallel_size
    socket_dir = ensure_socket_dir(args.weight_cache_socket_dir)
    logger.info("fastload: starting %d daemon(s) for %s in %s", world, vllm_config.model_config.model, socket_dir)
    import tempfile

    init_method = f"file://{tempfile.mktemp(prefix='fastload-dist-')}"
    from vllm.platforms import current_platform

    sockets = [str(socket_path(socket_dir, device_identity(current_platform.device_type, r))) for r in range(world)]
    health = None
    if args.weight_cache_health_port is not None:
        health = start_health_server(args.weight_cache_health_host, args.weight_cache_health_port, sockets)
    if world == 1:
        code = serve_rank(vllm_config, 0, 0, 1, init_method, socket_dir)
    else:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        procs = [ctx.Process(target=_rank_main, args=((vllm_config, r, r, world, init_method, socket_dir, ready),))
                 for r in range(world)]
        for p in procs:
            p.start()

        def forward(signum: int, _f: Any) -> None:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGTERM)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        import queue as _queue

        pending = world
        while pending:
            try:
                ready.get(timeout=1.0)
                pending -= 1
            except _queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive()]
                if dead:
                    logger.error("fastload: rank(s) %s exited while loading; stopping the others", dead)
                    forward(signal.SIGTERM, None)
                    break
        if not pending:
            logger.info("fastload: ready")
        for p in procs:
            p.join()
        code = max((p.exitcode or 0) for p in procs) or (1 if pending else 0)
    if health is not None:
        health.shutdown()
    return code
