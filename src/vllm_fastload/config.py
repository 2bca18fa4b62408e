"""Validated ``--model-loader-extra-config`` of each load format (pydantic models).

Every model is strict: unknown keys, wrong types (``"16"`` for an int, ``true`` for a size) and out-of-range
values raise :class:`~vllm_fastload.errors.ConfigError` naming the key, the value and the allowed form.
Each key is declared once, with :func:`key`: its default, allowed form, description and bounds feed both the
error messages and docs/configuration.md (:mod:`vllm_fastload.docgen`).
Validation has no side effects: :mod:`vllm_fastload.streaming.runai_env` turns a validated config into
runai-model-streamer's environment variables, which the loader applies for the load only.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ByteSize, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from .errors import ConfigError
from .log import logger

_BYTESIZE = TypeAdapter(ByteSize)

#: Longest timeout any setting takes (seconds, one day), the extra-config keys' and the daemon's flags': a socket
#: timeout becomes a time_t deadline, which a value like 1e10 or inf overflows, and a day is longer than any load.
MAX_TIMEOUT_S = 86400.0


#: Largest byte count a size key takes: far above any host's memory, and far below what overflows the 64-bit
#: sizes runai-model-streamer and the CUDA allocator take (a larger value reached them as an opaque error).
MAX_BYTES = 2**40


def parse_bytes(value: Union[int, str], *, minimum: int, maximum: int = MAX_BYTES) -> int:
    """Parse a byte count: an int, or a string such as ``"16GiB"``, ``"512MB"``, ``"1048576"``.

    Units follow pydantic's ``ByteSize`` (KB = 1000, KiB = 1024, ...). Returns bytes (int).
    Raises ``ValueError`` for bools, floats, unparsable strings or values outside ``[minimum, maximum]``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected an integer number of bytes or a string like '16GiB', got {type(value).__name__}")
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"-?[0-9]+", text):
            value = int(text)
        else:
            try:
                value = int(_BYTESIZE.validate_python(text))
            except ValidationError:
                raise ValueError(f"cannot parse {value!r} as a size; use bytes or a string like '16GiB'") from None
            if not _whole_bytes(text):  # ByteSize truncates: "1.5B" would be 1 byte
                raise ValueError(f"{text!r} is not a whole number of bytes; use a unit that makes it one, e.g. "
                                 f"'1536KiB' for '1.5MiB'")
    if value < minimum:
        raise ValueError(f"must be >= {minimum}")
    if value > maximum:
        raise ValueError(f"must be at most {maximum} bytes ({maximum // 2**40} TiB)")
    return value


def _whole_bytes(text: str) -> bool:
    """Whether the size string ``text`` (one pydantic ``ByteSize`` parsed) names a whole number of bytes, from its
    number and unit as ``ByteSize`` reads them (``ByteSize.byte_string_re``, ``ByteSize.byte_sizes``)."""
    from fractions import Fraction

    m = ByteSize.byte_string_re.match(text)
    if m is None:
        return True
    unit = ByteSize.byte_sizes.get((m.group(2) or "b").lower(), 1)
    return (Fraction(m.group(1)) * unit).denominator == 1  # exact at any size, unlike a float or a Decimal


