"""Where each exported tensor lives inside a rank's one export buffer, and the checksum samples that prove it.

Transport-neutral: the buffer is a flat ``torch.uint8`` tensor, in host shared memory (memfd, :mod:`.memfd`) or in
device memory (CUDA VMM, :mod:`.cuda_vmm`); the one device-specific step, reading sample windows to the host, is
the transport's (:meth:`.transport.Transport.read_windows`). Both daemon and engine use these functions, so the
layout and the checksum are computed by one piece of code.

A :class:`Placement` (and the manifest's :class:`.messages.TensorEntry`, which adds ``checksum`` and ``kind``) is
``dtype, shape, stride, offset, nbytes``: ``offset`` (bytes, a multiple of :data:`ALIGN`) and ``nbytes`` (bytes of
the span the strides address) locate the tensor; ``shape`` and ``stride`` (elements) rebuild it with
``as_strided``, so non-contiguous results of post-processing (FP8 kernels keep ``weight.t()``) keep their layout.
The functions here take either (anything with those attributes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ...errors import ManifestError

#: Byte alignment of every tensor in the buffer (cudaMalloc's guarantee is 256 bytes).
ALIGN = 256
#: Bytes per checksum window; each tensor is sampled at its start, middle and end.
SAMPLE = 4096

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64)}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "uint16", "uint32", "uint64", "float8_e4m3fnuz",
              "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)


def span_elements(shape: list[int], stride: list[int]) -> int:
    """Elements from the first to the last one a (shape, stride) view addresses; 0 for an empty tensor."""
    if any(int(d) == 0 for d in shape):
        return 0
    return 1 + sum((int(d) - 1) * int(s) for d, s in zip(shape, stride))


def _dense(t: torch.Tensor) -> bool:
    """True when ``t`` addresses each element of its span exactly once (contiguous or a permutation of it)."""
    return t.numel() == span_elements(list(t.shape), list(t.stride()))


@dataclass(frozen=True)
class Placement:
    """Where one tensor sits in a buffer: ``dtype`` (a :data:`DTYPES` name), ``shape`` and ``stride`` (elements),
    ``offset`` and ``nbytes`` (bytes)."""

    dtype: str
    shape: list[int]
    stride: Optional[list[int]]
    offset: int
    nbytes: int


def place(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Placement], int]:
    """Place ``tensors`` in one buffer. Returns (a :class:`Placement` per name, buffer size in bytes).

    Dense tensors keep their strides; overlapping or gapped views (rare) are stored contiguous.
    """
    entries, off = {}, 0
    for k, t in tensors.items():
        stride = list(t.stride()) if _dense(t) else list(torch.empty(t.shape).stride())
        n = span_elements(list(t.shape), stride) * t.element_size()
        entries[k] = Placement(str(t.dtype).removeprefix("torch."), list(t.shape), stride, off, n)
        off += -(-n // ALIGN) * ALIGN
    return entries, max(off, ALIGN)


def _geometry(buf: torch.Tensor, entry: Any, name: str) -> tuple[torch.dtype, int, int, list, list]:
    """``(dtype, offset, nbytes, shape, stride)`` of a placement, checked against ``buf`` (see :func:`view_at`
    for the errors)."""
    dtype = DTYPES.get(entry.dtype)
    if dtype is None:
        raise ManifestError(f"manifest entry {name!r} has unknown dtype {entry.dtype!r}")
    o, n = int(entry.offset), int(entry.nbytes)
    shape = [int(d) for d in entry.shape]
    if any(d < 0 for d in shape):
        raise ManifestError(f"manifest entry {name!r} has a negative dimension in shape {shape}")
    stride = [int(s) for s in entry.stride or torch.empty(shape, device="meta").stride()]
    if any(s < 0 for s in stride):
        raise ManifestError(f"manifest entry {name!r} has a negative stride {stride}")
    if o < 0 or n < 0 or o + n > buf.numel():
        raise ManifestError(f"manifest entry {name!r} spans [{o}, {o + n}), outside the {buf.numel()}-byte buffer")
    size = dtype.itemsize
    if len(stride) != len(shape) or span_elements(shape, stride) * size != n:
        raise ManifestError(f"manifest entry {name!r}: {n} bytes do not hold {entry.dtype} {shape} stride {stride}")
    if o % size:
        raise ManifestError(f"manifest entry {name!r}: offset {o} is not aligned to {size}-byte {entry.dtype}")
    return dtype, o, n, shape, stride


def view_at(buf: torch.Tensor, entry: Any, name: str = "?") -> torch.Tensor:
    """The tensor ``entry`` (a :class:`Placement` or a manifest entry) describes, as a view into the flat uint8
    ``buf`` (no copy).

    Raises :class:`~vllm_fastload.errors.ManifestError` (a ``ValueError``) naming the tensor when the entry is
    bad: unknown dtype, a range outside the buffer, a size that does not match shape x stride x dtype, or a
    misaligned offset.
    """
    dtype, o, n, shape, stride = _geometry(buf, entry, name)
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=buf.device)
    return buf[o:o + n].view(dtype).as_strided(shape, stride)


def views(buf: torch.Tensor, entries: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every entry as a view into ``buf`` (name -> tensor), checked like :func:`view_at` (same errors).

    One ``as_strided`` per tensor on a per-dtype view of the whole buffer instead of slice + view + as_strided:
    building the views of an 8B model is on the engine's start-up path.
    """
    typed: dict[torch.dtype, torch.Tensor] = {}
    out = {}
    for name, entry in entries.items():
        dtype, o, n, shape, stride = _geometry(buf, entry, name)
        if n == 0:
            out[name] = torch.empty(shape, dtype=dtype, device=buf.device)
            continue
        size = dtype.itemsize
        if buf.numel() % size or buf.storage_offset() % size:
            out[name] = buf[o:o + n].view(dtype).as_strided(shape, stride)
            continue
        t = typed.get(dtype)
        if t is None:
            t = typed[dtype] = buf.view(dtype)
        out[name] = t.as_strided(shape, stride, t.storage_offset() + o // size)
    return out


def fill(buf: torch.Tensor, tensors: dict[str, torch.Tensor], entries: dict[str, Placement]) -> None:
    """Copy each tensor into its place in ``buf`` (same device or across host/device)."""
    for k, t in tensors.items():
        if t.numel():
            view_at(buf, entries[k], k).copy_(t)


#: odd 64-bit multipliers, one per 8-byte word of a window (position-dependent, so swapped words change the sum)
_MIX = 0x9E3779B97F4A7C15


def _word_weights() -> list[int]:
    """The odd weight of each 8-byte word of a window, as unsigned 64-bit values."""
    return [((2 * j + 1) * _MIX) % 2**64 for j in range(SAMPLE // 8)]


def _window_rows(buf: torch.Tensor, starts: list[int], ends: list[int], transport: Any):
    """The windows as a ``(len(starts), SAMPLE)`` uint8 numpy array, read by ``transport``
    (:meth:`.transport.Transport.read_windows`); a window cut short by its span's end repeats the span's last
    byte."""
    lens = [min(SAMPLE, e - s) for s, e in zip(starts, ends)]
    rows = transport.read_windows(buf, starts, lens, SAMPLE)
    for i, m in enumerate(lens):
        if m < SAMPLE:
            rows[i, m:] = rows[i, m - 1]
    return rows


def sample_checksums(buf: torch.Tensor, entries: dict[str, Any], transport: Any = None) -> dict[str, str]:
    """A 64-bit checksum (hex) of each entry's three :data:`SAMPLE`-byte windows (start, middle, end of its span).

    Each window is read as little-endian 8-byte words and summed with position-dependent odd weights, modulo
    2**64 (integer arithmetic, so the result does not depend on the reduction order); the three window sums are
    combined on the host. The windows of a GPU buffer are copied to the host first (3 x SAMPLE bytes per tensor),
    so one numpy computation serves both. Windows of a span shorter than
    :data:`SAMPLE` repeat its last byte. This detects changed or moved bytes in the sampled windows; it is not a
    cryptographic hash. ``transport``: the :class:`.transport.Transport` that made ``buf`` (the daemon's and the
    engine's pass the one they resolved; default: the one of ``buf``'s device). Raises
    :class:`~vllm_fastload.errors.ManifestError` naming the first entry whose span lies outside ``buf``.
    """
    names = [k for k, e in entries.items() if int(e.nbytes)]
    out = {k: f"{0:016x}" for k in entries}
    if not names:
        return out
    starts, ends, first = [], [], []  # first: the row of each name's first window
    for k in names:
        o, n = int(entries[k].offset), int(entries[k].nbytes)
        if o < 0 or n < 0 or o + n > buf.numel():
            raise ManifestError(f"manifest entry {k!r} spans [{o}, {o + n}), outside the {buf.numel()}-byte buffer")
        first.append(len(starts))
        if n <= SAMPLE:  # all three windows are the whole span: read and sum it once
            starts.append(o)
            ends.append(o + n)
            continue
        last = o + n - SAMPLE
        for s in (o, o + n // 2 - SAMPLE // 2, last):
            starts.append(min(max(s, o), last))
            ends.append(o + n)
    import numpy as np

    if transport is None:
        from .backends import get_transport

        transport = get_transport(buf.device)
    rows = _window_rows(buf, starts, ends, transport)
    w = np.array(_word_weights(), dtype=np.uint64)
    i0 = np.asarray(first, dtype=np.int64)
    with np.errstate(over="ignore"):
        row_sums = (rows.view("<u8") * w[None, :]).sum(axis=1, dtype=np.uint64)
        one = np.diff(i0, append=len(starts)) == 1  # names whose span gave one window (<= SAMPLE bytes)
        s0 = row_sums[i0]
        s1 = np.where(one, s0, row_sums[np.minimum(i0 + 1, len(row_sums) - 1)])
        s2 = np.where(one, s0, row_sums[np.minimum(i0 + 2, len(row_sums) - 1)])
        # h = ((0 * P + s0) * P + s1) * P + s2 mod 2**64, in uint64 arithmetic (wraps modulo 2**64)
        p = np.uint64(0x100000001B3)
        h = (s0 * p + s1) * p + s2
    out.update(zip(names, (f"{v:016x}" for v in h.tolist())))
    return out
