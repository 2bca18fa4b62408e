"""Where checkpoint bytes come from: local paths and object storage (``s3://``, ``gs://``, ``az://``).

Object storage goes through the runai-model-streamer package (its S3/GCS/Azure backends are separate PyPI
packages: ``runai-model-streamer-s3`` etc.). This module lists shards, reads byte ranges (used for
safetensors headers) and turns the backends' terse failures ("File access error") into a
:class:`~vllm_fastload.errors.StorageError` that names the URI, the cause (HTTP status where one can be
learned) and the environment variables that set endpoint and credentials.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
from collections.abc import Iterator
from typing import Optional

from .errors import StorageError

SCHEMES = ("s3://", "gs://", "az://")
#: scheme -> (backend module of runai-model-streamer, pip extra / package that provides it)
BACKENDS = {
    "s3://": ("runai_model_streamer_s3", "vllm-fastload[s3] (runai-model-streamer-s3, boto3)"),
    "gs://": ("runai_model_streamer_gcs", "runai-model-streamer-gcs"),
    "az://": ("runai_model_streamer_azure", "runai-model-streamer-azure"),
}
#: Environment variables that decide where and as whom object storage is read (named in errors).
S3_ENV = (
    "AWS_ENDPOINT_URL",
    "RUNAI_STREAMER_S3_ENDPOINT",
    "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_PROFILE",
    "AWS_DEFAULT_REGION",
    "AWS_EC2_METADATA_DISABLED",
)


def is_object_uri(path: str) -> bool:
    """True for ``s3://``, ``gs://`` and ``az://`` URIs (case-insensitive scheme)."""
    return str(path).lower().startswith(SCHEMES)


def scheme_of(path: str) -> str:
    """``"s3://"``, ``"gs://"``, ``"az://"`` or ``""`` for local paths."""
    low = str(path).lower()
    return next((s for s in SCHEMES if low.startswith(s)), "")


def missing_backend(path: str) -> Optional[str]:
    """For an object URI whose runai backend package is not installed: a reason naming what to install.

    Returns None for local paths and when the backend is importable.
    """
    scheme = scheme_of(path)
    if not scheme:
        return None
    module, install = BACKENDS[scheme]
    if importlib.util.find_spec(module) is None:
        return f"the {scheme} backend of runai-model-streamer ({module}) is not installed; install {install}"
    return None


