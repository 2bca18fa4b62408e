"""Safetensors checkpoints: header parsing and validation, and shard selection as vLLM's default loader does it.

The safetensors format (https://huggingface.co/docs/safetensors): 8 bytes little-endian u64 ``N`` = header
length, then ``N`` bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}``, then the data section; offsets are relative to the data section's start (byte ``8 + N``).
This is the only place in the package that parses a header.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import CheckpointError
from .heap import gc_paused
from .storage import FileIdentity, file_identity, is_object_uri, list_safetensors, read_range

#: Bytes per element of each safetensors dtype ("F4" packs two values per byte: 0.5).
DTYPE_BYTES: dict[str, float] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
    "F4": 0.5,
}
#: Twice :data:`DTYPE_BYTES`, as integers: byte counts are computed exactly, never through a float.
_HALF_BYTES = {k: int(2 * v) for k, v in DTYPE_BYTES.items()}
#: Above this many bytes no tensor is real (safetensors offsets are u64): the product of a shape stops there.
_MAX_TENSOR_BYTES = 2**64
#: Largest header accepted (bytes); the safetensors library and runai-model-streamer use 100 MB too.
MAX_HEADER_BYTES = 100 * 1024 * 1024
SAFE_INDEX = "model.safetensors.index.json"
MISTRAL_INDEX = "consolidated.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a header: dtype string, shape, byte range ``[begin, end)`` of the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """Bytes of this tensor in the file."""
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed, validated safetensors header.

    ``header_len`` (bytes, the u64 prefix), ``header_sha256`` (hex digest of the JSON bytes), ``data_bytes``
    (length of the data section implied by the offsets), ``file_size`` (bytes, from the file system or the
    object store; None when the caller of :func:`parse_header` did not know it), ``identity`` (size and
    mtime/inode or ETag/version of the file read, see :class:`~vllm_fastload.storage.FileIdentity`).
    """

    path: str
    header_len: int
    header_sha256: str
    tensors: dict[str, TensorInfo]
    metadata: Optional[dict[str, str]]
    data_bytes: int
    file_size: Optional[int] = None
    identity: Optional[FileIdentity] = None

    @property
    def declared_size(self) -> int:
        """The file size the header implies: 8 + header_len + data_bytes (bytes)."""
        return 8 + self.header_len + self.data_bytes

    @property
    def largest(self) -> Optional[TensorInfo]:
        """The tensor with the most bytes (None for a file without tensors)."""
        return max(self.tensors.values(), key=lambda t: t.nbytes, default=None)


def torch_dtypes() -> dict[str, Any]:
    """Safetensors dtype string -> torch dtype, as runai-model-streamer maps them (its ``safetensors_pytorch``): the
    dtypes the loaders read tensors as, and (inverted) the names the content digest gives a tensor's dtype."""
    from runai_model_streamer.safetensors_streamer.safetensors_pytorch import safetensors_to_torch_dtype

    return dict(safetensors_to_torch_dtype)


def _no_duplicates(path: str):
    def hook(pairs):
        d = dict(pairs)
        if len(d) == len(pairs):  # the common case, checked in C: a header holds one object per tensor
            return d
        seen = set()
        for k, _ in pairs:
            if k in seen:
                # the hook runs for every JSON object: the top level maps names to objects, entries hold values
                what = ("tensor name" if all(isinstance(v, dict) for _, v in pairs)
                        else "key inside one entry (a tensor's fields or __metadata__)")
                raise CheckpointError(f"{path}: duplicate {what} {k!r} in the safetensors header; the file is "
                                      f"malformed: re-export it")
            seen.add(k)
        return dict(pairs)

    return hook


