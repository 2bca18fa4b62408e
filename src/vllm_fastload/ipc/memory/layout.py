"""Where each exported tensor lives inside a rank's one export buffer, and the checksum samples that prove it.

Transport-neutral: the buffer is a flat ``torch.uint8`` tensor, in host shared memory (memfd, :mod:`.memfd`) or in
device memory (CUDA VMM, :mod:`.cuda_vmm`); the one device-specific step, reading sample windows to the host, is
the transport's (:meth:`.transport.Transport.read_windows`). Both daemon and engine use these functions, so the
layout and the checksum are computed by one piece of code.

The layout of a buffer is a :class:`~vllm_fastload.ipc.wire.messages.TensorTable` (the manifest's tensors, one
column per field; a :class:`~vllm_fastload.ipc.wire.messages.TensorRow` per tensor): ``offset`` (bytes, a multiple
of :data:`ALIGN`) and ``nbytes`` (bytes of the span the strides address) locate a tensor; ``shape`` and ``stride``
(elements) rebuild it with ``as_strided``, so non-contiguous results of post-processing (FP8 kernels keep
``weight.t()``) keep their layout. The checks, views and checksums of a whole table run on its columns with numpy:
per tensor only the ``as_strided`` remains in Python.
"""

from __future__ import annotations

import contextlib
from itertools import islice
from typing import Any

import torch

from ...errors import ManifestError
from ..wire.messages import FIRST_HOST_KIND, KINDS, TensorRow, TensorTable

#: Byte alignment of every tensor in the buffer (cudaMalloc's guarantee is 256 bytes).
ALIGN = 256
#: Bytes per checksum window; each tensor is sampled at its start, middle and end. Small, because the engine
#: reads every tensor's windows on its start-up path (on CPU each read window is also a page fault of its fresh
#: mapping); three windows at fixed places still catch a segment or tensor that moved or was overwritten there.
SAMPLE = 512

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


def place(tensors: dict[str, torch.Tensor], last: Any = ()) -> tuple[TensorTable, int]:
    """Place ``tensors`` in one buffer. Returns (the table of their places, every ``kind`` "param" and ``checksum``
    0; buffer size in bytes). Dense tensors keep their strides; overlapping or gapped views (rare) are stored
    contiguous. Rows keep ``tensors``' order; the names in ``last`` (a container) are placed after all the others,
    back to back, so that :func:`to_host` copies them as one span."""
    rows, off = {}, 0
    for k, t in sorted(tensors.items(), key=lambda kv: kv[0] in last) if last else tensors.items():
        stride = list(t.stride()) if _dense(t) else list(torch.empty(t.shape, device="meta").stride())
        n = span_elements(list(t.shape), stride) * t.element_size()
        rows[k] = TensorRow(str(t.dtype).removeprefix("torch."), list(t.shape), stride, off, n, 0, "param")
        off += -(-n // ALIGN) * ALIGN
    return TensorTable.of({k: rows[k] for k in tensors} if last else rows), max(off, ALIGN)


def _geometry(size: int, entry: Any, name: str) -> tuple[torch.dtype, int, int, list, list]:
    """``(dtype, offset, nbytes, shape, stride)`` of one row, checked against a buffer of ``size`` bytes (see
    :func:`view_at` for the errors)."""
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
    if o < 0 or n < 0 or o + n > size:
        raise ManifestError(f"manifest entry {name!r} spans [{o}, {o + n}), outside the {size}-byte buffer")
    item = dtype.itemsize
    if len(stride) != len(shape) or span_elements(shape, stride) * item != n:
        raise ManifestError(f"manifest entry {name!r}: {n} bytes do not hold {entry.dtype} {shape} stride {stride}")
    if o % item:
        raise ManifestError(f"manifest entry {name!r}: offset {o} is not aligned to {item}-byte {entry.dtype}")
    return dtype, o, n, shape, stride


def view_at(buf: torch.Tensor, entry: Any, name: str = "?") -> torch.Tensor:
    """The tensor ``entry`` (a :class:`~vllm_fastload.ipc.wire.messages.TensorRow`, or anything with its geometry
    attributes; ``stride`` None = contiguous) describes, as a view into the flat uint8 ``buf`` (no copy).

    Raises :class:`~vllm_fastload.errors.ManifestError` (a ``ValueError``) naming the tensor when the entry is
    bad: unknown dtype, a negative dimension or stride, a range outside the buffer, a size that does not match
    shape x stride x dtype, or a misaligned offset.
    """
    dtype, o, n, shape, stride = _geometry(buf.numel(), entry, name)
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=buf.device)
    return buf[o:o + n].view(dtype).as_strided(shape, stride)


