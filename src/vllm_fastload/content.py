"""The content digest of a checkpoint: a BLAKE3 hash of every tensor's bytes, for loads that must prove which data
they hold, not only which files.

The :mod:`~vllm_fastload.fingerprint` sees headers and file identities (size, mtime_ns, device, inode; ETag /
version id), which is free but blind to data rewritten in place with the same header and a restored mtime (``cp -p``
over an existing file keeps its inode), to file systems that report unstable or fake identities, and to a bad copy
whose metadata looks right. The content digest sees the bytes, at the cost of hashing every byte once more.

Definition (``blake3:`` + 64 hex digits), the same for every producer: for each tensor of the checkpoint (the
tensors a load would use: duplicates that an index assigns elsewhere left out), in sorted name order, a record of
the UTF-8 name, NUL, the safetensors dtype (``BF16``), NUL, the shape as comma-separated decimals, NUL, and the
32-byte BLAKE3 digest of the tensor's raw bytes as stored in the safetensors data section; the digest is BLAKE3 of
the concatenated records. Dtype and shape are in it because the same bytes read as another dtype or shape are
other weights, and a pin must not depend on the header being pinned some other way. Producers: :func:`checkpoint_digest`
(``vllm-fastload inspect --content-digest``, reads the files), :class:`Hashing` (a loader's tensor stream,
``"content_hash": true`` in the extra-config; the preload daemon publishes it in its manifest). BLAKE3 via the
``blake3`` package (a dependency of vLLM itself), multi-threaded for
large inputs (``max_threads=blake3.AUTO``, which releases the GIL while hashing).
"""

from __future__ import annotations

import mmap
import os
import queue
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

from .errors import CheckpointError, ContentMismatch
from .storage import is_object_uri

PREFIX = "blake3:"
_DIGEST_RE = re.compile(r"blake3:[0-9a-f]{64}")
#: Bytes per device-to-host piece when a GPU tensor is hashed (two pinned pieces alternate).
PIECE_BYTES = 64 * 2**20


def valid_digest(value: str) -> str:
    """``value`` if it has the form ``blake3:<64 lowercase hex digits>``; ``ValueError`` saying the form otherwise."""
    if not isinstance(value, str) or not _DIGEST_RE.fullmatch(value):
        raise ValueError(f"expected 'blake3:' followed by 64 lowercase hex digits (as `vllm-fastload inspect "
                         f"--content-digest` prints), got {value!r}")
    return value


def _hasher(data: Any = b"") -> Any:
    import blake3

    return blake3.blake3(data, max_threads=blake3.blake3.AUTO)


def record(dtype: str, shape: Any, data_digest: bytes) -> bytes:
    """The part of a tensor's record after its name: safetensors ``dtype``, ``shape`` (ints) and the 32-byte BLAKE3
    digest of its bytes, NUL-separated."""
    return f"{dtype}\0{','.join(str(int(d)) for d in shape)}\0".encode() + data_digest


def combine(records: dict[str, bytes]) -> str:
    """The checkpoint digest (``blake3:<hex>``) of ``{tensor name: record(dtype, shape, digest of its bytes)}``."""
    h = _hasher()
    for name in sorted(records):
        h.update(name.encode() + b"\0" + records[name])
    return PREFIX + h.hexdigest()


_ST_DTYPE: dict[Any, str] = {}


def safetensors_dtype(dtype: Any) -> str:
    """The safetensors dtype string of a torch dtype (``torch.bfloat16`` -> ``BF16``); ``str(dtype)`` for one that
    safetensors has no name for (such a tensor cannot match a digest computed from files)."""
    if not _ST_DTYPE:
        from .checkpoint import torch_dtypes

        _ST_DTYPE.update({t: st for st, t in torch_dtypes().items()})
    return _ST_DTYPE.get(dtype, str(dtype))


