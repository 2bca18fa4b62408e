"""A stand-in preload daemon for the fault tests, in its own process so a test can SIGKILL it.

``python -m tests.unit.ipc_fake_daemon SOCK`` serves a small packed segment (:func:`weights`) with the real
``RankServer`` (real lock, real socket, real protocol) until killed. ``--nofile N`` lowers its fd limit first,
``--max-connections`` / ``--idle-timeout-s`` set the daemon's limits, ``--health-port`` also serves the real health
server on 127.0.0.1. ``--half-manifest`` instead plays a daemon
killed during the hand-over: it answers the first hello with the first half of a manifest frame (and the segment's
file descriptor, as the real daemon sends it with the frame's first bytes), then SIGKILLs itself.
Prints ``ready`` once the socket accepts connections.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import struct
from pathlib import Path

import torch

from tests.conftest import make_fingerprint as fingerprint  # importers use `fingerprint` from here
from tests.conftest import unix_listener
from vllm_fastload.fingerprint import Fingerprint
from vllm_fastload.ipc.daemon.export import pack
from vllm_fastload.ipc.daemon.health import start_health_server
from vllm_fastload.ipc.daemon.rank import Limits, RankState
from vllm_fastload.ipc.daemon.server import RankServer, acquire
from vllm_fastload.ipc.memory.constructed import SmallOnDevice
from vllm_fastload.ipc.memory.memfd import MemfdTransport
from vllm_fastload.ipc.wire import protocol
from vllm_fastload.ipc.wire.messages import Constructed, Manifest, SegmentMeta, to_frame


def weights(n_extra: int = 0) -> dict[str, torch.Tensor]:
    """``w`` (4000 bytes of known values) plus ``n_extra`` one-element tensors (a large manifest)."""
    out = {"w": torch.arange(1000, dtype=torch.float32)}
    out.update({f"extra.{i}": torch.full((1,), float(i)) for i in range(n_extra)})
    return out


def describe(seg) -> SegmentMeta:
    """The manifest's entry of a CPU segment, as its transport writes it."""
    return MemfdTransport().describe(seg, torch.device("cpu"))


def make_state(path, fp: Fingerprint, tensors: dict[str, torch.Tensor]) -> RankState:
    """A ready RankState serving ``tensors`` packed into one segment, as ``serve_rank`` builds it after a load."""
    seg, entries = pack(tensors)
    manifest = Manifest(version=protocol.PROTOCOL_VERSION, fingerprint=fp.to_dict(), fingerprint_short=fp.short(),
                        constructed=Constructed(digest=SmallOnDevice("cpu").digest(), kept=0),
                        segment=describe(seg), tensors=entries)
    st = RankState(fingerprint=fp.to_dict(), segment=seg, manifest=manifest, model="m", device="dev",
                   socket=str(path), load_s=0.0, nbytes=entries.total_bytes())
    st.ready.set()
    return st


def serve(path: str, limits: Limits, health_port: int = 0) -> None:
    acquire(Path(path))  # the lock fd stays open for the process's life
    srv = RankServer(make_state(path, fingerprint(), weights()), path, None, limits)
    srv.bind()
    if health_port:
        start_health_server("127.0.0.1", health_port, [path], limits)
    print("ready", flush=True)
    srv.serve_forever()


def half_manifest(path: str) -> None:
    st = make_state(path, fingerprint(), weights(2000))
    s = unix_listener(path)
    print("ready", flush=True)
    conn, _ = s.accept()
    protocol.recv(conn)  # the hello
    body = json.dumps(to_frame(st.manifest)).encode()
    data = struct.pack(">I", len(body)) + body[: len(body) // 2]
    socket.send_fds(conn, [data[:1024]], [st.segment.fd])
    conn.sendall(data[1024:])
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("socket")
    p.add_argument("--half-manifest", action="store_true")
    p.add_argument("--nofile", type=int, default=0)
    p.add_argument("--max-connections", type=int, default=Limits.max_connections)
    p.add_argument("--idle-timeout-s", type=float, default=Limits.idle_timeout_s)
    p.add_argument("--health-port", type=int, default=0)
    a = p.parse_args()
    if a.nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (a.nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    if a.half_manifest:
        half_manifest(a.socket)
    else:
        serve(a.socket, Limits(a.max_connections, a.idle_timeout_s), a.health_port)


if __name__ == "__main__":
    main()