def parse_header(path: str, raw: bytes, header_len: int, file_size: Optional[int],
                 identity: Optional[FileIdentity] = None) -> SafetensorsHeader:
    """Validate header JSON ``raw`` of file ``path``; ``file_size`` (bytes) enables truncation/junk checks;
    ``identity`` is kept on the result (for the fingerprint).

    Raises :class:`CheckpointError` naming the file (and tensor) for: invalid JSON, duplicate names,
    ``__metadata__`` not a str->str object, unknown/empty dtype, bad shape or offsets, a byte length that does
    not match shape x dtype, a hole or overlap between tensors (a zero-element tensor inside another tensor's
    range included: runai-model-streamer refuses those), a truncated file or trailing bytes.
    """
    with gc_paused():  # a few objects per tensor, and a sort of them: no collection walks the heap meanwhile
        obj = _header_object(path, raw)
        metadata = _header_metadata(path, obj)
        tensors = {name: _tensor_info(path, name, spec) for name, spec in obj.items()}
        header = SafetensorsHeader(
            path=path,
            header_len=header_len,
            header_sha256=hashlib.sha256(raw).hexdigest(),
            tensors=tensors,
            metadata=metadata,
            data_bytes=_covered_bytes(path, tensors),
            file_size=file_size,
            identity=identity,
        )
        if file_size is not None:
            _check_file_size(header, file_size)
    return header


def _header_object(path: str, raw: bytes) -> dict[str, Any]:
    """The header JSON ``raw`` as an object (duplicate names refused). Raises :class:`CheckpointError`."""
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(path))
    except CheckpointError:
        raise
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, an integer of thousands of digits, deep nesting
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: safetensors header must be a JSON object, got {type(obj).__name__}")
    if _SURROGATE_ESCAPE.search(raw):  # JSON may escape a lone UTF-16 surrogate, which no UTF-8 text can hold
        for name in obj:
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                raise CheckpointError(f"{path}: tensor name {name!r} holds a lone UTF-16 surrogate (not Unicode text; "
                                      f"the safetensors library refuses it): re-export the checkpoint") from None
    return obj


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _header_metadata(path: str, obj: dict[str, Any]) -> Optional[dict[str, str]]:
    """Pop and return the header's ``__metadata__`` (a str -> str object, or None). Raises :class:`CheckpointError`."""
    metadata = None
    if "__metadata__" in obj:
        metadata = obj.pop("__metadata__")  # null: as absent (the safetensors library reads it so)
        if metadata is not None and (not isinstance(metadata, dict)
                                     or not all(isinstance(v, str) for v in metadata.values())):
            raise CheckpointError(
                f"{path}: '__metadata__' must be an object of string values (or absent), got {metadata!r}"
            )
    return metadata


def _tensor_info(path: str, name: str, spec: Any) -> TensorInfo:
    """Tensor ``name``'s header entry ``spec`` validated: a known dtype, a shape, data offsets spanning exactly
    shape x dtype bytes. Raises :class:`CheckpointError` naming the file and the tensor."""
    # the common case in a few C-level checks (JSON gives exact ints and lists; a bool is not of type int); any
    # doubt goes through the checks below, which name what is wrong
    if type(spec) is dict:
        dtype, shape, offs = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
        if (type(dtype) is str and dtype in DTYPE_BYTES and type(shape) is list and type(offs) is list
                and len(offs) == 2 and type(offs[0]) is int and type(offs[1]) is int and 0 <= offs[0] <= offs[1]
                and all(type(d) is int and 0 <= d < 2**63 for d in shape)
                and offs[1] - offs[0] == _shape_bytes(shape, dtype)):
            return TensorInfo(name, dtype, tuple(shape), offs[0], offs[1])
    return _checked_tensor_info(path, name, spec)