def as_seconds(value: Any) -> float:
    """A number of seconds (int or float, not bool) as float; ``ValueError`` otherwise (range: the field's)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("expected a number of seconds")
    if value != value:  # NaN (vLLM's json.loads takes it): every range check would fail with a misleading bound
        raise ValueError("NaN is not a number of seconds")
    try:
        return float(value)
    except OverflowError:  # a JSON integer past float's range; pydantic turns only ValueError into the field's error
        raise ValueError("too large a number of seconds") from None


def key(default: Any, *, allowed: str, description: str, **bounds: Any) -> Any:
    """Declare one extra-config key, once: its ``default``, the ``allowed`` form (quoted by :class:`ConfigError`
    messages and docs/configuration.md), its ``description`` (docs, ``help()``) and pydantic's ``bounds``
    (``gt``, ``le``, ...)."""
    return Field(default, description=description, json_schema_extra={"allowed": allowed}, **bounds)


class _LoaderConfig(BaseModel):
    """Fields shared by every load format of this plugin."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    LOAD_FORMAT: ClassVar[str] = ""

    fallback: bool = key(
        True,
        allowed="true or false (JSON bool)",
        description="When the fast path cannot serve the load: true = log a WARNING and load with vLLM's default "
        "loader; false = fail at startup with the reason.",
    )
    report_path: Optional[str] = key(
        None,
        allowed="a file path (string) where a JSON load report is written",
        description="Write the load report as JSON to this path (overwritten atomically on each load).",
    )
    expected_content_digest: Optional[str] = key(
        None,
        allowed="'blake3:' and 64 lowercase hex digits, as `vllm-fastload inspect --content-digest` prints",
        description="Pin the weights' content: hash every tensor's bytes (BLAKE3, docs/design.md, content digest) "
        "and refuse weights whose digest differs. runai_streamer: the load fails after the last tensor (no fallback: "
        "any loader reads the same files). ipc_cache: a daemon's weights are mapped only when the daemon hashed them "
        "(\"content_hash\": true) to this digest, else the fallback policy applies and the disk load is checked the "
        "same way.",
    )
    freeze_gc: bool = key(
        True,
        allowed="true or false (JSON bool)",
        description="GPU: freeze Python's garbage-collector heap (gc.freeze()) when the load starts, once per "
        "process, as vLLM does when the engine start ends, so the full collections vLLM's memory profiler runs after "
        "the load walk only the objects made since. Like vLLM's own freeze, frozen objects that later become garbage "
        "wait for the engine's shutdown: a process that outlives a failed LLM() start keeps its weights; set false "
        "there (docs/design.md, garbage collector).",
    )

    @field_validator("report_path")
    @classmethod
    def _report_path(cls, v: Any) -> Any:
        from .report import report_path_problem

        if v == "":
            raise ValueError("an empty string names no file; omit report_path for no report")
        problem = None if v is None else report_path_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("expected_content_digest", mode="before")
    @classmethod
    def _digest(cls, v: Any) -> Any:
        from .content import valid_digest

        return None if v is None else valid_digest(v)

    def __init__(self, /, **data: Any):
        """Validate ``data`` (keys and values as in ``--model-loader-extra-config``). Raises :class:`ConfigError`
        naming the key, the value and the allowed form (also when the model is built directly in Python)."""
        allowed = sorted(type(self).model_fields)
        for key in data:
            if key not in type(self).model_fields:
                hint = difflib.get_close_matches(str(key), allowed, n=1)
                did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
                raise ConfigError(
                    f"--model-loader-extra-config: unknown key {key!r} for load format {self.LOAD_FORMAT!r}"
                    f"{did_you_mean} Allowed keys: {', '.join(allowed)}."
                )
        try:
            super().__init__(**data)
        except ValidationError as e:
            err = e.errors()[0]
            key = str(err["loc"][0]) if err["loc"] else "?"
            value = data.get(key, err.get("input"))
            fields = type(self).model_fields
            form = type(self).allowed_form(key) if key in fields else ""
            reason = err["msg"].removeprefix("Value error, ")
            raise ConfigError(
                f"--model-loader-extra-config: invalid value for key {key!r} of load format {self.LOAD_FORMAT!r}: "
                f"{value!r} ({type(value).__name__}): {reason}. Allowed: {form}."
            ) from None

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        """Append every field with its default and description to the class docstring, so ``help()`` shows them."""
        super().__pydantic_init_subclass__(**kwargs)
        lines = [f"    {name} (default {f.default!r}): {f.description or ''}" for name, f in cls.model_fields.items()]
        cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\n    Keys:\n\n" + "\n".join(lines) + "\n"

    @classmethod
    def allowed_form(cls, name: str) -> str:
        """The allowed form of key ``name`` as its :func:`key` declaration says (``""`` for an undeclared form)."""
        extra = cls.model_fields[name].json_schema_extra
        return extra.get("allowed", "") if isinstance(extra, dict) else ""

    @classmethod
    def from_extra(cls, extra: Optional[dict[str, Any]]) -> _LoaderConfig:
        """Validate ``load_config.model_loader_extra_config`` (a dict, or None = all defaults).

        Raises :class:`ConfigError` naming the key, the value and the allowed form.
        """
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ConfigError(
                f"--model-loader-extra-config for load format {cls.LOAD_FORMAT!r} must be a JSON object, "
                f"got {type(extra).__name__}: {extra!r}"
            )
        return cls(**extra)