def _columns(table: TensorTable) -> tuple[Any, Any, Any]:
    """``(offset, nbytes, itemsize)`` of every row as int64 arrays (itemsize 0 for an unknown dtype). Raises
    ``OverflowError`` for a value outside int64 (no valid manifest has one)."""
    import numpy as np

    sizes = np.array([DTYPES[d].itemsize if d in DTYPES else 0 for d in table.dtypes] or [0], dtype=np.int64)
    return (np.array(table.offset, dtype=np.int64), np.array(table.nbytes, dtype=np.int64),
            sizes[np.array(table.dtype, dtype=np.int64)])


def check_geometry(size: int, table: TensorTable) -> None:
    """Check every row of ``table`` against a buffer of ``size`` bytes, as :func:`view_at` checks one, on the
    columns at once (numpy), and every dtype name the table lists. Raises :class:`~vllm_fastload.errors.ManifestError`
    naming the first bad tensor with :func:`view_at`'s message (or the unknown dtype no tensor uses)."""
    import numpy as np

    # views() makes a view of the buffer per dtype name: an unknown one no row uses is bad too (a row's is named
    # by the row checks below, as an item size of 0)
    unknown = [j for j, d in enumerate(table.dtypes) if d not in DTYPES]
    if unknown:
        unused = set(unknown) - set(table.dtype)
        if unused:
            raise ManifestError(f"manifest tensor table lists unknown dtype {table.dtypes[min(unused)]!r}, which no "
                                f"tensor uses; the daemon is not from this version of vllm-fastload")
    n = len(table)
    if not n:
        return
    try:
        off, nb, item = _columns(table)
        shape = np.array(table.shape, dtype=np.int64)
        stride = np.array(table.stride, dtype=np.int64)
    except OverflowError:
        return _check_rows(size, table, range(n))
    tensor = np.repeat(np.arange(n), table.ndim)  # the row of each dimension
    bad_dim = (shape < 0) | (stride < 0) | ((shape > 1) & ((shape - 1).astype(np.float64) * stride > size))
    bad = item == 0
    bad |= np.bincount(tensor[bad_dim], minlength=n).astype(bool)
    bad |= (off < 0) | (nb < 0) | (off > size - nb)
    # elements of each span: 1 + sum((d - 1) * s) over its dimensions, 0 with a zero dimension
    reach = np.where(bad_dim | (shape <= 1), 0, (shape - 1) * stride)
    ends = np.cumsum(np.concatenate([[0], reach]))
    at = np.array(table.dims_at, dtype=np.int64)
    span = ends[at[1:]] - ends[at[:-1]] + 1
    span[np.bincount(tensor[shape == 0], minlength=n).astype(bool)] = 0
    bad |= span * item != nb
    bad |= off % np.maximum(item, 1) != 0
    if bad.any():
        _check_rows(size, table, np.flatnonzero(bad).tolist())


def _check_rows(size: int, table: TensorTable, rows: Any) -> None:
    """:func:`_geometry` of ``rows`` one by one: raises for the first bad one."""
    for i in rows:
        _geometry(size, table.row(i), table.names[i])
    if len(rows):
        raise ManifestError(f"manifest entry {table.names[rows[0]]!r} does not fit the {size}-byte buffer")


#: Dispatch below autograd's view tracking (a private PyTorch guard, there since 1.10): an ``as_strided`` made under
#: it is a plain alias of the buffer's memory, not an autograd view of it; where a PyTorch lacks it, a no-op, and
#: the tensors are views (install then makes its detached alias of each, :mod:`.state`)
_BELOW_VIEW_TRACKING = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", contextlib.nullcontext)


