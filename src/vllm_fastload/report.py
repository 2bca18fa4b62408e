"""The load report: one log line per load and, with ``report_path``, the same facts as JSON.

The line reads ``fastload: runai_streamer loaded <N> tensors (<X> GiB) from <source> in <s> s (<GB/s>),
fingerprint <short>``; compare its GB/s across restarts to see a silent slowdown. Units: bytes, seconds,
GB/s = 1e9 bytes per second; GiB = 2**30 bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from .log import logger


def report_path_problem(path: str) -> Optional[str]:
    """Why the load report must not be written to ``path``, or None when it may: the report replaces the file
    atomically (a temporary file renamed over it), so only a regular file of this user, or a new name, may sit
    there; a device (``/dev/full``), FIFO, socket, directory, symbolic link or someone else's file would be
    replaced by it."""
    import stat

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        return f"report_path {path!r} cannot be examined ({e.strerror})"
    if st is None:  # a new file: the nearest existing folder above it must be one this user can create files in
        parent = os.path.dirname(os.path.abspath(path))
        while not os.path.lexists(parent) and parent != os.path.dirname(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            return f"report_path {path!r}: its parent {parent!r} is not a directory"
        return _unwritable(path, parent)
    if stat.S_ISLNK(st.st_mode):
        return (f"report_path {path!r} is a symbolic link (to {os.readlink(path)!r}); the report would replace the "
                f"link: name the file itself or a new path")
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a device file" if stat.S_ISCHR(st.st_mode)
                or stat.S_ISBLK(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket"
                if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        return (f"report_path {path!r} is {kind}; the report is written by renaming a new file over the path, which "
                f"would replace it: name a regular file or a new path")
    if st.st_uid != os.getuid():
        return (f"report_path {path!r} belongs to uid {st.st_uid}, not to this process (uid {os.getuid()}); the "
                f"report would replace another user's file: name a file of yours or a new path")
    return _unwritable(path, os.path.dirname(os.path.abspath(path)))


def _unwritable(path: str, folder: str) -> Optional[str]:
    """Why this process cannot create the report's temporary file in ``folder``, or None."""
    if os.access(folder, os.W_OK | os.X_OK):
        return None
    return (f"report_path {path!r}: this process (uid {os.getuid()}) cannot create files in {folder!r}; name a path "
            f"in a folder you can write")



@dataclass
class LoadReport:
    """Facts of one load.

    ``load_format``: the format asked for; ``format_used``: what actually loaded (``auto`` after a fallback);
    ``bytes``: tensor bytes delivered to the model; ``wall_s``: seconds inside the loader's ``load_weights`` (with
    ``prefetch``: from the stream's preparation in ``load_model``, before the model was built);
    ``read_wait_s``: seconds the consumer waited for the reader (storage bound when close to ``wall_s``);
    ``consume_s``: seconds in the model's ``weight_loader`` calls; ``fallback_reason``: None when no fallback;
    ``weights_phase_s``: when set (``ipc_cache``; ``runai_streamer`` with ``prefetch``, where it is
    ``load_weights``' own seconds), the seconds comparable to a disk loader's weight loading, which the line leads
    with (``wall_s`` also counts model construction, and for ``ipc_cache`` re-processing);
    ``content_digest``: the checkpoint's BLAKE3 content digest when the load hashed it (:mod:`~vllm_fastload.content`).
    """

    load_format: str
    source: str
    format_used: str = ""
    tensors: int = 0
    bytes: int = 0
    wall_s: float = 0.0
    read_wait_s: float = 0.0
    consume_s: float = 0.0
    fingerprint: Optional[str] = None
    fallback_reason: Optional[str] = None
    shards: int = 0
    verb: str = "loaded"
    note: str = ""
    finished_at: float = 0.0
    weights_phase_s: Optional[float] = None
    content_digest: Optional[str] = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def gb_per_s(self) -> float:
        """Delivered bytes / ``wall_s`` in GB/s (1e9 B/s); 0 when no time was measured."""
        return self.bytes / self.wall_s / 1e9 if self.wall_s > 0 else 0.0

    def line(self) -> str:
        """The one-line summary logged at INFO (with the content digest when the load hashed one)."""
        text = self._line()
        return text + f", content {self.content_digest}" if self.content_digest else text

    def _line(self) -> str:
        if self.fallback_reason is not None:
            return (
                f"fastload: {self.load_format} fell back to load format {self.format_used!r} "
                f"({self.fallback_reason}); weights from {self.source} loaded in {self.wall_s:.2f} s"
            )
        what = f"fastload: {self.load_format} {self.verb} {self.tensors} tensors ({self.bytes / 2**30:.2f} GiB) from"
        if self.weights_phase_s is not None:  # lead with the span comparable to a disk load, then the whole
            wp = self.weights_phase_s
            rate = self.bytes / wp / 1e9 if wp > 0 else 0.0
            return (f"{what} {self.source}: weights phase {wp:.3f} s ({rate:.2f} GB/s), {self.wall_s:.2f} s in all, "
                    f"fingerprint {self.fingerprint}" + (f", {self.note}" if self.note else ""))
        return (
            f"{what} {self.source} in {self.wall_s:.2f} s ({self.gb_per_s:.2f} GB/s), fingerprint {self.fingerprint}"
            + (f", {self.note}" if self.note else "")
        )

    def to_dict(self) -> dict[str, Any]:
        """All fields plus ``gb_per_s`` and ``line``, JSON-ready."""
        d = dataclasses.asdict(self)
        d["gb_per_s"] = round(self.gb_per_s, 4)
        d["line"] = self.line()
        return d

    def emit(self, report_path: Optional[str]) -> None:
        """Log :meth:`line` at INFO; with ``report_path`` also write :meth:`to_dict` as JSON, atomically
        (temporary file in the same directory, then ``os.replace``: a reader never sees half a report)."""
        self.finished_at = time.time()
        self.format_used = self.format_used or self.load_format
        logger.info(self.line())
        if not report_path:
            return
        problem = report_path_problem(report_path)  # again here: the path may have changed since the config check
        if problem:
            logger.warning("fastload: load report not written: %s", problem)
            return
        directory = os.path.dirname(os.path.abspath(report_path))
        tmp = None
        try:  # the load is done and good: a report that cannot be written is a warning, never a failed load
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".fastload-report.", dir=directory)
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            os.replace(tmp, report_path)
        except OSError as e:
            logger.warning("fastload: load report not written to %r: %s (the load itself succeeded)", report_path,
                           e.strerror or e)
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
