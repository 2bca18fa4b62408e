"""Safetensors checkpoints: header parsing and validation, and shard selection as vLLM's default loader does it.

The safetensors format (https://huggingface.co/docs/safetensors): 8 bytes little-endian u64 ``N`` = header
length, then ``N`` bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}``, then the data section; offsets are relative to the data section's start (byte ``8 + N``).
This is the only place in the package that parses a header.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import CheckpointError
from .storage import is_object_uri, list_safetensors, read_range

#: Bytes per element of each safetensors dtype ("F4" packs two values per byte: 0.5).
DTYPE_BYTES: dict[str, float] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
    "F4": 0.5,
}
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
    (length of the data section implied by the offsets), ``file_size`` (bytes, None for object storage).
    """

    path: str
    header_len: int
    header_sha256: str
    tensors: dict[str, TensorInfo]
    metadata: Optional[dict[str, str]]
    data_bytes: int
    file_size: Optional[int] = None

    @property
    def declared_size(self) -> int:
        """The file size the header implies: 8 + header_len + data_bytes (bytes)."""
        return 8 + self.header_len + self.data_bytes

    @property
    def largest(self) -> Optional[TensorInfo]:
        """The tensor with the most bytes (None for a file without tensors)."""
        return max(self.tensors.values(), key=lambda t: t.nbytes, default=None)


def _no_duplicates(path: str):
    def hook(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise CheckpointError(f"{path}: duplicate tensor name {k!r} in the safetensors header")
            seen.add(k)
        return dict(pairs)

    return hook


def parse_header(path: str, raw: bytes, header_len: int, file_size: Optional[int]) -> SafetensorsHeader:
    """Validate header JSON ``raw`` of file ``path``; ``file_size`` (bytes) enables truncation/junk checks.

    Raises :class:`CheckpointError` naming the file (and tensor) for: invalid JSON, duplicate names,
    ``__metadata__`` not a str->str object, unknown/empty dtype, bad shape or offsets, a byte length that does
    not match shape x dtype, a hole or overlap between tensors, a truncated file or trailing bytes.
    """
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(path))
    except CheckpointError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: safetensors header must be a JSON object, got {type(obj).__name__}")
    metadata = None
    if "__metadata__" in obj:
        metadata = obj.pop("__metadata__")
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise CheckpointError(
                f"{path}: '__metadata__' must be an object of string values (or absent), got {metadata!r}"
            )
    tensors: dict[str, TensorInfo] = {}
    for name, spec in obj.items():
        if not isinstance(spec, dict):
            raise CheckpointError(f"{path}: tensor {name!r}: entry must be an object, got {spec!r}")
        dtype = spec.get("dtype")
        if dtype not in DTYPE_BYTES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}"
            )
        shape = spec.get("shape")
        offs = spec.get("data_offsets")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise CheckpointError(f"{path}: tensor {name!r} has an invalid shape {shape!r}")
        if (
            not isinstance(offs, list) or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)
            or offs[1] < offs[0]
        ):
            raise CheckpointError(f"{path}: tensor {name!r} has invalid data_offsets {offs!r}")
        expect = math.ceil(math.prod(shape) * DTYPE_BYTES[dtype])
        if offs[1] - offs[0] != expect:
            raise CheckpointError(
                f"{path}: tensor {name!r} ({dtype}, shape {shape}) needs {expect} bytes but data_offsets "
                f"{offs} span {offs[1] - offs[0]}"
            )
        tensors[name] = TensorInfo(name, dtype, tuple(shape), offs[0], offs[1])
    # Coverage: sorted by (begin, size) so a zero-element tensor sharing a start sorts first.
    pos = 0
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.nbytes)):
        if t.begin > pos:
            where = "before the first tensor" if pos == 0 else "between tensors"
            raise CheckpointError(
                f"{path}: hole of {t.begin - pos} bytes {where} (tensor {t.name!r} starts at {t.begin}, "
                f"expected {pos}); the file is not a valid safetensors file"
            )
        if t.begin < pos and t.nbytes:
            raise CheckpointError(f"{path}: tensor {t.name!r} overlaps the previous tensor (starts at {t.begin} < {pos})")
        pos = max(pos, t.end)
    header = SafetensorsHeader(
        path=path,
        header_len=header_len,
        header_sha256=hashlib.sha256(raw).hexdigest(),
        tensors=tensors,
        metadata=metadata,
        data_bytes=pos,
        file_size=file_size,
    )
    if file_size is not None:
        if file_size < header.declared_size:
            raise CheckpointError(
                f"{path}: file is truncated: {file_size} bytes, but its header declares {header.declared_size}"
            )
        if file_size > header.declared_size:
            raise CheckpointError(
                f"{path}: {file_size - header.declared_size} bytes of trailing data after the last tensor "
                f"(file {file_size} bytes, header declares {header.declared_size})"
            )
    return header


