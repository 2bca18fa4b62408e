"""``vllm-fastload preload <engine args>``: one daemon per local rank keeps post-processed weights resident.

Each rank builds the model exactly as the engine will (vLLM's engine-argument parser, its ``VllmConfig``, its
parallel state), loads it (through our ``runai_streamer`` unless ``--load-format`` says otherwise), runs
post-processing, collects what the model holds (:mod:`.state`), packs it into one shared-memory segment
(:mod:`.shm`), drops the model and serves the segment over a 0600 Unix socket until SIGTERM/SIGINT.
Flag names follow upstream ``vllm preload`` (``--weight-cache-socket-dir``, ``--weight-cache-health-port``,
``--weight-cache-health-host``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator, Optional

from ..errors import FastloadError
from ..log import logger
from . import messages, protocol
from .client import status_of
from .paths import SocketDir, SocketDirSpec, device_identity, socket_dir_spec, socket_path
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
                    "content_digest": self.manifest.get("content_digest"),
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
            content_digest = getattr(loader, "content_digest", None)  # our runai_streamer with content_hash
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
                "object_attrs": exp.object_attrs, "content_digest": content_digest}
    by_dtype: dict[str, int] = {}
    for e in entries.values():
        by_dtype[e["dtype"]] = by_dtype.get(e["dtype"], 0) + int(e["nbytes"])
    logger.info("fastload: rank %d: %d tensors exported as is (bytes by dtype: %s), %d module(s) re-processed by the "
                "engine: %s", rank, len(entries), ", ".join(f"{d}={n}" for d, n in sorted(by_dtype.items())),
                len(exp.reprocess), ", ".join(exp.reprocess[:6]) + (" ..." if len(exp.reprocess) > 6 else ""))
    return segment, manifest, time.perf_counter() - t0


#: Defaults of the connection limits (flags ``--weight-cache-max-connections``, ``-idle-timeout-s``,
#: ``-attach-timeout-s``).
MAX_CONNECTIONS = 256
IDLE_TIMEOUT_S = 30.0
ATTACH_TIMEOUT_S = 600.0
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
    """One connection's place in the conversation: who it is (``SO_PEERCRED``), whether it got the manifest and in
    which mode it attached."""

    cid: int
    pid: int
    uid: int
    got_manifest: bool = False
    mode: Optional[str] = None


class RankServer:
    """Serves one rank's segment on its Unix socket (one thread per connection, at most ``max_connections``).

    Connections that are not an attached zero_copy lease must send a complete frame every ``idle_timeout_s``
    seconds (``attach_timeout_s`` between the manifest and the attach, while the engine maps); a frame must arrive
    whole within ``idle_timeout_s`` of its first byte. Every request is validated (:mod:`.messages`) and must fit
    the conversation (attach after the manifest; release after a copy-mode attach); anything else is answered
    with an error frame. The accept loop survives every accept error (logged, with a pause).
    ``sdir``: the opened socket directory (default: ``path``'s directory, opened and checked here)."""

    def __init__(self, state: RankState, path: Path, sdir: Optional[SocketDir] = None,
                 max_connections: int = MAX_CONNECTIONS, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 attach_timeout_s: float = ATTACH_TIMEOUT_S):
        self.state, self.path = state, Path(path)
        self._own_dir = sdir is None
        self.sdir = sdir or SocketDir.open(SocketDirSpec(self.path.parent, "the directory of the socket",
                                                         "--weight-cache-socket-dir"))
        self.max_connections, self.idle_timeout_s, self.attach_timeout_s = max_connections, idle_timeout_s, attach_timeout_s
        self.sock: Optional[socket.socket] = None
        self.stop = threading.Event()
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
            except socket.timeout:
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
                full = self._active >= self.max_connections
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
        reason = (f"the daemon already serves {self.max_connections} connections (--weight-cache-max-connections); "
                  f"this one is refused: retry later, or raise the limit")
        try:
            conn.settimeout(0.2)
            protocol.send(conn, {"type": "error", "reason": reason})
        except OSError:
            pass
        conn.close()
        self._log("full", logging.WARNING, "fastload: refused a connection on %s: %d connections open "
                  "(--weight-cache-max-connections %d)", self.path, self.max_connections, self.max_connections)

    def _timeout_for(self, c: _Client) -> Optional[float]:
        """How long the daemon waits for this connection's next frame."""
        if c.mode == "zero_copy":
            return None  # the connection is the lease: open as long as the engine maps the memory
        if c.got_manifest and c.mode is None:
            return self.attach_timeout_s
        return self.idle_timeout_s

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
                protocol.send(conn, {"type": "error", "reason": f"peer uid {c.uid} is not the daemon's uid "
                                     f"{os.getuid()} (or root); run the engine as the same user as "
                                     f"`vllm-fastload preload`"})
                return
            while self._serve_one(conn, c):
                pass
        except OSError as e:  # the client went away while we were sending (killed mid-transfer): not our failure
            logger.info("fastload: client %d disconnected while the daemon was sending to it (%s: %s); still serving",
                        c.cid, type(e).__name__, e)
        except Exception as e:  # noqa: BLE001 - a bug handling one client must not take the daemon down
            logger.exception("fastload: internal error serving client %d (pid %d); closed its connection", c.cid, c.pid)
            try:
                protocol.send(conn, {"type": "error", "reason": f"internal error in the daemon ({type(e).__name__}: "
                                     f"{e}); see its log"})
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
        st = self.state
        timeout = self._timeout_for(c)
        conn.settimeout(timeout)
        try:
            raw, fds = protocol.recv(conn, frame_timeout_s=self.idle_timeout_s)
        except socket.timeout:
            what = "between the manifest and the attach (--weight-cache-attach-timeout-s)" if timeout == \
                self.attach_timeout_s and c.got_manifest else "(--weight-cache-idle-timeout-s)"
            self._log("idle", logging.INFO, "fastload: closed client %d (pid %d): no complete frame within %g s %s",
                      c.cid, c.pid, timeout or self.idle_timeout_s, what)
            conn.settimeout(1.0)
            protocol.send(conn, {"type": "error", "reason": f"no complete frame within {timeout or self.idle_timeout_s:g}"
                                 f" s {what}; closing the connection"})
            return False
        except protocol.PeerClosed:
            return False
        except protocol.ProtocolError as e:
            if "connection closed" not in str(e):
                self._log("frame", logging.WARNING, "fastload: closed client %d (pid %d): %s", c.cid, c.pid, e)
                conn.settimeout(1.0)
                protocol.send(conn, {"type": "error", "reason": f"bad frame: {e}; closing the connection"})
            return False
        protocol.close_fds(fds)
        try:
            msg = messages.parse_request(raw)
        except messages.MessageError as e:
            self._log("invalid", logging.WARNING, "fastload: client %d (pid %d) sent an invalid message: %s",
                      c.cid, c.pid, e)
            protocol.send(conn, {"type": "error", "reason": str(e)})
            return True
        if isinstance(msg, messages.Status):
            protocol.send(conn, st.status())
        elif isinstance(msg, messages.Hello):
            if self._hello(conn, msg):
                c.got_manifest = True
        elif isinstance(msg, messages.Attach):
            if not c.got_manifest or c.mode is not None:
                why = "attach before this connection received the manifest (send hello first)" if not c.got_manifest \
                    else f"this connection is already attached ({c.mode})"
                protocol.send(conn, {"type": "error", "reason": f"attach refused: {why}"})
                return True
            c.mode = msg.mode
            with st.lock:
                st.clients[c.cid] = msg.mode
                st.attaches += 1
                n = len(st.clients)
            logger.info("fastload: client %d (pid %d, uid %d) attached in %s mode; %d engine(s) attached", c.cid, c.pid,
                        c.uid, msg.mode, n)
            protocol.send(conn, {"type": "attached", "clients": n})
        elif isinstance(msg, messages.Release):
            if c.mode != "copy":
                self._log("release", logging.WARNING, "fastload: refused a release from client %d (pid %d, uid %d): "
                          "only a connection that received the manifest and attached in copy mode may release",
                          c.cid, c.pid, c.uid)
                protocol.send(conn, {"type": "error", "reason": "release refused: only a connection that received "
                                     "the manifest and attached in copy mode may release the daemon's memory"})
                return True
            protocol.send(conn, {"type": "released", "freed": self._release(c)})
            c.mode = "released"
        else:  # bye
            return False
        return True

    def _hello(self, conn: socket.socket, msg: "messages.Hello") -> bool:
        """Answer a valid hello with the manifest (True) or an error (False)."""
        from ..fingerprint import Fingerprint

        st = self.state
        st.ready.wait()  # an engine that connects while the daemon loads waits (bounded by its state_timeout_s)
        theirs = msg.to_fingerprint()
        mine = Fingerprint.from_dict(st.fingerprint)
        diff = mine.mismatched_fields(theirs)
        if diff:
            with st.lock:
                st.mismatches += 1
            logger.warning("fastload: refused client pid %s (it falls back to disk): fingerprint mismatch: %s",
                           msg.pid, mine.explain(theirs))
            protocol.send(conn, {"type": "error", "reason": "fingerprint mismatch: " + mine.explain(theirs),
                                 "mismatched": [[n, a, b] for n, a, b in diff]})
            return False
        # Take what to send under the lock, send outside it: a client that stops reading must not block the
        # status, attach and hello of every other client.
        with st.lock:
            seg = st.segment
            fd = -1 if st.released or seg is None else os.dup(seg.fd)
            manifest = st.manifest
        if fd < 0:
            protocol.send(conn, {"type": "error", "reason": "the daemon's cache was released by a copy-mode "
                                 "client; restart `vllm-fastload preload` to fill it again"})
            return False
        try:
            protocol.send(conn, manifest, fds=[fd])
        finally:
            os.close(fd)
        return True

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


def _lock_name(path: Path) -> str:
    return path.name + ".lock"


def _lock_held(path: Path) -> FastloadError:
    return FastloadError(f"another preload daemon already serves this device (lock {path}.lock is held); stop it "
                         f"first or use another --weight-cache-socket-dir")


def check_lock_free(path: Path, sdir: SocketDir) -> None:
    """Raise the "another preload daemon" error when the lock of socket ``path`` is held now (taken and given back
    at once: a pre-check before anything else binds, such as the health port)."""
    try:
        fd = sdir.open_file(_lock_name(path), os.O_RDWR)
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

    Raises :class:`FastloadError` when another daemon holds the lock or a live daemon answers on the socket.
    Returns the lock's file descriptor.
    """
    path = Path(path)
    own = sdir is None
    sdir = sdir or SocketDir.open(SocketDirSpec(path.parent, "the directory of the socket", "--weight-cache-socket-dir"))
    try:
        fd = sdir.open_file(_lock_name(path), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _lock_held(path) from None
        if sdir.lstat(path.name) is not None:
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


@dataclass(frozen=True)
class Limits:
    """The daemon's connection limits (flags ``--weight-cache-max-connections``, ``--weight-cache-idle-timeout-s``,
    ``--weight-cache-attach-timeout-s``): per server (each rank's socket, the health port), seconds."""

    max_connections: int = MAX_CONNECTIONS
    idle_timeout_s: float = IDLE_TIMEOUT_S
    attach_timeout_s: float = ATTACH_TIMEOUT_S


def serve_rank(vllm_config: Any, local_rank: int, rank: int, world_size: int, init_method: str,
               socket_dir: Any, ready: Any = None, limits: Limits = Limits()) -> int:
    """Run one rank: open and check the socket dir (a :class:`.paths.SocketDirSpec`, or a path), lock, bind the
    socket (engines that connect now wait for the load), load, export, serve until SIGTERM/SIGINT. A signal during
    the load aborts it. Socket and lock are removed on every exit. Returns the exit code."""
    from vllm.platforms import current_platform

    spec = socket_dir if isinstance(socket_dir, SocketDirSpec) else socket_dir_spec(str(socket_dir))
    identity = device_identity(current_platform.device_type, local_rank)
    path = socket_path(spec.path, identity)
    sdir = SocketDir.open(spec, create=True)
    try:
        lock_fd = acquire(path, sdir)
    except BaseException:
        sdir.close()
        raise
    state = RankState(fingerprint={}, segment=None, manifest={}, model=vllm_config.model_config.model,
                      device=identity, socket=str(path), load_s=0.0, nbytes=0, loading=True)
    server = RankServer(state, path, sdir, limits.max_connections, limits.idle_timeout_s, limits.attach_timeout_s)
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
        sdir.unlink(_lock_name(path))
        os.close(lock_fd)
        sdir.close()
        logger.info("fastload: rank %d stopped; socket and shared memory removed", rank)


# --- health and metrics (main process) ------------------------------------------------------------------
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


def metrics_text(statuses: list[Optional[dict]]) -> bytes:
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
                ready.add_metric([str(r)], 1 if st and st.get("state") == "ready" else 0)
                if not st:
                    continue
                for name, _, _, key in METRICS:
                    fams[name].add_metric([str(r)], st[key])
                info.add_metric([str(r)], {"short": st.get("fingerprint_short") or "", "model": str(st["model"])})
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

    def get_request(self) -> Any:  # socketserver skips the request on OSError; pause so the loop does not spin
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


def _rank_main(args: tuple) -> None:  # multiprocessing target (spawn)
    sys.exit(serve_rank(*args))


def add_daemon_flags(parser: Any) -> Any:
    """The daemon's own flags (names as upstream ``vllm preload``); every other flag is a vLLM engine arg."""
    parser.add_argument("--weight-cache-socket-dir", default=None,
                        help="directory of the daemons' sockets (default $XDG_RUNTIME_DIR/vllm-fastload or "
                             "/tmp/vllm-fastload-<uid>); created 0700, must be owned by you and not be a symbolic "
                             "link")
    parser.add_argument("--weight-cache-health-port", type=int, default=None,
                        help="serve GET /health and /metrics on this port (off when not given)")
    parser.add_argument("--weight-cache-health-host", default="0.0.0.0",
                        help="address of the health server (0.0.0.0 as upstream, so Kubernetes httpGet probes reach "
                             "it; use 127.0.0.1 unless a probe from outside the host needs it)")
    parser.add_argument("--weight-cache-max-connections", type=_positive(int), default=MAX_CONNECTIONS,
                        help="connections each rank socket, and the health port, serve at once; more are refused "
                             "with a clear error (keep 2 x this + 64 below the fd limit, LimitNOFILE)")
    parser.add_argument("--weight-cache-idle-timeout-s", type=_positive(float), default=IDLE_TIMEOUT_S,
                        help="seconds a connection that is not an attached zero_copy engine may stay silent, and "
                             "the most a frame may take to arrive once it started; health requests get at most "
                             "min(this, 10) s")
    parser.add_argument("--weight-cache-attach-timeout-s", type=_positive(float), default=ATTACH_TIMEOUT_S,
                        help="seconds an engine may take between receiving the manifest and attaching (it maps and "
                             "verifies the weights in between); then the daemon closes the connection and the "
                             "engine loads from disk")
    return parser


def _positive(kind: type) -> Any:
    """An argparse type: a number of ``kind`` greater than 0."""
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise ValueError(text)
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def raise_fd_limit(limits: Limits) -> int:
    """Raise this process's soft fd limit to its hard limit (it only caps how many connections the daemon can hold
    at once) and WARN when it stays below what ``limits`` needs (two servers of ``max_connections`` plus 64 for
    the daemon's own files). Returns the soft limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    need = 2 * limits.max_connections + 64
    if soft < need:
        logger.warning("fastload: the fd limit is %d, below the %d that --weight-cache-max-connections %d needs; "
                       "raise LimitNOFILE (systemd) / ulimit -n, or lower the flag. Accepting pauses at the limit "
                       "and goes on when connections close", soft, need, limits.max_connections)
    return soft


@contextlib.contextmanager
def private_init_method() -> Iterator[str]:
    """``file://`` init method for ``torch.distributed`` in a fresh private directory (``mkdtemp``: 0700, unique,
    named ``fastload-dist-<pid>-*`` in the temp dir), removed when the block ends, whatever ends it (a return, an
    error, SIGTERM/SIGINT through the normal shutdown). Only SIGKILL can leave it behind."""
    d = tempfile.mkdtemp(prefix=f"fastload-dist-{os.getpid()}-")
    try:
        yield f"file://{d}/store"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str]) -> int:
    """``vllm-fastload preload``: parse vLLM's engine args plus our flags, start one daemon per local rank."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm-fastload preload",
                                    description="Keep post-processed weights resident for --load-format ipc_cache.")
    add_daemon_flags(parser)
    parser = EngineArgs.add_cli_args(parser)

    def short_error(message: str) -> None:  # argparse's default prints ~250 lines of usage before the message
        print(f"vllm-fastload preload: error: {message}\n(`vllm-fastload preload --help` lists the daemon's flags, "
              f"`--help=all` vLLM's engine args)", file=sys.stderr)
        sys.exit(2)

    parser.error = short_error
    args = parser.parse_args(argv)
    # Socket names carry the device identity (a GPU UUID): check the path length and the directory before vLLM's
    # config setup, so a bad --weight-cache-socket-dir fails at once (a too-long one leaves nothing behind).
    spec = socket_dir_spec(args.weight_cache_socket_dir)
    socket_path(spec.path, device_identity(current_platform.device_type, 0))
    SocketDir.open(spec, create=True).close()
    limits = Limits(args.weight_cache_max_connections, args.weight_cache_idle_timeout_s,
                    args.weight_cache_attach_timeout_s)
    if not any(a.split("=", 1)[0] in ("--load-format", "--load_format") for a in argv):
        args.load_format = DEFAULT_LOAD_FORMAT
    engine_args = EngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config()
    pc = vllm_config.parallel_config
    world = pc.tensor_parallel_size * pc.pipeline_parallel_size
    logger.info("fastload: starting %d daemon(s) for %s in %s", world, vllm_config.model_config.model, spec.path)
    sockets = [socket_path(spec.path, device_identity(current_platform.device_type, r)) for r in range(world)]
    with SocketDir.open(spec) as sdir:
        for sock in sockets:  # the clear "already serves" error before the health port's "address in use"
            check_lock_free(sock, sdir)
    raise_fd_limit(limits)
    health = None
    if args.weight_cache_health_port is not None:
        health = start_health_server(args.weight_cache_health_host, args.weight_cache_health_port,
                                     [str(p) for p in sockets], limits)
    try:
        with private_init_method() as init_method:
            return _run_ranks(vllm_config, world, init_method, spec, limits)
    finally:
        if health is not None:
            health.shutdown()
            health.server_close()


def _run_ranks(vllm_config: Any, world: int, init_method: str, spec: SocketDirSpec, limits: Limits) -> int:
    """Serve every rank (in this process at world size 1, else one spawned process per rank) until they stop.
    Returns the exit code."""
    if world == 1:
        return serve_rank(vllm_config, 0, 0, 1, init_method, spec, None, limits)
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=((vllm_config, r, r, world, init_method, spec, ready, limits),))
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
    return max((p.exitcode or 0) for p in procs) or (1 if pending else 0)