def _shape_bytes(shape: list[int], dtype: str) -> Optional[int]:
    """Bytes of a tensor of ``shape`` (non-negative ints) and safetensors ``dtype``, rounded up to whole bytes
    (F4: two elements per byte), in exact integers; None above :data:`_MAX_TENSOR_BYTES`. The product stops there,
    so a header of thousands of huge dimensions costs no big-integer work."""
    if 0 in shape:
        return 0
    n = _HALF_BYTES[dtype]
    for d in shape:
        n *= d
        if n > 2 * _MAX_TENSOR_BYTES:
            return None
    return -(-n // 2)


def _checked_tensor_info(path: str, name: str, spec: Any) -> TensorInfo:
    """:func:`_tensor_info` one check at a time: raises :class:`CheckpointError` for the first that fails."""
    if not isinstance(spec, dict):
        raise CheckpointError(f"{path}: tensor {name!r}: entry must be an object, got {spec!r}")
    dtype = spec.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise CheckpointError(
            f"{path}: tensor {name!r} has unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}"
        )
    shape = spec.get("shape")
    offs = spec.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63
                                              for d in shape):  # torch sizes are int64, even of empty tensors
        raise CheckpointError(f"{path}: tensor {name!r} has an invalid shape {shape!r} (dimensions are integers "
                              f"from 0 to 2**63 - 1)")
    if (
        not isinstance(offs, list) or len(offs) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)
        or offs[1] < offs[0]
    ):
        raise CheckpointError(f"{path}: tensor {name!r} has invalid data_offsets {offs!r}")
    expect = _shape_bytes(shape, dtype)
    if offs[1] - offs[0] != expect:
        shown = shape if len(shape) <= 8 else f"{shape[:8]}... of {len(shape)} dimensions"
        raise CheckpointError(
            f"{path}: tensor {name!r} ({dtype}, shape {shown}) needs "
            f"{expect if expect is not None else 'more than 2**64'} bytes but data_offsets "
            f"{offs} span {offs[1] - offs[0]}"
        )
    return TensorInfo(name, dtype, tuple(shape), offs[0], offs[1])


def _covered_bytes(path: str, tensors: dict[str, TensorInfo]) -> int:
    """The bytes of the data section the tensors cover, with neither a hole nor an overlap. Raises
    :class:`CheckpointError` naming the first tensor that breaks the coverage."""
    # Coverage, as runai-model-streamer checks it: in (begin, size) order (a zero-element tensor sharing a start
    # sorts first) every tensor starts exactly where the previous one ends.
    pos, last = 0, None
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.nbytes)):
        if t.begin > pos:
            where = "before the first tensor" if pos == 0 else "between tensors"
            raise CheckpointError(
                f"{path}: hole of {t.begin - pos} bytes {where} (tensor {t.name!r} starts at {t.begin}, "
                f"expected {pos}); the file is not a valid safetensors file"
            )
        if t.begin < pos and t.nbytes:
            raise CheckpointError(
                f"{path}: tensor {t.name!r} overlaps the previous tensor (starts at {t.begin} < {pos})")
        if t.begin < pos:
            raise CheckpointError(
                f"{path}: tensor {t.name!r} has zero elements but its data_offsets {[t.begin, t.end]} lie inside "
                f"tensor {last.name!r} {[last.begin, last.end]}; runai-model-streamer refuses such a file "
                f"(\"overlaps with next tensor\"): re-save the checkpoint with the safetensors library, which places "
                f"zero-element tensors between tensors"
            )
        if t.nbytes:
            last = t
        pos = max(pos, t.end)
    return pos


def _check_file_size(header: SafetensorsHeader, file_size: int) -> None:
    """Raise :class:`CheckpointError` when the file of ``header`` (``file_size`` bytes) is truncated (naming the
    first tensor past its end, and whether a copy could explain it) or has bytes after the last tensor."""
    path, tensors = header.path, header.tensors
    if file_size < header.declared_size:
        data_start = header.declared_size - header.data_bytes
        first = min((t for t in tensors.values() if data_start + t.end > file_size), key=lambda t: t.begin)
        missing = header.declared_size - file_size
        # a header that claims more data than the whole file holds was not cut short by a copy: it is wrong
        fix = ("the header declares more missing data than the file holds, which no interrupted download "
               "explains: the header is corrupt or hand-edited; re-export the checkpoint"
               if missing > file_size else "an interrupted download or copy: download or upload the shard again")
        raise CheckpointError(
            f"{path}: file is truncated: {file_size} bytes, but its header declares {header.declared_size}: "
            f"tensor {first.name!r} ({first.dtype}, shape {list(first.shape)}, data_offsets "
            f"[{first.begin}, {first.end}]) ends at byte {data_start + first.end}, past the end of the file "
            f"({missing} bytes missing in all); {fix}"
        )
    if file_size > header.declared_size:
        raise CheckpointError(
            f"{path}: {file_size - header.declared_size} bytes of trailing data after the last tensor "
            f"(file {file_size} bytes, header declares {header.declared_size})"
        )


