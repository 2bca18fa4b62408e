"""The typed wire schema of the weight-cache protocol: one pydantic model per message (framing: :mod:`.protocol`).

Requests (client -> daemon) are validated strictly and completely before the daemon acts on them: every field's
type and range, no unknown fields. A message that fails gets an ``error`` frame naming the field, and the
connection stays usable. Replies (daemon -> client) are validated by the client before it trusts them: known
fields strictly, unknown fields ignored (a newer daemon may add status fields). The fingerprint's wire model is
derived from :class:`~vllm_fastload.fingerprint.Fingerprint` itself, so the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from functools import cached_property
from typing import Annotated, Any, Literal, NamedTuple, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from ...config import Mode
from ...fingerprint import Fingerprint
from .protocol import PROTOCOL_VERSION, ProtocolError


class MessageError(ProtocolError):
    """A frame that is valid JSON but not a valid message of this protocol; the message names the message type and
    the field."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


def _wire_type(tp: Any) -> Any:
    """``tp`` with each dataclass replaced by its wire model and tuples by lists (JSON has arrays only)."""
    if dataclasses.is_dataclass(tp):
        return wire_model(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is None or not args:
        return tp
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return list[_wire_type(args[0])]
        return tuple[tuple(map(_wire_type, args))]
    if origin is Union:
        return Union[tuple(_wire_type(a) for a in args)]
    if origin is list:
        return list[_wire_type(args[0])]
    if origin is dict:
        return dict[args[0], _wire_type(args[1])]
    return tp


_MODELS: dict[type, type[BaseModel]] = {}


def wire_model(dc: type) -> type[BaseModel]:
    """The strict pydantic model of a (frozen) dataclass's JSON form (``dataclasses.asdict``): same fields, same
    defaults, nested dataclasses as nested models. Cached per class."""
    if dc not in _MODELS:
        hints = typing.get_type_hints(dc)
        fields: dict[str, Any] = {}
        for f in dataclasses.fields(dc):
            default = f.default if f.default is not dataclasses.MISSING else ...
            fields[f.name] = (_wire_type(hints[f.name]), default)
        _MODELS[dc] = create_model(f"Wire{dc.__name__}", __base__=_Request, **fields)
    return _MODELS[dc]


WireFingerprint = wire_model(Fingerprint)


# --- requests ------------------------------------------------------------------------------------------------
class Hello(_Request):
    """``hello``: the engine's protocol version and fingerprint (and its pid, for the daemon's log); answered by
    ``manifest`` (+ its segment's fd) or ``error``. The mode is the attach's: a hello is the same for both."""

    type: Literal["hello"] = "hello"
    version: int
    fingerprint: WireFingerprint  # type: ignore[valid-type]
    pid: Optional[int] = Field(None, ge=0)

    def to_fingerprint(self) -> Fingerprint:
        """The fingerprint as the dataclass the daemon compares."""
        return Fingerprint.from_dict(self.fingerprint.model_dump())


class Attach(_Request):
    """``attach``: the engine uses the mapped weights in ``mode``; only after this connection got the manifest."""

    type: Literal["attach"] = "attach"
    mode: Mode


class Release(_Request):
    """``release``: a copy-mode engine cloned everything; only after this connection attached in copy mode."""

    type: Literal["release"] = "release"


class Status(_Request):
    """``status``: the daemon's state (``vllm-fastload status``, ``/health``, ``/metrics``)."""

    type: Literal["status"] = "status"


class Bye(_Request):
    """``bye``: the client is done; the daemon closes the connection."""

    type: Literal["bye"] = "bye"


REQUESTS: dict[str, type[_Request]] = {m.model_fields["type"].default: m for m in (Hello, Attach, Release, Status, Bye)}


# --- replies -------------------------------------------------------------------------------------------------
class SegmentMeta(_Reply):
    """One export buffer of a manifest: its size in bytes, its transport and (CUDA) the device identity."""

    size: int = Field(ge=0)
    transport: Literal["memfd", "cuda_vmm"]
    device: Optional[str] = None


#: The kinds of exported tensor, by their index in :attr:`TensorTable.kind`: a parameter, a buffer, a plain tensor
#: attribute of a module, and a parameter the daemon's post-processing left of the vLLM parameter class the model
#: built it with (``ModelWeightParameter``...: every linear weight of a dense GPU model), whose skeleton object an
#: engine keeps, class and attributes, as ``auto`` does (``kept_param``); then the same four for a tensor the
#: daemon's model keeps in host memory while its device is a GPU (``host_`` + kind: vLLM's attention layers make
#: ``_k_scale_cpu`` anew on the host in post-processing), which the engine copies to the host
#: (:func:`.layout.to_host`), as ``auto``'s model has it there.
KINDS = ("param", "buffer", "attr", "kept_param", "host_param", "host_buffer", "host_attr", "host_kept_param")
#: The index of each kind in :data:`KINDS`.
KIND_INDEX = {k: i for i, k in enumerate(KINDS)}
#: The first index of a ``host_`` kind in :data:`KINDS`.
FIRST_HOST_KIND = KIND_INDEX["host_param"]


class TensorRow(NamedTuple):
    """One tensor of a :class:`TensorTable`: ``dtype`` (a :data:`.layout.DTYPES` name), ``shape`` and ``stride``
    (elements), ``offset`` and ``nbytes`` (bytes of the span the strides address), ``checksum`` (the 64-bit sample of
    :func:`.layout.sample_checksums`) and ``kind`` (one of :data:`KINDS`)."""

    dtype: str
    shape: list[int]
    stride: list[int]
    offset: int
    nbytes: int
    checksum: int
    kind: str


class TensorTable(_Reply):
    """Where every exported tensor sits in the segment, one column per field (row ``i`` is tensor ``names[i]``).

    Columns, not one JSON object per tensor: a 100k-tensor manifest is ten arrays that JSON decodes and pydantic
    validates in bulk, and that :mod:`.layout` checks, views and checksums with numpy, instead of 100k objects
    validated one by one. ``dtypes`` are the distinct dtype names and ``dtype[i]`` an index into them; ``kind[i]``
    an index into :data:`KINDS`; ``shape`` and ``stride`` hold every tensor's dimensions one after the other
    (``ndim[i]`` of them for tensor ``i``); ``checksum`` unsigned 64-bit integers. This model checks the columns'
    lengths, indices and name uniqueness; the geometry against the buffer is :func:`.layout.check_geometry`'s."""

    names: list[str]
    dtypes: list[str]
    dtype: list[int]
    kind: list[int]
    offset: list[int]
    nbytes: list[int]
    ndim: list[int]
    shape: list[int]
    stride: list[int]
    checksum: list[int]

    @model_validator(mode="after")
    def _consistent(self) -> TensorTable:
        n = len(self.names)
        for col in ("dtype", "kind", "offset", "nbytes", "ndim", "checksum"):
            if len(getattr(self, col)) != n:
                raise ValueError(f"column {col!r} has {len(getattr(self, col))} entries for {n} tensor names")
        if len(set(self.names)) != n:
            raise ValueError("a tensor name appears twice in 'names'")
        if self.dtype and not 0 <= min(self.dtype) <= max(self.dtype) < len(self.dtypes):
            raise ValueError(f"column 'dtype' holds an index outside the {len(self.dtypes)} names of 'dtypes'")
        if self.kind and not 0 <= min(self.kind) <= max(self.kind) < len(KINDS):
            raise ValueError(f"column 'kind' holds an index outside {list(KINDS)}")
        if self.ndim and min(self.ndim) < 0:
            raise ValueError("column 'ndim' holds a negative number")
        if not len(self.shape) == len(self.stride) == sum(self.ndim):
            raise ValueError(f"columns 'shape' ({len(self.shape)}) and 'stride' ({len(self.stride)}) must hold "
                             f"sum(ndim) = {sum(self.ndim)} entries")
        if self.checksum and not 0 <= min(self.checksum) <= max(self.checksum) < 2**64:
            raise ValueError("column 'checksum' holds a value outside the unsigned 64-bit range")
        return self

    def __len__(self) -> int:
        return len(self.names)

    @cached_property
    def index(self) -> dict[str, int]:
        """Row of each name."""
        return {k: i for i, k in enumerate(self.names)}

    @cached_property
    def dims_at(self) -> list[int]:
        """Where tensor ``i``'s dimensions start in ``shape``/``stride`` (``n + 1`` entries, the last = their end)."""
        out, at = [0], 0
        for d in self.ndim:
            at += d
            out.append(at)
        return out

    def row(self, i: int) -> TensorRow:
        """Tensor ``i`` as one record."""
        a, b = self.dims_at[i], self.dims_at[i + 1]
        return TensorRow(self.dtypes[self.dtype[i]], self.shape[a:b], self.stride[a:b], self.offset[i],
                         self.nbytes[i], self.checksum[i], KINDS[self.kind[i]])

    def __getitem__(self, name: str) -> TensorRow:
        """The row of tensor ``name``; ``KeyError`` when the table has none of that name."""
        return self.row(self.index[name])

    def rows(self) -> Iterator[tuple[str, TensorRow]]:
        """``(name, row)`` of every tensor, in table order."""
        for i, k in enumerate(self.names):
            yield k, self.row(i)

    def total_bytes(self) -> int:
        """Bytes of every tensor's span together."""
        return sum(self.nbytes)

    @classmethod
    def of(cls, rows: dict[str, TensorRow]) -> TensorTable:
        """The table of ``name -> row``."""
        dtypes: dict[str, int] = {}
        cols: dict[str, list] = {c: [] for c in ("dtype", "kind", "offset", "nbytes", "ndim", "shape", "stride",
                                                  "checksum")}
        for r in rows.values():
            cols["dtype"].append(dtypes.setdefault(r.dtype, len(dtypes)))
            cols["kind"].append(KIND_INDEX[r.kind])
            cols["offset"].append(int(r.offset))
            cols["nbytes"].append(int(r.nbytes))
            cols["ndim"].append(len(r.shape))
            cols["shape"].extend(int(d) for d in r.shape)
            cols["stride"].extend(int(s) for s in r.stride)
            cols["checksum"].append(int(r.checksum))
        return cls(names=list(rows), dtypes=list(dtypes), **cols)


class Constructed(_Reply):
    """What the engine's skeleton keeps of its own constructor's small tensors
    (:mod:`~vllm_fastload.ipc.memory.constructed`): ``digest`` (``"<count>:<sha256>"`` of the daemon's
    constructor's, which the engine's must equal), ``kept`` (how many module tensors are not exported because they
    are still as built) and ``dropped`` (dotted names the daemon's post-processing removed, which the engine
    removes)."""

    digest: str
    kept: int = Field(ge=0)
    dropped: list[str] = []


class Manifest(_Reply):
    """``manifest``: everything the engine installs; sent with the fd of its one segment (a rank exports one
    buffer: one fd, one device allocation, every tensor by offset)."""

    type: Literal["manifest"] = "manifest"
    version: int
    fingerprint: dict[str, Any]
    fingerprint_short: Optional[str] = None
    segment: SegmentMeta
    tensors: TensorTable
    aliases: dict[str, str] = {}
    reprocess: list[str] = []
    attrs: dict[str, dict[str, Any]] = {}
    object_attrs: dict[str, dict[str, Any]] = {}
    objects: dict[str, list[str]] = {}  # what post-processing bound (module -> dotted paths): the engine's audit
    content_digest: Optional[str] = None  # set when the daemon hashed its load (``content_hash``)
    constructed: Constructed


class Error(_Reply):
    """``error``: why the daemon refused; ``mismatched`` lists ``[field, daemon value, engine value]``."""

    type: Literal["error"] = "error"
    reason: str
    mismatched: Optional[list[Annotated[list[Any], Field(min_length=3, max_length=3)]]] = None


class Attached(_Reply):
    """``attached``: the number of clients now attached."""

    type: Literal["attached"] = "attached"
    clients: int = Field(ge=0)


class Released(_Reply):
    """``released``: whether the daemon freed its memory."""

    type: Literal["released"] = "released"
    freed: bool


class StatusReply(_Reply):
    """``status``: one rank's state (the fields ``vllm-fastload status`` and ``/metrics`` print)."""

    type: Literal["status"] = "status"
    model: str
    device: str
    socket: str
    fingerprint: dict[str, Any]
    fingerprint_short: Optional[str] = None
    content_digest: Optional[str] = None
    tensors: int
    bytes: int
    state: Literal["loading", "released", "ready"]
    clients: int
    client_modes: list[Mode]
    attaches: int
    fingerprint_mismatches: int
    load_seconds: float
    uptime_s: float
    pid: int


REPLIES: dict[str, type[_Reply]] = {"manifest": Manifest, "error": Error, "attached": Attached,
                                    "released": Released, "status": StatusReply}


def describe(e: ValidationError, what: str, limit: int = 3) -> str:
    """One line per failing field (at most ``limit``): ``invalid 'attach' message: field 'mode': Input should be
    'zero_copy' or 'copy' (got None)``. Values are cut to 60 characters."""
    parts = []
    for err in e.errors(include_url=False)[:limit]:
        loc = ".".join(str(x) for x in err["loc"]) or "(message)"
        if err["type"] == "missing":
            parts.append(f"field {loc!r}: missing")
        elif err["type"] == "extra_forbidden":
            parts.append(f"field {loc!r}: not a field of this message")
        else:
            got = repr(err.get("input"))
            got = got if len(got) <= 60 else got[:57] + "..."
            parts.append(f"field {loc!r}: {err['msg']} (got {got})")
    more = len(e.errors()) - limit
    return f"invalid {what!r} message: " + "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def _validate(model: type[BaseModel], msg: dict[str, Any], kind: str) -> Any:
    try:
        return model.model_validate(msg)
    except ValidationError as e:
        raise MessageError(describe(e, kind)) from None
    except RecursionError:
        raise MessageError(f"invalid {kind!r} message: nested too deeply") from None


def parse_request(msg: dict[str, Any]) -> _Request:
    """Validate a request frame (a dict with a string ``type``, as :func:`.protocol.recv` returns it).

    A hello of another protocol version is refused by its version before its other fields are looked at (they may
    differ between versions). Raises :class:`MessageError` naming the type and each failing field."""
    kind = msg.get("type")
    model = REQUESTS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise MessageError(f"unknown message type {str(kind)[:40]!r}; expected one of {', '.join(REQUESTS)}")
    version = msg.get("version")
    if model is Hello and type(version) is int:
        check_version(version, "engine", "daemon")
    return _validate(model, msg, kind)


def check_version(theirs: int, peer: str, me: str) -> None:
    """Raise :class:`MessageError` naming both versions when the ``peer`` speaks protocol version ``theirs`` and
    this side (``me``) another one: ``protocol version mismatch: the engine speaks version 1, this daemon version
    2; run the same vllm-fastload version on both sides``."""
    if theirs != PROTOCOL_VERSION:
        raise MessageError(f"protocol version mismatch: the {peer} speaks version {theirs}, this {me} version "
                           f"{PROTOCOL_VERSION}; run the same vllm-fastload version on both sides")


def to_frame(message: Any) -> dict[str, Any]:
    """The JSON object of a message model as :func:`.protocol.send` frames it: its ``type`` and the fields it was
    given (an optional field left at its default, such as an error's ``mismatched``, is not sent)."""
    return {"type": message.type, **message.model_dump(exclude_unset=True)}


def parse_reply(msg: dict[str, Any]) -> _Reply:
    """Validate a reply frame from the daemon; returns its model (:data:`REPLIES`). Raises :class:`MessageError`
    naming the type and each failing field (an unknown type included)."""
    kind = msg.get("type")
    model = REPLIES.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise MessageError(f"unknown reply type {str(kind)[:40]!r}; expected one of {', '.join(REPLIES)}")
    return _validate(model, msg, kind)