#: How an ``ipc_cache`` engine uses the daemon's memory (``mode``; also the wire's ``attach`` mode).
Mode = Literal["zero_copy", "copy"]
#: How runai reads local files (``fs_strategy``).
FsStrategy = Literal["auto", "runai", "pread_buffered", "uring_buffered", "io_uring_direct", "io_uring_buffered",
                     "libaio_direct", "sync_buffered"]


class StreamerConfig(_LoaderConfig):
    """Extra-config of the ``runai_streamer`` load format.

    Sizes are bytes (int) after validation; strings such as ``"16GiB"`` are accepted on input.
    """

    LOAD_FORMAT: ClassVar[str] = "runai_streamer"

    concurrency: Optional[int] = key(
        None, gt=0, le=4096,
        allowed="an integer from 1 to 4096 (JSON number, not a string), e.g. 16",
        description="Reader threads: of the runai-model-streamer pool (RUNAI_STREAMER_CONCURRENCY) or of the "
        "pread_buffered reader; reads in flight of the uring_buffered reader.",
    )
    memory_limit: Optional[Union[int, str]] = key(
        None,
        allowed="bytes as an integer from -1 to 2**40 (-1 = unlimited, 0 = the largest tensor) or a string like "
        "'16GiB'",
        description="Host staging memory of the streamer in bytes; -1 unlimited, 0 = the largest tensor "
        "(RUNAI_STREAMER_MEMORY_LIMIT). On a GPU with pinned_reader (the default) the staging memory is the pinned "
        "slots instead ((pinned_slots + 2) x pinned_slot_bytes, rounded up to a power of two) and this key is not "
        "used.",
    )
    chunk_bytesize: Optional[Union[int, str]] = key(
        None,
        allowed="bytes as an integer from 1 to 2**40 or a string like '8MiB'",
        description="Bytes per read request of one reader thread (RUNAI_STREAMER_CHUNK_BYTESIZE).",
    )
    distributed: Union[bool, Literal["auto"]] = key(
        "auto",
        allowed="\"auto\" (the default), true or false (JSON bool)",
        description="TP > 1: the ranks of a TP group on one host split the checkpoint's bytes, each reads its share "
        "and broadcasts it to the others (NCCL on GPUs), so a host reads every byte once. auto: on a GPU when the "
        "host's ranks have peer access (P2P) and the pinned direct read path is used; true: also on CPU and without "
        "P2P; false: every rank reads the whole checkpoint.",
    )
    distributed_timeout_s: float = key(
        300.0, ge=0.1, le=MAX_TIMEOUT_S,
        allowed="seconds (a number from 0.1 to 86400) a rank of a fan-out waits for the others",
        description="Fan-out: seconds a rank waits for the others' next tensor before it fails the load (a rank that "
        "stopped answering).",
    )
    fs_strategy: FsStrategy = key(
        "auto",
        allowed="one of auto, runai, pread_buffered, uring_buffered, io_uring_direct, io_uring_buffered, "
        "libaio_direct, sync_buffered",
        description="How local files are read. auto: when >= 90% of the shards are in the page cache (a restart), "
        "uring_buffered on the direct GPU path (pread_buffered where io_uring is not available), else runai's "
        "sync_buffered with one reader per CPU (up to 32), split "
        "among this host's ranks, unless concurrency is set; otherwise runai's O_DIRECT default. pread_buffered: this "
        "package's reader (os.preadv threads, 3/4 of the CPUs split among this host's ranks unless concurrency is "
        "set, into pinned_slots slots of pinned_slot_bytes; local files, direct GPU path only). uring_buffered: this "
        "package's io_uring reader (the loading thread keeps concurrency reads in flight, default pinned_slots, and "
        "the kernel's workers copy; where the loading thread may use >= 8 CPUs it is pinned to the CPU it runs on and "
        "the workers are kept off that CPU while it reads, FASTLOAD_URING_IOWQ_AFF=0 turns that off; "
        "needs the liburing package and a kernel and seccomp profile allowing io_uring, else pread_buffered, said at "
        "INFO). runai: always runai's default. The other values are runai's strategies (RUNAI_STREAMER_FS_STRATEGY).",
    )
    pinned_slot_bytes: Union[int, str] = key(
        8 * 2**20,
        allowed="bytes as an integer from 4096 to 2**40 or a string like '64MiB'",
        description="GPU only: bytes per pinned host slot (tensors larger are read and copied in pieces of this "
        "size).",
    )
    pinned_reader: bool = key(
        True,
        allowed="true or false (JSON bool)",
        description="GPU only: tensor pieces are read (by our reader or runai's, see fs_strategy) straight into "
        "pinned slots and the GPU copies them out (no host memcpy); false: runai reads into pageable memory and each "
        "tensor is copied through a pinned ring.",
    )
    pipeline_thread: bool = key(
        False,
        allowed="true or false (JSON bool)",
        description="GPU only, experimental: read, memcpy and copy issue in a producer thread, overlapped with "
        "weight_loader calls; off by default because its memcpy competes with the reader threads for the CPUs.",
    )
    issue_thread: bool = key(
        False,
        allowed="true or false (JSON bool)",
        description="GPU only, direct read path, experimental: the H2D copies of the pieces are issued by a thread "
        "of the load, overlapped with vLLM's weight_loader calls; off by default because it measured slower (it "
        "shares the GIL with the readers and the loading thread); false: issued by vLLM's loading thread.",
    )
    prefetch: bool = key(
        False,
        allowed="true or false (JSON bool)",
        description="Experimental: start reading (and on a GPU copying) the weights on a thread of the load before "
        "vLLM builds the model, so reads overlap model construction; load_weights then takes what was read. Only "
        "where one rank loads the whole model (TP x PP = 1), without sleep mode and content hashing. It holds at "
        "most what is left of gpu_memory_utilization's share after the weights and 2 GiB (on CPU a quarter of what "
        "is left of the available host memory, or of the container's limit, after the weights), and lowers the "
        "interpreter's thread switch interval while it runs. Off by default: the stream's Python work takes the "
        "GIL from model construction, which slows by about what the weights phase saves (docs/benchmarks.md).",
    )
    pinned_slots: int = key(
        16, ge=2, le=64,
        allowed="an integer from 2 to 64",
        description="GPU only: pinned slots (the read ring's depth, >= 2).",
    )
    copy_threads: int = key(
        8, gt=0, le=128,
        allowed="an integer from 1 to 128",
        description="GPU only: threads copying host slots into pinned memory.",
    )
    content_hash: bool = key(
        False,
        allowed="true or false (JSON bool)",
        description="Hash every tensor's bytes while loading (BLAKE3) and report the checkpoint's content digest "
        "(load report, log line); the preload daemon publishes it to engines that pin expected_content_digest. On a "
        "GPU every byte is also copied back to the host to be hashed.",
    )

    @property
    def hashes_content(self) -> bool:
        """Whether a load hashes tensor bytes (``content_hash`` or a pinned ``expected_content_digest``)."""
        return self.content_hash or self.expected_content_digest is not None

    @field_validator("distributed_timeout_s", mode="before")
    @classmethod
    def _timeout(cls, v: Any) -> Any:
        return as_seconds(v)

    @field_validator("memory_limit", mode="before")
    @classmethod
    def _memory_limit(cls, v: Any) -> Any:
        return None if v is None else parse_bytes(v, minimum=-1)

    @field_validator("pinned_slot_bytes", mode="before")
    @classmethod
    def _slot(cls, v: Any) -> Any:
        return parse_bytes(v, minimum=4096)

    @field_validator("chunk_bytesize", mode="before")
    @classmethod
    def _chunk(cls, v: Any) -> Any:
        return None if v is None else parse_bytes(v, minimum=1)

    def warn_if_above_cgroup(self, cgroup_root: Path = Path("/sys/fs/cgroup")) -> Optional[str]:
        """Log (and return) a WARNING when ``memory_limit`` exceeds the container's cgroup memory limit.

        Reads cgroup v2 ``memory.max`` or v1 ``memory/memory.limit_in_bytes`` under ``cgroup_root``.
        Returns the warning text, or None when within the limit, unlimited or unknown.
        """
        limit = cgroup_memory_max(cgroup_root)
        mem = self.memory_limit
        if limit is None or mem is None:
            return None
        if mem <= limit:
            return None
        msg = (
            f"runai_streamer memory_limit {mem} bytes ({mem / 2**30:.2f} GiB) is above the container's cgroup "
            f"memory limit {limit} bytes ({limit / 2**30:.2f} GiB): the streamer may be OOM-killed. "
            f"Set memory_limit below it, e.g. \"{max(limit // 2 // 2**20, 1)}MiB\"."
        )
        logger.warning(msg)
        return msg