def shard_changed(files: Iterable[str]) -> Optional[str]:
    """After a failed read of local shards ``files``: why the first one that no longer matches its header does not
    (:func:`read_header`'s message: truncated, grown, corrupt header; or that it cannot be opened any more), or
    None when every shard still looks as it did. Reads only headers."""
    for f in files:
        try:
            read_header(f)
        except CheckpointError as e:
            return str(e)
        except OSError as e:
            return f"{f}: cannot be read any more ({e.strerror or e})"
    return None


def read_header(path: str) -> SafetensorsHeader:
    """Read and validate the header of a local or object-storage safetensors file.

    The file's size comes from the file system or the object store's metadata
    (:func:`~vllm_fastload.storage.file_identity`) before any byte is read, so truncation, a header longer than
    the file and trailing bytes are found the same way, with the same messages, locally and on object storage.
    Raises :class:`CheckpointError` (malformed file, naming it), ``OSError`` or
    :class:`~vllm_fastload.errors.StorageError` (cannot read).
    """
    identity = file_identity(path)
    file_size = identity.size
    if file_size < 8:
        raise CheckpointError(f"{path}: file is {file_size} bytes, too short for a safetensors header length")
    prefix = read_range(path, 0, 8)
    if len(prefix) < 8:  # the file shrank since it was measured
        raise CheckpointError(f"{path}: file is {len(prefix)} bytes, too short for a safetensors header length")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{path}: header length {n} bytes is absurdly large (limit {MAX_HEADER_BYTES}); not a safetensors file?"
        )
    if 8 + n > file_size:
        raise CheckpointError(f"{path}: header length {n} bytes is larger than the file ({file_size} bytes)")
    raw = read_range(path, 8, n)
    if len(raw) < n:
        raise CheckpointError(f"{path}: header length {n} bytes is larger than the file")
    return parse_header(path, raw, n, file_size, identity)


@dataclass(frozen=True)
class ShardPlan:
    """The safetensors shards one load reads, chosen as vLLM's default loader chooses them.

    ``source``: directory or object-storage prefix; ``files``: full paths/URIs, sorted; ``index``: the index
    file used to filter them (None when there is none); ``weight_map``: the index's tensor name -> shard file
    name (None without an index).
    """

    source: str
    files: tuple[str, ...]
    index: Optional[str] = None
    ignored: tuple[str, ...] = field(default=())
    weight_map: Optional[dict[str, str]] = field(default=None, compare=False, repr=False)


def weights_source(model_config: Any) -> str:
    """Where vLLM's ``ModelConfig`` says the weights are: ``model_weights`` (set by vLLM to the object-storage
    URI when it pulled config and tokenizer files to the local ``model`` directory) or ``model``."""
    return str(getattr(model_config, "model_weights", None) or model_config.model)


def model_shards(model_config: Any) -> ShardPlan:
    """:func:`select_shards` for a vLLM ``ModelConfig``; an object-storage source finds its index in the local
    directory vLLM pulled the ``*.json`` files to."""
    source, local = weights_source(model_config), str(model_config.model)
    return select_shards(source, local if source != local else None)


