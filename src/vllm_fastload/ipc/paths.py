"""Socket directory, socket names and the device identity both daemon and engine derive them from."""

from __future__ import annotations

import hashlib
import os
import socket
import stat
from pathlib import Path
from typing import Optional

from ..errors import FastloadError


def default_socket_dir() -> Path:
    """``$XDG_RUNTIME_DIR/vllm-fastload`` when set, else ``/tmp/vllm-fastload-<uid>``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "vllm-fastload" if runtime else Path(f"/tmp/vllm-fastload-{os.getuid()}")


def ensure_socket_dir(path: Optional[str], create: bool = True) -> Path:
    """Return the socket directory, creating it 0700. Raises :class:`FastloadError` when it is owned by another
    user or writable by group/others (a shared directory would let others plant sockets)."""
    d = Path(path) if path else default_socket_dir()
    if create:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not d.exists():
        return d
    st = d.stat()
    if st.st_uid != os.getuid():
        raise FastloadError(
            f"socket dir {d} is owned by uid {st.st_uid}, not by this user ({os.getuid()}); use a directory you own "
            f"(--weight-cache-socket-dir / \"socket_dir\")")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise FastloadError(
            f"socket dir {d} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); chmod 700 {d}")
    return d


def device_identity(device_type: str, local_rank: int) -> str:
    """A stable name of the device a rank uses: the GPU UUID on CUDA/ROCm (so ``CUDA_VISIBLE_DEVICES`` reordering
    cannot cross-connect ranks); ``cpu-<host hash>-r<rank>`` on CPU."""
    if device_type in ("cuda", "rocm"):
        import torch

        uuid = str(torch.cuda.get_device_properties(local_rank).uuid)
        return f"gpu-{uuid}"
    host = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
    return f"cpu-{host}-r{local_rank}"


#: Longest Unix socket path Linux accepts (``sun_path`` is 108 bytes including the terminating NUL; unix(7)).
MAX_SOCKET_PATH = 107


def socket_path(socket_dir: Path, identity: str, role: str = "target") -> Path:
    """``<dir>/<identity>-<role>.sock``. GPU identities are UUIDs (~40 characters), so the directory must stay
    short: raises :class:`FastloadError` naming the path when it exceeds :data:`MAX_SOCKET_PATH` bytes."""
    path = Path(socket_dir) / f"{identity}-{role}.sock"
    n = len(str(path).encode())
    if n > MAX_SOCKET_PATH:
        raise FastloadError(
            f"socket path {path} is {n} bytes; Unix sockets allow {MAX_SOCKET_PATH}. The file name takes "
            f"{len(path.name)}, so use a socket dir of at most {MAX_SOCKET_PATH - len(path.name) - 1} bytes "
            f"(--weight-cache-socket-dir / \"socket_dir\", e.g. $XDG_RUNTIME_DIR/vllm-fastload)")
    return path