def cgroup_memory_max(cgroup_root: Path = Path("/sys/fs/cgroup")) -> Optional[int]:
    """The container's memory limit in bytes from cgroup v2 ``memory.max`` (or v1), None if unlimited/unknown."""
    return _cgroup_bytes(cgroup_root, ("memory.max", "memory/memory.limit_in_bytes"))


def cgroup_memory_current(cgroup_root: Path = Path("/sys/fs/cgroup")) -> Optional[int]:
    """The container's memory use in bytes from cgroup v2 ``memory.current`` (or v1 ``memory.usage_in_bytes``),
    None if unknown."""
    return _cgroup_bytes(cgroup_root, ("memory.current", "memory/memory.usage_in_bytes"))


def _cgroup_bytes(cgroup_root: Path, names: tuple[str, ...]) -> Optional[int]:
    """The first of ``names`` under ``cgroup_root`` that holds a number of bytes; None for ``max``, cgroup v1's
    "unlimited" (a number near 2**63) or none readable."""
    for rel in names:
        p = Path(cgroup_root) / rel
        try:
            text = p.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            continue
        return None if value >= 2**62 else value
    return None


class IpcCacheConfig(_LoaderConfig):
    """Extra-config of the ``ipc_cache`` load format (times in seconds)."""

    LOAD_FORMAT: ClassVar[str] = "ipc_cache"

    mode: Mode = key(
        "zero_copy",
        allowed="'zero_copy' (map the daemon's memory) or 'copy' (clone it, then the daemon frees its copy)",
        description="zero_copy: map the daemon's memory (one copy in memory); copy: clone into engine memory, then "
        "the daemon frees its copy and stays empty.",
    )
    socket_dir: Optional[str] = key(
        None,
        allowed="a directory path (string) holding the daemons' sockets",
        description="Directory of the daemons' sockets (default: the daemon's default).",
    )
    socket_path: Optional[str] = key(
        None,
        allowed="the path (string) of one daemon's socket, overriding socket_dir",
        description="One daemon's socket path; overrides socket_dir.",
    )
    connect_timeout_s: float = key(
        5.0, gt=0, le=MAX_TIMEOUT_S,
        allowed="seconds (a number > 0, at most 86400) to wait for the daemon's socket to accept",
        description="Seconds to wait for the daemon's socket to accept.",
    )
    state_timeout_s: float = key(
        300.0, gt=0, le=MAX_TIMEOUT_S,
        allowed="seconds (a number > 0, at most 86400) to wait for the daemon's manifest",
        description="Seconds to wait for the daemon's manifest.",
    )
    is_draft: bool = key(
        False,
        allowed="true or false (set by vLLM for speculative-decoding drafts)",
        description="Set by vLLM for a speculative-decoding draft model.",
    )

    @field_validator("socket_dir", "socket_path")
    @classmethod
    def _not_empty(cls, v: Any) -> Any:
        if v == "":  # it would silently mean "the default", which is not what was written
            raise ValueError("an empty string names no path; omit the key for the default")
        if isinstance(v, str) and "\x00" in v:  # no path holds one: os.open would raise past the fallback
            raise ValueError("the path contains a NUL byte")
        return v

    @field_validator("connect_timeout_s", "state_timeout_s", mode="before")
    @classmethod
    def _seconds(cls, v: Any) -> Any:
        return as_seconds(v)