def _base(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


#: A Hugging Face cache snapshot file: ``.../models--ORG--NAME/snapshots/REVISION/FILE`` (a link into ``blobs/``).
_HF_SNAPSHOT = re.compile(r"(?:^|/)(models|datasets|spaces)--([^/]+)/snapshots/([^/]+)/")


def _unusable_file(path: str) -> Optional[str]:
    """Why the local file ``path`` (a shard or index the load needs) cannot be opened, or None.

    Names a symbolic link's target and, for a link into a Hugging Face cache's ``blobs/`` whose blob is gone, the
    likely cause (an incomplete or evicted download) and the command that restores it.
    """
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            return f"{path} is not a regular file" + (" (a directory)" if stat.S_ISDIR(st.st_mode) else "")
        os.close(os.open(path, os.O_RDONLY))
        return None
    except OSError as e:
        err = e
    if not os.path.islink(path):
        return f"{path} cannot be opened ({os.strerror(err.errno)})" if err.errno else f"{path}: {err}"
    target = os.readlink(path)
    resolved = os.path.realpath(path)
    link = f"{path} is a symbolic link to {target}" + (f" ({resolved})" if resolved != target else "")
    if err.errno == errno.ELOOP:
        return f"{link}, a loop of links: fix or replace the link"
    if err.errno != errno.ENOENT:
        return f"{link}, which cannot be opened ({os.strerror(err.errno)})"
    hf = _HF_SNAPSHOT.search(path)
    if hf:
        kind, name, revision = hf.groups()
        repo = name.replace("--", "/", 1)
        flag = "" if kind == "models" else f" --repo-type {kind[:-1]}"
        return (f"{link}, which does not exist: the Hugging Face cache holds this snapshot's link but not its blob, "
                f"the mark of an incomplete or evicted download; download it again (`hf download {repo} --revision "
                f"{revision}{flag}`) or pass a directory holding the files")
    return f"{link}, which does not exist: restore the target, or replace the link with the file"


def _check_local(paths: Any) -> None:
    """Raise :class:`CheckpointError` for the first local file in ``paths`` that cannot be opened."""
    for p in paths:
        problem = None if is_object_uri(p) else _unusable_file(p)
        if problem:
            raise CheckpointError(problem)


#: JSON's names of the values json.load makes, for errors about a file's shape.
_JSON_KIND = {type(None): "null", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
              dict: "object"}


def select_shards(source: str, index_dir: Optional[str] = None) -> ShardPlan:
    """Choose the ``*.safetensors`` shards of ``source`` to load.

    When ``consolidated*.safetensors`` exist (Mistral layout) only those are used, with
    ``consolidated.safetensors.index.json``, as vLLM's default loader does. With ``model.safetensors.index.json``
    (looked for in ``index_dir``, default ``source``; for object storage
    vLLM pulls the ``*.json`` files to a local directory, pass that), only the shards its ``weight_map`` names are
    used, and a named shard that does not exist raises :class:`CheckpointError` naming it — as vLLM's
    ``filter_duplicate_safetensors_files`` does. Without an index every ``*.safetensors`` file is used.
    A chosen local shard (or the index) that cannot be opened — a symbolic link to a missing file (a Hugging Face
    cache whose blob is gone), a link loop, a directory, no permission — raises :class:`CheckpointError` naming
    it, its target and the fix, before anything is built. So does an index whose ``weight_map`` is empty.
    Returns a plan with no files when the source holds no safetensors (the caller decides on fallback).
    """
    files = list_safetensors(source)
    index_name = SAFE_INDEX
    mistral = [f for f in files if _base(f).startswith("consolidated")]
    if mistral:
        # vLLM's default loader (load format auto) switches to the Mistral layout whenever consolidated*.safetensors
        # exist, and then loads only those: never both layouts.
        files, index_name = mistral, MISTRAL_INDEX
    index_dir = index_dir or (None if is_object_uri(source) else source)
    index = os.path.join(index_dir, index_name) if index_dir else None
    if index and os.path.lexists(index) and not os.path.isfile(index):
        _check_local([index])  # a broken link or a directory: loading without it would choose other shards
    if not index or not os.path.isfile(index):
        _check_local(files)
        return ShardPlan(source, tuple(files))
    try:
        with open(index) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: not JSON, not UTF-8, an integer too long to convert
        raise CheckpointError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        if not isinstance(doc, dict):
            got = f"the file is a JSON {_JSON_KIND.get(type(doc), type(doc).__name__)}, not an object"
        elif "weight_map" not in doc:
            got = "there is no 'weight_map'"
        else:
            got = f"'weight_map' is a JSON {_JSON_KIND.get(type(doc['weight_map']), 'value')}"
        raise CheckpointError(f"{index}: not a valid safetensors index: {got}; an index is a JSON object whose "
                              f"'weight_map' object maps each tensor name to its shard's file name. Fix the "
                              f"index, or remove it to load every *.safetensors file")
    weight_map = doc["weight_map"]
    bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise CheckpointError(f"{index}: weight_map entry {bad[0]!r} maps to {bad[1]!r}, not a shard file name; "
                              f"fix the index (each tensor name maps to the file name of its shard)")
    wanted = sorted(set(weight_map.values()))
    outside = [w for w in wanted if os.path.isabs(w) or os.path.basename(w) != w or w in (".", "..")]
    if outside:  # vLLM's loaders take shards from the model folder only: such an entry is a broken index
        raise CheckpointError(
            f"{index}: weight_map names {outside[0]!r}, which is not a file name in the model folder (index entries "
            f"name shards beside the index, without a directory); fix the index")
    if not wanted:
        raise CheckpointError(
            f"{index}: weight_map is empty, so the index selects no shard and the load would hold no tensors; fix "
            f"the index (it maps each tensor name to its shard) or remove it to load every *.safetensors file")
    by_name = {_base(f): f for f in files}
    missing = [w for w in wanted if w not in by_name]
    if missing:
        raise CheckpointError(
            f"{index} names shard(s) missing from {source}: {', '.join(missing)}. Restore the file(s) or fix the "
            f"index; loading without them would leave weights uninitialized."
        )
    chosen = tuple(by_name[w] for w in wanted)
    _check_local(chosen)
    ignored = tuple(f for f in files if f not in chosen)
    return ShardPlan(source, chosen, index, ignored, dict(weight_map))


@dataclass(frozen=True)
class Duplicate:
    """A tensor name stored in more than one selected shard: ``files`` (full paths, plan order) and ``kept`` (the
    one the index assigns it to, the only copy loaded)."""

    name: str
    files: tuple[str, ...]
    kept: str


@dataclass(frozen=True)
class Checkpoint:
    """What one load reads: the plan, one header per ``plan.files`` entry whose ``tensors`` are the tensors to
    load from that file (copies the index assigns to another shard removed), and the duplicates resolved."""

    plan: ShardPlan
    headers: tuple[SafetensorsHeader, ...]
    duplicates: tuple[Duplicate, ...] = ()

    @property
    def tensor_count(self) -> int:
        """Tensors the load yields (each name once)."""
        return sum(len(h.tensors) for h in self.headers)

    def warnings(self) -> list[str]:
        """One text per shard holding copies that are not loaded (the loaders log each as a WARNING, ``inspect``
        lists them): the tensors, the file they are loaded from instead, and the index that decided it."""
        by_ignored: dict[str, list[Duplicate]] = {}
        for d in self.duplicates:
            for f in d.files:
                if f != d.kept:
                    by_ignored.setdefault(f, []).append(d)
        out = []
        for f, dups in by_ignored.items():
            shown = ", ".join(f"{d.name!r} (loaded from {_base(d.kept)})" for d in dups[:5])
            more = f" and {len(dups) - 5} more" if len(dups) > 5 else ""
            out.append(f"{f} also holds {len(dups)} tensor(s) that {self.plan.index} assigns to another shard; those "
                       f"copies are not loaded: {shown}{more}")
        return out


def resolve_duplicates(plan: ShardPlan, headers: list[SafetensorsHeader]) -> Checkpoint:
    """Find every tensor name stored in more than one of ``headers`` (one per ``plan.files`` entry) and decide,
    before any data is read, which copy loads.

    With an index, the copy in the shard its ``weight_map`` assigns the name to; the other copies are dropped
    from the returned headers (see :meth:`Checkpoint.warnings`). Raises :class:`CheckpointError` naming the
    tensor and every file holding it when there is no index, or the index does not assign the name to one of
    those files: loading them all would let the last copy read win, which depends on read order.
    """
    names: set[str] = set()
    for h in headers:
        names.update(h.tensors)
    if len(names) == sum(len(h.tensors) for h in headers):  # no name twice (the common case), without a list per name
        return Checkpoint(plan, tuple(headers))
    holders: dict[str, list[int]] = {}
    for i, h in enumerate(headers):
        for name in h.tensors:
            holders.setdefault(name, []).append(i)
    dups = {name: idx for name, idx in holders.items() if len(idx) > 1}
    if not dups:
        return Checkpoint(plan, tuple(headers))
    wm = plan.weight_map or {}
    unresolved = [n for n, idx in dups.items() if wm.get(n) not in {_base(headers[i].path) for i in idx}]
    if unresolved:
        name = unresolved[0]
        files = ", ".join(headers[i].path for i in dups[name])
        if plan.index is None:
            why = (f"no safetensors index ({SAFE_INDEX}) says which copy to load (loading both, the last copy "
                   f"read would win, in an order that depends on the reader)")
            fix = ("remove the file(s) that do not belong to the model, or add an index whose weight_map assigns "
                   "each tensor to one shard")
        else:
            said = f"assigns it to {wm[name]}" if name in wm else "does not list it"
            why = f"{plan.index} {said}"
            fix = "fix the index's weight_map or remove the extra copy"
        more = (f"; {len(unresolved) - 1} more tensor name(s) are in more than one shard too, e.g. "
                f"{', '.join(repr(n) for n in unresolved[1:4])}" if len(unresolved) > 1 else "")
        raise CheckpointError(f"tensor {name!r} is stored in {len(dups[name])} shards ({files}) and {why}: {fix}"
                              f"{more}")
    found, kept_files = [], {}
    for name, idx in dups.items():
        files = tuple(headers[i].path for i in idx)
        keep = next(f for f in files if _base(f) == wm[name])
        found.append(Duplicate(name, files, keep))
        kept_files[name] = keep
    out = [dataclasses.replace(h, tensors={n: t for n, t in h.tensors.items()
                                           if kept_files.get(n, h.path) == h.path}) for h in headers]
    return Checkpoint(plan, tuple(out), tuple(found))


def no_tensors_problem(plan: ShardPlan, headers: list[SafetensorsHeader]) -> Optional[str]:
    """The error text when the selected shards hold no tensor at all (e.g. only ``__metadata__``), else None."""
    if not headers or any(h.tensors for h in headers):
        return None
    names = ", ".join(_base(h.path) for h in headers)
    return (f"{plan.source}: the selected shard(s) hold no tensors ({names}: headers without tensor entries), so "
            f"the model's weights would stay uninitialized; point the load at the directory holding the weights, or "
            f"re-export the checkpoint")


def read_checkpoint(plan: ShardPlan) -> Checkpoint:
    """Read and validate every header of ``plan`` and resolve duplicate names (:func:`resolve_duplicates`), before
    any tensor data is read. Raises :class:`CheckpointError` for a malformed shard, an unresolvable duplicate or
    shards without tensors; ``OSError`` / :class:`~vllm_fastload.errors.StorageError` when a shard cannot be read."""
    headers = [read_header(f) for f in plan.files]
    problem = no_tensors_problem(plan, headers)
    if problem:
        raise CheckpointError(problem)
    return resolve_duplicates(plan, headers)