def read_header(path: str) -> SafetensorsHeader:
    """Read and validate the header of a local or object-storage safetensors file.

    Raises :class:`CheckpointError` (malformed file, naming it), ``OSError`` or
    :class:`~vllm_fastload.errors.StorageError` (cannot read).
    """
    file_size = None if is_object_uri(path) else os.path.getsize(path)
    prefix = read_range(path, 0, 8)
    if len(prefix) < 8:
        raise CheckpointError(f"{path}: file is {len(prefix)} bytes, too short for a safetensors header length")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{path}: header length {n} bytes is absurdly large (limit {MAX_HEADER_BYTES}); not a safetensors file?"
        )
    if file_size is not None and 8 + n > file_size:
        raise CheckpointError(f"{path}: header length {n} bytes is larger than the file ({file_size} bytes)")
    raw = read_range(path, 8, n)
    if len(raw) < n:
        raise CheckpointError(f"{path}: header length {n} bytes is larger than the file")
    return parse_header(path, raw, n, file_size)


@dataclass(frozen=True)
class ShardPlan:
    """The safetensors shards one load reads, chosen as vLLM's default loader chooses them.

    ``source``: directory or object-storage prefix; ``files``: full paths/URIs, sorted; ``index``: the index
    file used to filter them (None when there is none).
    """

    source: str
    files: tuple[str, ...]
    index: Optional[str] = None
    ignored: tuple[str, ...] = field(default=())


def weights_source(model_config: Any) -> str:
    """Where vLLM's ``ModelConfig`` says the weights are: ``model_weights`` (set by vLLM to the object-storage
    URI when it pulled config and tokenizer files to the local ``model`` directory) or ``model``."""
    return str(getattr(model_config, "model_weights", None) or model_config.model)


def model_shards(model_config: Any) -> ShardPlan:
    """:func:`select_shards` for a vLLM ``ModelConfig``; an object-storage source finds its index in the local
    directory vLLM pulled the ``*.json`` files to."""
    source, local = weights_source(model_config), str(model_config.model)
    return select_shards(source, local if source != local else None)


def select_shards(source: str, index_dir: Optional[str] = None) -> ShardPlan:
    """Choose the ``*.safetensors`` shards of ``source`` to load.

    When ``consolidated*.safetensors`` exist (Mistral layout) only those are used, with
    ``consolidated.safetensors.index.json``, as vLLM's default loader does. With ``model.safetensors.index.json``
    (looked for in ``index_dir``, default ``source``; for object storage
    vLLM pulls the ``*.json`` files to a local directory, pass that), only the shards its ``weight_map`` names are
    used, and a named shard that does not exist raises :class:`CheckpointError` naming it — as vLLM's
    ``filter_duplicate_safetensors_files`` does. Without an index every ``*.safetensors`` file is used.
    Returns a plan with no files when the source holds no safetensors (the caller decides on fallback).
    """
    files = list_safetensors(source)
    index_name = SAFE_INDEX
    mistral = [f for f in files if f.rstrip("/").rsplit("/", 1)[-1].startswith("consolidated")]
    if mistral:
        # vLLM's default loader (load format auto) switches to the Mistral layout whenever consolidated*.safetensors
        # exist, and then loads only those: never both layouts.
        files, index_name = mistral, MISTRAL_INDEX
    index_dir = index_dir or (None if is_object_uri(source) else source)
    index = os.path.join(index_dir, index_name) if index_dir else None
    if not index or not os.path.isfile(index):
        return ShardPlan(source, tuple(files))
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        wanted = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
    by_name = {f.rstrip("/").rsplit("/", 1)[-1]: f for f in files}
    missing = [w for w in wanted if w not in by_name]
    if missing:
        raise CheckpointError(
            f"{index} names shard(s) missing from {source}: {', '.join(missing)}. Restore the file(s) or fix the "
            f"index; loading without them would leave weights uninitialized."
        )
    chosen = tuple(by_name[w] for w in wanted)
    ignored = tuple(f for f in files if f not in chosen)
    return ShardPlan(source, chosen, index, ignored)
