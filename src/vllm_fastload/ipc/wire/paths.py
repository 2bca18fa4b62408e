"""Socket directory, socket names and the device identity both daemon and engine derive them from."""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ...errors import FastloadError, SocketDirError


def default_socket_dir() -> Path:
    """``$XDG_RUNTIME_DIR/vllm-fastload`` when set, else ``/tmp/vllm-fastload-<uid>``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "vllm-fastload" if runtime else Path(f"/tmp/vllm-fastload-{os.getuid()}")


#: vLLM's own weight cache (vLLM >= 0.31, ``vllm preload``; ``model_loader/weight_cache/protocol.py``): its
#: default socket directory under the temp dir and its socket names. Only used to recognise its sockets.
UPSTREAM_DIR = "vllm_weight_cache_{uid}"
UPSTREAM_SOCKETS = "vllm_weight_cache_*.sock"


def upstream_sockets(socket_dir: Path) -> list[str]:
    """Sockets of vLLM's own ``vllm preload`` daemon in ``socket_dir`` or in its default directory
    (``$TMPDIR/vllm_weight_cache_<uid>``), sorted; empty when there are none (or the directories cannot be read)."""
    import glob
    import tempfile

    found: set[str] = set()
    for d in (Path(socket_dir), Path(tempfile.gettempdir()) / UPSTREAM_DIR.format(uid=os.getuid())):
        try:
            found.update(glob.glob(str(d / UPSTREAM_SOCKETS)))
        except OSError:
            pass
    return sorted(found)


#: How each side names the setting that chooses the socket directory (for the fix in error messages).
DAEMON_FLAG = "--weight-cache-socket-dir"
ENGINE_KEY = '"socket_dir" in --model-loader-extra-config'


@dataclass(frozen=True)
class SocketDirSpec:
    """A socket directory and where it came from: ``origin`` for messages (``from --weight-cache-socket-dir``,
    ``from $XDG_RUNTIME_DIR=/run/user/1000``, ...), ``override`` the setting that chooses another one."""

    path: Path
    origin: str
    override: str

    def fail(self, problem: str, fix: str = "") -> SocketDirError:
        """The error for this directory: ``socket dir D (origin) <problem>; <fix>``."""
        fix = fix or f"use a directory you own, mode 0700 ({self.override} DIR)"
        return SocketDirError(f"socket dir {self.path} ({self.origin}) {problem}; {fix}")


def socket_dir_spec(path: Optional[str], override: str = DAEMON_FLAG) -> SocketDirSpec:
    """The socket directory ``path`` names (``None``: :func:`default_socket_dir`) and where it came from.
    ``override`` names the setting of the calling side (:data:`DAEMON_FLAG`, :data:`ENGINE_KEY`). Raises
    :class:`~vllm_fastload.errors.SocketDirError` for ``""``, which would silently mean the default."""
    if path == "":
        raise SocketDirError(f"{override} is empty, which names no directory; omit it for the default "
                             f"({default_socket_dir()})")
    if path:
        return SocketDirSpec(Path(path), f"from {override}", override)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return SocketDirSpec(default_socket_dir(), f"from $XDG_RUNTIME_DIR={runtime}", override)
    return SocketDirSpec(default_socket_dir(), "the default while $XDG_RUNTIME_DIR is unset", override)


def _blocking_ancestor(d: Path) -> str:
    """The first directory on the way to ``d`` this user may not search, as ``A (uid U, mode M)``; ``""`` if none."""
    for a in [*reversed(d.parents), d]:
        try:
            st = os.stat(a)
        except OSError:
            return ""
        if not os.access(a, os.X_OK):
            return f"{a} (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def _diagnose(spec: SocketDirSpec, e: OSError) -> SocketDirError:
    """The clear error for an ``OSError`` met while creating or opening ``spec.path``."""
    d = spec.path
    try:
        lst = os.lstat(d)
    except OSError:
        lst = None
    if lst is not None and stat.S_ISLNK(lst.st_mode):
        target = os.readlink(d)
        dangling = "" if os.path.exists(d) else ", which does not exist"
        return spec.fail(f"is a symbolic link (to {target}{dangling}, link owned by uid {lst.st_uid}): the socket dir "
                         f"must be the directory itself, or whoever can change the link could hand engines forged "
                         f"weights", f"pass the real directory ({spec.override} DIR) or remove the link")
    if e.errno in (errno.EACCES, errno.EPERM):
        where = _blocking_ancestor(d)
        fix = (f"set XDG_RUNTIME_DIR to this user's own runtime directory (it may be another user's after su/sudo) or "
               f"pass a directory you own ({spec.override} DIR)") if "XDG_RUNTIME_DIR=" in spec.origin else ""
        return spec.fail(f"cannot be used by uid {os.getuid()}: permission denied"
                         + (f" by {where}" if where else ""), fix)
    if e.errno == errno.ENOTDIR or (lst is not None and not stat.S_ISDIR(lst.st_mode)):
        blocker = next((a for a in reversed(d.parents) if os.path.lexists(a) and not os.path.isdir(a)), None)
        if lst is None and blocker is not None:  # the directory cannot exist: a file sits where a parent should be
            runtime = os.environ.get("XDG_RUNTIME_DIR")
            what = (f"cannot exist: {blocker} is a {file_kind(os.lstat(blocker).st_mode)}, not a directory")
            if runtime and "XDG_RUNTIME_DIR=" in spec.origin and Path(runtime) == blocker:
                return spec.fail(what, f"point XDG_RUNTIME_DIR at this user's runtime directory (a directory, "
                                       f"e.g. /run/user/{os.getuid()}), unset it, or pass a directory you own "
                                       f"({spec.override} DIR)")
            # no advice to remove anything: the path is whatever the user typed, possibly a file that matters
            return spec.fail(what, f"choose another directory ({spec.override} DIR)")
        what = "is not a directory" if lst is None else f"is a {file_kind(lst.st_mode)}, not a directory"
        return spec.fail(what, f"choose another directory ({spec.override} DIR)")
    if e.errno == errno.EROFS:
        return spec.fail("is on a read-only file system (the daemon creates its sockets there)",
                         f"choose a writable directory ({spec.override} DIR), e.g. $XDG_RUNTIME_DIR/vllm-fastload")
    return spec.fail(f"cannot be used ({type(e).__name__}: {e.strerror or e})")


def file_kind(mode: int) -> str:
    """What an ``lstat`` mode names, without an article: "regular file", "directory", "symbolic link", ..."""
    for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISSOCK, "socket"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symbolic link")):
        if test(mode):
            return name
    return "special file"


class SocketDir:
    """A socket directory opened once (``O_NOFOLLOW``) and verified through its descriptor: a real directory (not a
    symbolic link), owned by this user, not writable by group or others. Sockets are bound and connected relative
    to that descriptor (:meth:`entry`, ``/proc/self/fd/N/<name>``), so swapping the path after the check (a link
    flipped to another user's directory) cannot redirect them. A context manager; :meth:`close` drops the fd."""

    def __init__(self, spec: SocketDirSpec, fd: int):
        self.spec, self.fd = spec, fd
        via = f"/proc/self/fd/{fd}"
        self._prefix = via if os.path.isdir(via) else str(spec.path)

    @classmethod
    def open(cls, spec: SocketDirSpec, create: bool = False) -> SocketDir:
        """Open (``create``: first make it, 0700, and its parents) and verify ``spec.path``.

        Raises ``FileNotFoundError`` when it does not exist (and ``create`` is false): no daemon has made it yet.
        Raises :class:`SocketDirError` for every other reason it cannot be used, naming the directory, where it
        came from and the fix; with ``create`` also when it is on a read-only file system."""
        d = spec.path
        if create:
            try:
                d.parent.mkdir(parents=True, exist_ok=True)
                os.mkdir(d, 0o700)
            except FileExistsError:
                pass  # a directory, or something else that the open below diagnoses
            except OSError as e:
                raise _diagnose(spec, e) from None
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            if os.path.lexists(d):  # a dangling symbolic link
                raise _diagnose(spec, OSError(errno.ELOOP, "symbolic link")) from None
            raise
        except OSError as e:
            raise _diagnose(spec, e) from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                raise spec.fail(f"is owned by uid {st.st_uid}, not by this user ({os.getuid()})")
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise spec.fail(f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})",
                                f"chmod 700 {d}")
            if create and os.fstatvfs(fd).f_flag & os.ST_RDONLY:
                raise _diagnose(spec, OSError(errno.EROFS, "read-only file system"))
        except BaseException:
            os.close(fd)
            raise
        return cls(spec, fd)

    def entry(self, name: str) -> str:
        """The path to bind or connect ``name`` in this directory through its descriptor."""
        return f"{self._prefix}/{name}"

    def lstat(self, name: str) -> Optional[os.stat_result]:
        """``lstat`` of ``name`` in this directory (symbolic links not followed); None when it does not exist."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def open_file(self, name: str, flags: int, mode: int = 0o600) -> int:
        """``os.open`` of ``name`` in this directory, never through a symbolic link."""
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd)

    def unlink(self, name: str) -> None:
        """Remove ``name`` from this directory (nothing when it is gone)."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Close the directory's descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SocketDir:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def ensure_socket_dir(path: Optional[str], create: bool = True, override: str = DAEMON_FLAG) -> Path:
    """Return the socket directory ``path`` names (default :func:`default_socket_dir`), creating it 0700 when
    ``create``. Raises :class:`~vllm_fastload.errors.SocketDirError` (see :meth:`SocketDir.open`) when it cannot be
    used; a directory that does not exist is returned as is when not ``create`` (no daemon made it yet)."""
    spec = socket_dir_spec(path, override)
    check_socket_dir(spec, create)
    return spec.path


def check_socket_dir(spec: SocketDirSpec, create: bool = True) -> None:
    """Check (and with ``create``, make 0700) the socket directory ``spec`` names. Raises
    :class:`~vllm_fastload.errors.SocketDirError` (see :meth:`SocketDir.open`) when it cannot be used; a directory
    that does not exist passes when not ``create`` (no daemon made it yet)."""
    try:
        SocketDir.open(spec, create).close()
    except FileNotFoundError:
        pass


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
