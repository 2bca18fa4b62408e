"""``vllm-fastload preload <engine args>``: one daemon per local rank keeps post-processed weights resident.

Each rank builds the model exactly as the engine will (vLLM's engine-argument parser, its ``VllmConfig``, its
parallel state), loads it (through our ``runai_streamer`` unless ``--load-format`` says otherwise), runs
post-processing, collects what the model holds (:mod:`.state`), packs it into one shared-memory segment
(:mod:`.memfd`), drops the model and serves the segment over a 0600 Unix socket until SIGTERM/SIGINT.
Flag names follow upstream ``vllm preload`` (``--weight-cache-socket-dir``, ``--weight-cache-health-port``,
``--weight-cache-health-host``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from ...config import MAX_TIMEOUT_S
from ...log import logger
from ..wire.paths import SocketDir, SocketDirSpec, device_identity, socket_dir_spec, socket_path
from .export import build_and_export
from .health import start_health_server
from .rank import ATTACH_TIMEOUT_S, IDLE_TIMEOUT_S, MAX_CONNECTIONS, Limits, RankState
from .server import RankServer, acquire, check_lock_free, lock_name

DEFAULT_LOAD_FORMAT = "runai_streamer"


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
    state = RankState(fingerprint={}, segment=None, manifest=None, model=vllm_config.model_config.model,
                      device=identity, socket=str(path), load_s=0.0, nbytes=0, loading=True)
    server = RankServer(state, path, sdir, limits)
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
            state.fingerprint = manifest.fingerprint
            state.nbytes = manifest.tensors.total_bytes()
            state.loading = False
        server.warm(manifest)  # encoded once now, not while the first engine's hello waits
        state.ready.set()
        logger.info("fastload: rank %d exported %d tensors (%.2f GiB) in %.2f s", rank, len(manifest.tensors),
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
        sdir.unlink(lock_name(path))
        os.close(lock_fd)
        sdir.close()
        logger.info("fastload: rank %d stopped; socket and shared memory removed", rank)


def _rank_main(args: tuple) -> None:  # multiprocessing target (spawn)
    # the parent joins every rank: a rank that cannot end would hold it
    sys.exit(ending_within(EXIT_GRACE_S, serve_rank, *args))


#: Seconds a preload daemon that has stopped serving (or failed to start) may take to exit before it is ended.
EXIT_GRACE_S = 30.0


def ending_within(seconds: float, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, what it returns or raises passed on; once it returned, raised or called ``sys.exit``, this
    process is made to end within ``seconds`` (:func:`exit_within`) with the status that outcome gives: the
    returned code, the ``SystemExit`` code (:func:`_exit_status`), 130 for ``KeyboardInterrupt``, 1 for any other
    exception (the interpreter prints it first)."""
    code: Any = 1
    try:
        code = fn(*args)
        return code
    except SystemExit as e:  # argparse's and the daemon's short usage errors
        code = e.code
        raise
    except KeyboardInterrupt:
        code = 130
        raise
    finally:
        exit_within(seconds, _exit_status(code))


def _exit_status(code: Any) -> int:
    """The status a process exits with for ``SystemExit(code)``: 0 for None, the number for an int, 1 for anything
    else (a message), as the interpreter does (Python docs, ``SystemExit``)."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def exit_within(seconds: float, code: int) -> threading.Timer:
    """Make sure this process ends within ``seconds`` with exit status ``code``: a daemon thread that calls
    ``os._exit(code)`` then, after flushing stdout and stderr. For a preload daemon that has stopped serving or
    failed to load: its socket and lock are gone by then, but the libraries it loaded may keep the interpreter
    from ending (a non-daemon thread, the process group of a distributed backend: Python waits for every
    non-daemon thread before it exits, "Thread objects", Python docs), and a supervisor that waits for an exit to
    restart the daemon would wait for ever. A process that ends earlier on its own is unaffected. Returns the
    timer (started)."""
    def end() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)

    timer = threading.Timer(seconds, end)
    timer.daemon = True
    timer.start()
    return timer


def add_daemon_flags(parser: Any) -> Any:
    """The daemon's own flags (names as upstream ``vllm preload``); every other flag is a vLLM engine arg."""
    parser.add_argument("--weight-cache-socket-dir", default=None,
                        help="directory of the daemons' sockets (default $XDG_RUNTIME_DIR/vllm-fastload or "
                             "/tmp/vllm-fastload-<uid>); created 0700, must be owned by you and not be a symbolic "
                             "link")
    parser.add_argument("--weight-cache-health-port", type=_port, default=None,
                        help="serve GET /health and /metrics on this port (off when not given)")
    parser.add_argument("--weight-cache-health-host", default="0.0.0.0",
                        help="address of the health server (0.0.0.0 as upstream, so Kubernetes httpGet probes reach "
                             "it; use 127.0.0.1 unless a probe from outside the host needs it)")
    parser.add_argument("--weight-cache-max-connections", type=_positive(int), default=MAX_CONNECTIONS,
                        help="connections each rank socket, and the health port, serve at once; more are refused "
                             "with a clear error (keep 2 x this + 64 below the fd limit, LimitNOFILE)")
    parser.add_argument("--weight-cache-idle-timeout-s", type=_positive(float, MAX_TIMEOUT_S), default=IDLE_TIMEOUT_S,
                        help="seconds a connection that is not an attached zero_copy engine may stay silent, and "
                             "the most a frame may take to arrive once it started; health requests get at most "
                             "min(this, 10) s")
    parser.add_argument("--weight-cache-attach-timeout-s", type=_positive(float, MAX_TIMEOUT_S),
                        default=ATTACH_TIMEOUT_S,
                        help="seconds an engine may take between receiving the manifest and attaching (it maps and "
                             "verifies the weights in between); then the daemon closes the connection and the "
                             "engine loads from disk")
    return parser


def _positive(kind: type, most: float | None = None) -> Any:
    """An argparse type: a number of ``kind`` greater than 0 (and at most ``most``); else argparse's error naming
    the flag and the allowed range."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0 or (most is not None and not value <= most):
            bound = f" and at most {most:g}" if most is not None else ""
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__} > 0{bound}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _port(text: str) -> int:
    """An argparse type: a TCP port from 1 to 65535 (0, "any free port", would leave probes nowhere to look)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port from 1 to 65535")
    return value


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

    stopping = threading.Event()

    def forward(signum: int, _f: Any) -> None:
        stopping.set()
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
    _join_ranks(procs, stopping, 2 * EXIT_GRACE_S)
    return max((p.exitcode or 0) for p in procs) or (1 if pending else 0)


def _join_ranks(procs: list, stopping: threading.Event, kill_after_s: float) -> None:
    """Wait until every rank process of ``procs`` (``multiprocessing.Process``) ended. Once a stop was asked
    (``stopping``: SIGTERM/SIGINT forwarded, or a rank that died while loading), a rank still alive after
    ``kill_after_s`` is killed (SIGKILL, logged): one stuck where its own exit timer never starts (inside a
    blocking call of a distributed backend whose peer is gone) would otherwise keep this process waiting for
    ever. While the ranks serve, nothing is asked and this waits as long as they serve."""
    deadline = None
    while True:
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            return
        if stopping.is_set() and deadline is None:
            deadline = time.monotonic() + kill_after_s
        if deadline is not None and time.monotonic() >= deadline:
            for p in alive:
                logger.error("fastload: rank process %d did not exit within %.0f s of the stop; killing it", p.pid,
                             kill_after_s)
                p.kill()
            for p in alive:
                p.join()
            return
        alive[0].join(timeout=0.5)