def views(buf: torch.Tensor, table: TensorTable, host_rows: bool = True) -> dict[str, torch.Tensor | None]:
    """Every row of ``table`` as a tensor over ``buf``'s memory (name -> tensor, in row order), checked first
    (:func:`check_geometry`, same errors as :func:`view_at`). ``host_rows`` False: a row of a ``host_`` kind maps
    to None instead (its caller copies those to the host, :func:`to_host`).

    One ``as_strided`` per tensor on a per-dtype view of the whole buffer instead of slice + view + as_strided,
    with each dtype's view, item size and offset looked up once: this loop runs once per tensor of the model on
    the engine's start-up path. The tensors are made below autograd's view tracking: plain aliases of the memory
    (``_is_view()`` False, no ``_base``), what the model's tensors must be (never an autograd view of the whole
    segment), so install can take each over as it is instead of making a detached alias of it; that also costs
    about half of what a tracked view does (``benchmarks/view_probe.py``).
    """
    check_geometry(buf.numel(), table)
    size, first = buf.numel(), buf.storage_offset()
    typed: list[tuple[Any, int, int] | None] = []  # per dtype: (its view's as_strided, item size, storage offset)
    for name in table.dtypes:
        item = DTYPES[name].itemsize
        if size % item or first % item:
            typed.append(None)  # the whole buffer has no view of this dtype: per-tensor slices
        else:
            t = buf.view(DTYPES[name])
            typed.append((t.as_strided, item, t.storage_offset()))
    out: dict[str, torch.Tensor | None] = {}
    shape, stride, a = table.shape, table.stride, 0
    first_skipped = len(KINDS) if host_rows else FIRST_HOST_KIND
    with _BELOW_VIEW_TRACKING():
        for name, j, o, n, b, kind in zip(table.names, table.dtype, table.offset, table.nbytes,
                                          islice(table.dims_at, 1, None), table.kind):
            got = typed[j]
            if kind >= first_skipped:
                out[name] = None
            elif n and got is not None:
                strided, item, base = got
                out[name] = strided(shape[a:b], stride[a:b], base + o // item)
            elif n:
                out[name] = buf[o:o + n].view(DTYPES[table.dtypes[j]]).as_strided(shape[a:b], stride[a:b])
            else:
                out[name] = torch.empty_strided(shape[a:b], stride[a:b], dtype=DTYPES[table.dtypes[j]],
                                                device=buf.device)
            a = b
    return out


#: Bytes each row's span is rounded up to in :func:`to_host`'s gather: a multiple of every dtype's item size, so
#: each row starts where a view of its dtype may start
_HOST_GRAIN = 16
#: :func:`to_host` copies the one span from its rows' first byte to their last when it is at most this many times
#: their bytes (each rounded up to :data:`ALIGN`, as :func:`place` puts them) plus :data:`ALIGN`: the daemon
#: places them back to back (:func:`place`'s ``last``), so one slice and one copy serve; rows spread over the
#: buffer (another packer) are gathered instead
_HOST_SPAN_SLACK = 2


def to_host(buf: torch.Tensor, table: TensorTable, rows: list[int]) -> list[torch.Tensor]:
    """Host copies of ``table``'s ``rows`` (indices) of ``buf`` (a flat uint8 buffer, in device memory on a GPU
    engine), each with its row's dtype, shape and stride, as views of one new host buffer: one copy to the host
    for all of them (a copy per tensor would wait for the device once each), of the span they share when
    :func:`place` put them back to back, else of one gather of their spans on the device. Assumes the table was
    checked against ``buf`` (:func:`check_geometry`)."""
    if not rows:
        return []
    offset, nbytes, size = table.offset, table.nbytes, buf.numel()
    filled = [i for i in rows if nbytes[i]]  # an empty row's offset says nothing about where the others are
    lo = min((offset[i] for i in filled), default=0)
    hi = max((offset[i] + nbytes[i] for i in filled), default=0)
    if hi - lo <= _HOST_SPAN_SLACK * sum(-(-nbytes[i] // ALIGN) * ALIGN for i in filled) + ALIGN:
        # from a multiple of the grain to one: every row's start then suits its dtype, and every dtype views it
        lo -= lo % _HOST_GRAIN
        end = lo + -(-(hi - lo) // _HOST_GRAIN) * _HOST_GRAIN
        host = buf[lo:min(end, size)].to("cpu", copy=True)
        if end > size:  # a span at the very end of a buffer of odd size
            host = torch.cat([host, torch.zeros(end - size, dtype=torch.uint8)])
        starts = [offset[i] - lo if nbytes[i] else 0 for i in rows]
    else:
        host, starts = _gathered(buf, offset, nbytes, rows, size)
    typed: dict[int, torch.Tensor] = {}
    out = []
    dtype_of, dims_at, shape, stride, names = table.dtype, table.dims_at, table.shape, table.stride, table.dtypes
    for i, start in zip(rows, starts):
        j = dtype_of[i]
        dtype = DTYPES[names[j]]
        a, b = dims_at[i], dims_at[i + 1]
        if not nbytes[i]:
            out.append(torch.empty_strided(shape[a:b], stride[a:b], dtype=dtype))
            continue
        view = typed.get(j)
        if view is None:
            view = typed[j] = host.view(dtype)
        out.append(view.as_strided(shape[a:b], stride[a:b], start // dtype.itemsize))
    return out


def _gathered(buf: torch.Tensor, offset: list[int], nbytes: list[int], rows: list[int], size: int
              ) -> tuple[torch.Tensor, list[int]]:
    """:func:`to_host`'s copy of rows spread over ``buf``: their spans, each rounded up to :data:`_HOST_GRAIN`
    bytes, gathered on ``buf``'s device and copied to the host at once. Returns the host buffer and each row's
    byte offset in it."""
    parts, starts, at = [], [], 0
    for i in rows:
        o, n = offset[i], nbytes[i]
        padded = -(-n // _HOST_GRAIN) * _HOST_GRAIN
        parts.append(buf[o:min(o + padded, size)])
        if o + padded > size:  # a span at the very end of a buffer of odd size
            parts.append(torch.zeros(o + padded - size, dtype=torch.uint8, device=buf.device))
        starts.append(at)
        at += padded
    return (torch.cat(parts).cpu() if at else torch.empty(0, dtype=torch.uint8)), starts


def fill(buf: torch.Tensor, tensors: dict[str, torch.Tensor], table: TensorTable) -> None:
    """Copy each tensor into its place in ``buf`` (same device or across host/device)."""
    for k, t in tensors.items():
        if t.numel():
            view_at(buf, table[k], k).copy_(t)


#: odd 64-bit multipliers, one per 8-byte word of a window (position-dependent, so swapped words change the sum)
_MIX = 0x9E3779B97F4A7C15
#: A word of eight copies of one byte is that byte times this.
_ONES = 0x0101010101010101
#: Window bytes read per batch (bounds the host memory of checksumming a big table).
BATCH_BYTES = 64 * 2**20


def _word_weights() -> list[int]:
    """The odd weight of each 8-byte word of a window, as unsigned 64-bit values."""
    return [((2 * j + 1) * _MIX) % 2**64 for j in range(SAMPLE // 8)]


def _window_sums(buf: torch.Tensor, starts: Any, lens: Any, transport: Any) -> Any:
    """The weighted word sum (uint64) of each window ``buf[s:s + m]`` padded to :data:`SAMPLE` bytes with its last
    byte. Windows are read in classes of power-of-two widths (a 256-byte span reads 256 bytes, not 4 KiB) by
    ``transport`` (:meth:`.transport.Transport.read_windows`); the padding beyond a class's width is added in
    closed form (the padded words are all ``last byte x 0x0101..01``)."""
    import numpy as np

    w = np.array(_word_weights(), dtype=np.uint64)
    suffix = np.concatenate([np.cumsum(w[::-1], dtype=np.uint64)[::-1], np.zeros(1, dtype=np.uint64)])
    out = np.zeros(len(starts), dtype=np.uint64)
    width = np.maximum(8, 2 ** np.ceil(np.log2(np.maximum(lens, 1))).astype(np.int64))
    with np.errstate(over="ignore"):
        # the classes are the powers of two from 8 to the widest window (SAMPLE): a few comparisons, where
        # np.unique would import numpy.ma on its first call (5-10 ms of the weights phase; nothing else in an
        # engine imports it)
        top = int(width.max()) if len(width) else 0
        for wd in (8 << k for k in range(max(0, top.bit_length() - 3))):
            idx = np.flatnonzero(width == wd)
            if not len(idx):
                continue
            step = max(1, BATCH_BYTES // wd)
            for k in range(0, len(idx), step):
                sel = idx[k:k + step]
                m = lens[sel]
                rows = np.asarray(transport.read_windows(buf, starts[sel].tolist(), m.tolist(), wd))
                last = rows[np.arange(len(sel)), m - 1]
                short = m < wd
                if short.any():
                    rows = np.where(np.arange(wd)[None, :] >= m[:, None], last[:, None], rows)
                # einsum keeps uint64 and reduces without the (windows x words) product array a `(a * w).sum()`
                # would allocate and fill first
                sums = np.einsum("ij,j->i", np.ascontiguousarray(rows).view("<u8"), w[:wd // 8])
                out[sel] = sums + last.astype(np.uint64) * np.uint64(_ONES) * suffix[wd // 8]
    return out


def sample_checksums(buf: torch.Tensor, table: TensorTable, transport: Any = None) -> Any:
    """A 64-bit checksum (``numpy.uint64``, one per row of ``table``, in row order; 0 for an empty tensor) of each
    tensor's three :data:`SAMPLE`-byte windows: start, middle and end of its span, or, for a span shorter than
    three windows, its consecutive windows (the last one shorter, a missing one summing to 0), so that no byte is
    summed twice: a byte in two windows would get the sum of two odd weights, an even one, and a change of a high
    power of two in it would cancel.

    Each window is read as little-endian 8-byte words and summed with position-dependent odd weights, modulo
    2**64 (integer arithmetic, so the result does not depend on the reduction order); the three window sums are
    combined as ``((s0 * P + s1) * P + s2) mod 2**64``. A span of at most :data:`SAMPLE` bytes is one window, padded
    with its last byte, used three times. The windows of a GPU buffer are copied to the host first, so one numpy
    computation serves both. This detects changed or moved bytes in the sampled windows; it is not a
    cryptographic hash. ``transport``: the :class:`.transport.Transport` that made ``buf`` (the daemon's and the
    engine's pass the one they resolved; default: the one of ``buf``'s device). Raises
    :class:`~vllm_fastload.errors.ManifestError` naming the first tensor whose span lies outside ``buf``.
    """
    import numpy as np

    n = len(table)
    out = np.zeros(n, dtype=np.uint64)
    if not n:
        return out
    size = buf.numel()
    try:
        off, nb, _ = _columns(table)
        outside = np.flatnonzero((off < 0) | (nb < 0) | (off > size - nb))
    except OverflowError:  # a value beyond int64: find the row in Python
        outside = [next((i for i, (o, m) in enumerate(zip(table.offset, table.nbytes))
                         if not 0 <= o <= size - m or m < 0), 0)]
    if len(outside):
        i = int(outside[0])
        o, m = table.offset[i], table.nbytes[i]
        raise ManifestError(f"manifest entry {table.names[i]!r} spans [{o}, {o + m}), outside the {size}-byte "
                            f"buffer")
    rows = np.flatnonzero(nb > 0)
    if not len(rows):
        return out
    o, m = off[rows], nb[rows]
    short = m <= SAMPLE
    chunked = (m > SAMPLE) & (m < 3 * SAMPLE)
    last = o + m - SAMPLE
    mid = np.clip(o + m // 2 - SAMPLE // 2, o, last)  # from 3 windows on, [mid, mid + SAMPLE) lies between the others
    starts = np.stack([o, np.where(chunked, o + SAMPLE, mid), np.where(chunked, o + 2 * SAMPLE, last)], axis=1)
    lens = np.stack([np.minimum(m, SAMPLE), np.where(chunked, np.minimum(m - SAMPLE, SAMPLE), SAMPLE),
                     np.where(chunked, m - 2 * SAMPLE, SAMPLE)], axis=1)
    keep = lens > 0
    keep[short, 1:] = False  # a short span is read once
    if transport is None:
        from .backends import get_transport

        transport = get_transport(buf.device)
    sums = np.zeros(starts.shape, dtype=np.uint64)
    sums[keep] = _window_sums(buf, starts[keep], lens[keep], transport)
    sums[short, 1] = sums[short, 0]
    sums[short, 2] = sums[short, 0]
    p = np.uint64(0x100000001B3)
    with np.errstate(over="ignore"):
        out[rows] = (sums[:, 0] * p + sums[:, 1]) * p + sums[:, 2]
    return out