@contextlib.contextmanager
def scoped_environ(updates: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block, then restore the previous values."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def endpoint_env() -> dict[str, str]:
    """The env update that makes the streamer read from the endpoint boto3 lists from.

    boto3 (listing, config pull) honours ``AWS_ENDPOINT_URL``; the streamer's C++ S3 client reads
    ``RUNAI_STREAMER_S3_ENDPOINT``. When only the former is set, copy it (vLLM's built-in loader does the same).
    """
    if os.environ.get("AWS_ENDPOINT_URL") and not os.environ.get("RUNAI_STREAMER_S3_ENDPOINT"):
        return {"RUNAI_STREAMER_S3_ENDPOINT": os.environ["AWS_ENDPOINT_URL"]}
    return {}


def env_summary() -> str:
    """The S3-related environment as ``NAME=value`` pairs (secrets shown as ``<set>``), for error messages."""
    parts = []
    for name in S3_ENV:
        v = os.environ.get(name)
        if v is None:
            parts.append(f"{name} unset")
        elif "SECRET" in name or "KEY_ID" in name:
            parts.append(f"{name}=<set>")
        else:
            parts.append(f"{name}={v}")
    return ", ".join(parts)


def _s3_probe(uri: str, timeout_s: float = 3.0) -> str:
    """Ask S3 directly (boto3, short timeouts, no retries) why ``uri`` cannot be read. Returns a cause text."""
    try:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return "boto3 is not installed, no further diagnosis"
    bucket, _, key = uri[len("s3://"):].partition("/")
    kwargs = {"connect_timeout": timeout_s, "read_timeout": timeout_s, "retries": {"max_attempts": 1}}
    if os.environ.get("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "1") == "0":
        kwargs["s3"] = {"addressing_style": "path"}
    endpoint = os.environ.get("RUNAI_STREAMER_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL")
    try:
        client = boto3.client("s3", endpoint_url=endpoint, config=Config(**kwargs))
        prefix = key.rstrip("/") + "/" if key else ""
        listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1000)
        if listed.get("KeyCount", 0):
            return (f"bucket and prefix are readable now ({listed['KeyCount']} object(s) under it); the failure was "
                    f"transient (timeout, throttling) or inside the streamer")
        if key:
            client.head_object(Bucket=bucket, Key=key)
        return "the object is readable now; the failure was transient or inside the streamer"
    except ClientError as e:
        meta = e.response.get("ResponseMetadata", {})
        code = e.response.get("Error", {}).get("Code", "?")
        status = meta.get("HTTPStatusCode", "?")
        hint = {
            "404": "no such bucket or key",
            "NoSuchBucket": "no such bucket",
            "NoSuchKey": "no such key",
            "403": "access denied: check credentials and bucket policy",
            "AccessDenied": "access denied: check credentials and bucket policy",
            "InvalidAccessKeyId": "unknown access key",
            "SignatureDoesNotMatch": "wrong secret key",
        }.get(str(code), "")
        label = f"HTTP {status}" if str(code) == str(status) else f"HTTP {status} {code}"
        return label + (f" ({hint})" if hint else "")
    except BotoCoreError as e:
        return f"{type(e).__name__}: {e}"


def storage_error(uri: str, exc: BaseException, action: str = "read") -> StorageError:
    """Build the one error for a failed object-storage operation on ``uri`` (the original as context)."""
    cause = _s3_probe(uri) if scheme_of(uri) == "s3://" else f"{type(exc).__name__}: {exc}"
    return StorageError(
        f"cannot {action} {uri}: {cause}. Streamer said: {type(exc).__name__}: {exc}. "
        f"Endpoint and credentials come from: {env_summary()}. For S3-compatible stores set AWS_ENDPOINT_URL "
        f"and, for path-style addressing, RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0; set "
        f"AWS_EC2_METADATA_DISABLED=true outside EC2 so a missing credential does not wait on the metadata service."
    )


def page_cache_fraction(paths: list[str], max_pages_per_file: int = 1 << 16) -> Optional[float]:
    """Fraction (0..1) of the pages of local ``paths`` resident in the page cache, from ``mincore(2)``.

    Samples up to ``max_pages_per_file`` evenly spaced pages per file. Returns None for object storage, empty
    input, or where ``mmap``/``mincore`` are unavailable (non-Linux). Reads no file data.
    """
    import ctypes
    import mmap

    if not paths or any(is_object_uri(p) for p in paths):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        c_mmap, c_munmap, c_mincore = libc.mmap, libc.munmap, libc.mincore
    except (OSError, AttributeError):
        return None
    c_mmap.restype = ctypes.c_void_p
    c_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    c_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    c_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    resident = total = 0
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = c_mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                npages = (size + page - 1) // page
                vec = ctypes.create_string_buffer(npages)
                if c_mincore(addr, size, vec) != 0:
                    return None
            finally:
                c_munmap(addr, size)
        finally:
            os.close(fd)
        sample = vec.raw[:: max(1, npages // max_pages_per_file)]
        resident += sum(b & 1 for b in sample)
        total += len(sample)
    return resident / total if total else None


def list_safetensors(source: str) -> list[str]:
    """All ``*.safetensors`` files directly under ``source`` (a directory or object-storage prefix), sorted.

    Raises :class:`StorageError` when object storage cannot be listed.
    """
    if not is_object_uri(source):
        return sorted(glob.glob(os.path.join(source, "*.safetensors")))
    from runai_model_streamer import list_safetensors as runai_list

    try:
        return sorted(runai_list(source))
    except Exception as e:  # noqa: BLE001 - every backend failure becomes one StorageError
        raise storage_error(source, e, "list") from e


def read_range(path: str, offset: int, size: int) -> bytes:
    """Read ``size`` bytes at ``offset`` of a local file or object (through runai's FileStreamer).

    Returns exactly ``size`` bytes, fewer only when a local file is shorter.
    Raises ``OSError`` (local) or :class:`StorageError` (object storage).
    """
    if size == 0:
        return b""
    if not is_object_uri(path):
        with open(path, "rb") as f:
            return os.pread(f.fileno(), size, offset)
    from runai_model_streamer import FileChunks, FileStreamer

    try:
        with scoped_environ(endpoint_env()), FileStreamer() as fs:
            fs.stream_files([FileChunks(0, path, [offset], [size])])
            chunks = [bytes(buf.numpy().tobytes()) for _, _, buf in fs.get_chunks()]
        return b"".join(chunks)
    except Exception as e:  # noqa: BLE001
        raise storage_error(path, e) from e