def checkpoint_digest(checkpoint: Any) -> str:
    """Read every tensor of ``checkpoint`` (a :class:`~vllm_fastload.checkpoint.Checkpoint` of local files) and
    return its content digest. Reads each tensor's byte range ``[8 + header_len + begin, 8 + header_len + end)``
    through ``mmap`` (page-cache speed on a warm cache). Raises :class:`CheckpointError` for object-storage shards
    (hash a local copy, or let the preload daemon hash while it loads) and for a shard whose size or identity
    changed since its header was read, and ``OSError`` when a file cannot be read."""
    digests: dict[str, bytes] = {}
    for header in checkpoint.headers:
        if is_object_uri(header.path):
            raise CheckpointError(f"{header.path}: the content digest of object-storage shards is not computed by "
                                  f"inspect (it would download every byte); hash a local copy, or start the "
                                  f"preload daemon with \"content_hash\": true and read the digest from "
                                  f"`vllm-fastload status`")
        base = 8 + header.header_len
        with open(header.path, "rb") as f:
            st = os.fstat(f.fileno())
            _unchanged(header, st)
            with (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if st.st_size else _Empty()) as m:
                view = memoryview(m)
                try:
                    for name, t in header.tensors.items():
                        digests[name] = record(t.dtype, t.shape, _hasher(view[base + t.begin:base + t.end]).digest())
                finally:
                    view.release()
    return combine(digests)


def _unchanged(header: Any, st: os.stat_result) -> None:
    """Raise :class:`CheckpointError` when the open file is not the version whose header was read (size, device,
    inode, mtime): a digest of other bytes would pin a checkpoint no load accepts."""
    ident = header.identity
    now = (st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns)
    then = (header.file_size, ident.st_dev, ident.st_ino, ident.mtime_ns) if ident is not None else None
    if header.file_size is not None and st.st_size != header.file_size or then is not None and now != then:
        raise CheckpointError(f"{header.path} changed while it was being inspected (size, inode or mtime differ "
                              f"from when its header was read); run inspect again once the file is complete")


class _Empty:
    """A stand-in for the mmap of an empty file (``mmap`` refuses length 0; such a file has no tensors)."""

    def __enter__(self) -> bytes:
        return b""

    def __exit__(self, *exc: Any) -> None:
        return None


class Hashing:
    """Hash a loader's ``(name, tensor)`` stream while it flows to the model.

    Wrap the iterator (``for name, t in hashing.wrap(it)``); every tensor is hashed before it is passed on, because
    loaders reuse the memory of a tensor once the consumer asks for the next one. CPU tensors are hashed in place
    (a zero-copy ``uint8`` view). CUDA tensors are copied to the host in :data:`PIECE_BYTES` pieces through two
    pinned buffers; a worker thread hashes one piece while the next copies. :attr:`digest` is set when the stream
    ends (None before); :meth:`check` compares it with an expected digest.

    A name that comes twice (vLLM's default loader yields every copy of a name stored in several shards; the model
    keeps the last one it was given) counts with its last copy, so the digest describes what the model holds;
    :attr:`repeated` lists such names.
    """

    def __init__(self) -> None:
        self._digests: dict[str, bytes] = {}
        self._pieces: Optional[list[Any]] = None
        self.digest: Optional[str] = None
        self.bytes = 0
        self.repeated: list[str] = []

    def wrap(self, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Yield every item of ``tensors`` unchanged, after hashing it; sets :attr:`digest` at the end. Closing this
        generator closes ``tensors`` (when it has ``close``) at once, as ``yield from`` would: the reader behind it
        stops then, not when the last reference to it goes."""
        try:
            for name, t in tensors:
                if name in self._digests:
                    self.repeated.append(name)
                self._digests[name] = record(safetensors_dtype(t.dtype), t.shape, self._tensor_digest(t))
                self.bytes += t.numel() * t.element_size()
                yield name, t
            self.digest = combine(self._digests)
        finally:
            self._pieces = None
            close = getattr(tensors, "close", None)
            if close is not None:
                close()

    def check(self, expected: Optional[str], source: str) -> None:
        """Raise :class:`ContentMismatch` naming both digests and ``source`` unless ``expected`` is None or equals
        :attr:`digest` (which must be set: call after the stream ended)."""
        if expected is None:
            return
        if self.digest != expected:
            raise ContentMismatch(
                f"the tensors loaded from {source} have content digest {self.digest}, but expected_content_digest is "
                f"{expected}: these "
                f"are not the pinned weights (a checkpoint rewritten in place, a wrong copy, a different revision"
                + (f"; {', '.join(self.repeated[:3])} came in several copies and the last one counted" if self.repeated
                   else "") + f"). Restore the pinned files, or, to serve these files, pin their digest: "
                f"'{{\"expected_content_digest\": \"{self.digest}\"}}'")

    def _tensor_digest(self, t: Any) -> bytes:
        import torch

        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        if flat.device.type == "cpu":
            return _hasher(memoryview(flat.numpy())).digest() if flat.numel() else _hasher().digest()
        return self._device_digest(flat)

    def _device_digest(self, flat: Any) -> bytes:
        """BLAKE3 of a device ``uint8`` tensor: copies piece by piece into two pinned buffers; a worker thread
        hashes piece ``i`` while piece ``i + 1`` copies (the copy waits until its buffer was hashed)."""
        import torch

        if self._pieces is None:
            self._pieces = [torch.empty(PIECE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        h = _hasher()
        n = flat.numel()
        work: queue.Queue = queue.Queue()
        free = [threading.Event(), threading.Event()]
        for e in free:
            e.set()
        failed: list[BaseException] = []

        def worker() -> None:
            while True:
                item = work.get()
                if item is None:
                    return
                i, length = item
                try:
                    if not failed:
                        h.update(memoryview(self._pieces[i][:length].numpy()))
                except BaseException as e:  # noqa: BLE001 - re-raised in the consumer thread below
                    failed.append(e)
                finally:
                    free[i].set()

        th = threading.Thread(target=worker, name="fastload-content-hash", daemon=True)
        th.start()
        try:
            for k, start in enumerate(range(0, n, PIECE_BYTES)):
                i, length = k % 2, min(PIECE_BYTES, n - start)
                free[i].wait()
                free[i].clear()
                self._pieces[i][:length].copy_(flat[start:start + length])  # synchronous D2H into pinned memory
                work.put((i, length))
        finally:
            work.put(None)
            th.join()
        if failed:
            raise failed[0]
        return h.digest()


@dataclass
class ContentPin:
    """What a load asks of its bytes: ``expected`` (``expected_content_digest``, or None: only hash), ``source``
    (for messages) and ``on_digest`` (called with the digest when a stream ends: the load report, the preload
    daemon's manifest)."""

    expected: Optional[str]
    source: str
    on_digest: Optional[Callable[[str], None]] = None

    def stream(self, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """``tensors``, hashed; after the last one: ``on_digest``, then :class:`ContentMismatch` unless the digest
        is ``expected``."""
        hashing = Hashing()
        yield from hashing.wrap(tensors)
        if self.on_digest is not None:
            self.on_digest(hashing.digest)
        hashing.check(self.expected, self.source)

    def precheck(self, checkpoint: Any) -> None:
        """Before a model that already serves is overwritten (vLLM's in-place ``reload_weights``): read and hash the
        files first and raise :class:`ContentMismatch` before the first tensor is written. Object storage: not
        possible without a download; the stream's own check after the last tensor stays."""
        if self.expected is None or any(is_object_uri(h.path) for h in checkpoint.headers):
            return
        got = checkpoint_digest(checkpoint)
        if got != self.expected:
            raise ContentMismatch(
                f"the checkpoint at {self.source} has content digest {got}, but expected_content_digest is "
                f"{self.expected}: not reloading it (the weights this engine serves are unchanged). Restore the "
                f"pinned files, or, to serve these files, pin their digest: "
                f"'{{\"expected_content_digest\": \"{got}\"}}'")


def pin_loader(loader: Any, pin: ContentPin) -> Any:
    """Make ``loader`` (vLLM's ``DefaultModelLoader``, whose ``load_weights`` iterates ``self.get_all_weights``)
    hash what it streams as ``pin`` asks (:meth:`ContentPin.stream`). Used by the fallback policy, so a hashed or
    pinned load stays so on the disk path. Returns ``loader``."""
    inner = loader.get_all_weights

    def get_all_weights(model_config: Any, model: Any) -> Iterator[tuple[str, Any]]:
        yield from pin.stream(inner(model_config, model))

    loader.get_all_weights = get_all_weights
    return loader
