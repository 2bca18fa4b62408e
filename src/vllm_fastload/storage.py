"""Where checkpoint bytes come from: local paths and object storage (``s3://``, ``gs://``, ``az://``).

Object storage goes through the runai-model-streamer package (its S3/GCS/Azure backends are separate PyPI
packages: ``runai-model-streamer-s3`` etc.). This module lists shards, reads byte ranges (used for
safetensors headers) and turns the backends' terse failures ("File access error") into a
:class:`~vllm_fastload.errors.StorageError` that names the URI, the cause (HTTP status where one can be
learned) and the environment variables that set endpoint and credentials.

S3 specifics (runai-model-streamer 0.17 and its boto3 / AWS SDK for C++):

* Listing goes through our own boto3 client with bounded timeouts (:data:`LIST_TIMEOUTS`); runai's own listing uses
  boto3's defaults (60 s read timeout, retries), which wait minutes on an endpoint that accepts connections but
  never answers.
* Anonymous reads (public buckets) need ``RUNAI_STREAMER_S3_UNSIGNED=1``: without it boto3 refuses to list without
  credentials (``NoCredentialsError``), even when the bucket is public. With it, no credentials are ever used, so
  the scoped environment also sets ``AWS_EC2_METADATA_DISABLED=true`` (when unset): the streamer's C++ AWS SDK
  otherwise waits on the EC2 instance metadata service (IMDS) at every stream when it is not reachable.
* boto3's IMDS wait is pinned to 1 s and 1 attempt (``AWS_METADATA_SERVICE_TIMEOUT`` /
  ``AWS_METADATA_SERVICE_NUM_ATTEMPTS``, when unset), so that a load without credentials fails fast outside EC2.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

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
    "RUNAI_STREAMER_S3_UNSIGNED",
)
#: runai's switch for anonymous (unsigned) S3 requests: public buckets without credentials.
UNSIGNED_ENV = "RUNAI_STREAMER_S3_UNSIGNED"
#: boto3's wait on the EC2 instance metadata service for credentials, pinned when the user did not set it.
METADATA_BOUNDS = {"AWS_METADATA_SERVICE_TIMEOUT": "1", "AWS_METADATA_SERVICE_NUM_ATTEMPTS": "1"}
#: Our S3 listing: connect/read timeouts (s) and attempts, so that an endpoint that never answers fails after about
#: attempts x read_timeout, one that refuses connections at once.
LIST_TIMEOUTS = {"connect_timeout": 5, "read_timeout": 10, "attempts": 2}


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
    """Set environment variables for the duration of the block, then restore the previous values. A variable that
    already has its value is not touched (nor put back): a block on another thread whose variables the calling
    thread set first (``prefetch``) changes no environment while that thread runs (glibc's ``setenv`` is not safe
    beside another thread's ``getenv``)."""
    saved = {k: os.environ.get(k) for k, v in updates.items() if os.environ.get(k) != v}
    os.environ.update({k: updates[k] for k in saved})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def endpoint_env() -> dict[str, str]:
    """The env update for one object-storage operation (listing, header reads, the stream), to apply with
    :func:`scoped_environ`.

    * boto3 (listing, config pull) honours ``AWS_ENDPOINT_URL``; the streamer's C++ S3 client reads
      ``RUNAI_STREAMER_S3_ENDPOINT``. When only the former is set, copy it (vLLM's built-in loader does the same).
    * ``AWS_METADATA_SERVICE_TIMEOUT=1`` / ``AWS_METADATA_SERVICE_NUM_ATTEMPTS=1`` when unset (boto3's wait on the
      instance metadata service).
    * With ``RUNAI_STREAMER_S3_UNSIGNED=1`` (anonymous reads, no credentials used): ``AWS_EC2_METADATA_DISABLED=true``
      when unset, so the C++ SDK does not wait on the metadata service for credentials it will not use.

    Raises :class:`StorageError` when ``AWS_ENDPOINT_URL`` and ``RUNAI_STREAMER_S3_ENDPOINT`` name different
    endpoints (listing and reading must use one store).
    """
    listing, reading = os.environ.get("AWS_ENDPOINT_URL"), os.environ.get("RUNAI_STREAMER_S3_ENDPOINT")
    if listing and reading and listing.rstrip("/") != reading.rstrip("/"):
        raise StorageError(
            f"AWS_ENDPOINT_URL={listing} (boto3: listing, config) and RUNAI_STREAMER_S3_ENDPOINT={reading} (the "
            f"streamer: reading) name different endpoints, so shards would be listed from one store and read from "
            f"another; set only AWS_ENDPOINT_URL (vllm-fastload passes it to the streamer) or both to the same URL")
    env = {k: v for k, v in METADATA_BOUNDS.items() if k not in os.environ}
    if os.environ.get("AWS_ENDPOINT_URL") and not os.environ.get("RUNAI_STREAMER_S3_ENDPOINT"):
        env["RUNAI_STREAMER_S3_ENDPOINT"] = os.environ["AWS_ENDPOINT_URL"]
    if os.environ.get(UNSIGNED_ENV) == "1" and "AWS_EC2_METADATA_DISABLED" not in os.environ:
        env["AWS_EC2_METADATA_DISABLED"] = "true"
    return env


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


def _s3_client(connect_timeout: float, read_timeout: float, attempts: int, unsigned: bool,
               endpoint: Optional[str] = None) -> Any:
    """A boto3 S3 client with bounded timeouts, the streamer's addressing style and ``endpoint`` (default: the one
    boto3 lists from, ``AWS_ENDPOINT_URL``, else ``RUNAI_STREAMER_S3_ENDPOINT``)."""
    import boto3.session
    from botocore import UNSIGNED
    from botocore.config import Config

    kwargs: dict[str, Any] = {"connect_timeout": connect_timeout, "read_timeout": read_timeout,
                              "retries": {"total_max_attempts": attempts, "mode": "standard"}}
    if os.environ.get("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "1") == "0":
        kwargs["s3"] = {"addressing_style": "path"}
    if unsigned:
        kwargs["signature_version"] = UNSIGNED
    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("RUNAI_STREAMER_S3_ENDPOINT")
    # A new session each time: boto3's default session caches the credentials it found first.
    return boto3.session.Session().client("s3", endpoint_url=endpoint, config=Config(**kwargs))


def _s3_parts(uri: str) -> tuple[str, str, str]:
    """``s3://bucket/key`` -> ``(bucket, key, directory prefix of key)`` (the prefix ends with ``/`` or is empty)."""
    bucket, _, key = uri[len("s3://"):].partition("/")
    return bucket, key, key.strip("/") + "/" if key.strip("/") else ""


def _s3_list(source: str) -> list[str]:
    """``s3://bucket/prefix/*.safetensors`` directly under ``source`` (as runai's listing: not recursive), with the
    bounded timeouts of :data:`LIST_TIMEOUTS`. Raises boto3's exceptions."""
    bucket, _, prefix = _s3_parts(source)
    client = _s3_client(LIST_TIMEOUTS["connect_timeout"], LIST_TIMEOUTS["read_timeout"], LIST_TIMEOUTS["attempts"],
                        unsigned=os.environ.get(UNSIGNED_ENV) == "1")
    out = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
        for obj in page.get("Contents", []):
            if fnmatch.fnmatch(obj["Key"], "*.safetensors") and not obj["Key"].endswith("/"):
                out.append(f"s3://{bucket}/{obj['Key']}")
    return out


#: error code -> what it means and what to set
_S3_HINTS = {
    "404": "no such bucket or key",
    "NoSuchBucket": "no such bucket",
    "NoSuchKey": "no such key",
    "403": "access denied: check credentials and bucket policy",
    "AccessDenied": "access denied: check credentials and bucket policy",
    "InvalidAccessKeyId": "unknown access key: check AWS_ACCESS_KEY_ID",
    "SignatureDoesNotMatch": "wrong secret key: check AWS_SECRET_ACCESS_KEY",
}
NO_CREDENTIALS = ("no AWS credentials found (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
                  "~/.aws/credentials, instance metadata)")


def _s3_probe(uri: str, exc: Optional[BaseException] = None, timeout_s: float = 3.0) -> str:
    """Ask S3 directly (boto3, short timeouts, no retries) why ``uri`` cannot be read. Returns a cause text.

    Lists the prefix and reads the first byte of its first object (or of the key ``uri`` names). Without credentials
    (or with ``RUNAI_STREAMER_S3_UNSIGNED=1``) the probe is anonymous and says whether the bucket is public.
    """
    try:
        import boto3
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
    except ImportError:
        return "boto3 is not installed, no further diagnosis"
    bucket, key, prefix = _s3_parts(uri)
    unsigned = os.environ.get(UNSIGNED_ENV) == "1"
    ok: Optional[str] = None
    empty = ""  # what is missing, when the listing answered with nothing under the prefix
    failure = ""
    with scoped_environ(endpoint_env()):
        anonymous = unsigned or isinstance(exc, NoCredentialsError)
        if not anonymous:
            try:
                anonymous = boto3.Session().get_credentials() is None
            except BotoCoreError as e:
                return f"credentials could not be resolved ({type(e).__name__}: {e})"
        try:
            # the endpoint the streamer read from (the listing's when only AWS_ENDPOINT_URL is set)
            client = _s3_client(timeout_s, timeout_s, 1, unsigned=anonymous,
                                endpoint=os.environ.get("RUNAI_STREAMER_S3_ENDPOINT"))
            listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1000)
            keys = [o["Key"] for o in listed.get("Contents", [])]
            # a 1-byte ranged GET, as the streamer reads (HEAD is authorised differently by some stores); a key
            # ending in "/" names a prefix, which has nothing of its own to read
            target = keys[0] if keys else (key if key and not key.endswith("/") else None)
            if target is not None:
                client.get_object(Bucket=bucket, Key=target, Range="bytes=0-0")["Body"].close()
            if keys:
                ok = (f"bucket and prefix are readable now ({len(keys)} object(s) under it); the failure was "
                      f"transient (timeout, throttling) or inside the streamer")
            elif target is not None:
                ok = "the object is readable now; the failure was transient or inside the streamer"
            else:
                empty = f"no object is under {prefix or 'its root'}: check the URI"
        except ClientError as e:
            meta = e.response.get("ResponseMetadata", {})
            code = e.response.get("Error", {}).get("Code", "?")
            status = meta.get("HTTPStatusCode", "?")
            hint = _S3_HINTS.get(str(code), "")
            failure = (f"HTTP {status}" if str(code) == str(status) else f"HTTP {status} {code}") + (
                f" ({hint})" if hint else "")
        except BotoCoreError as e:
            failure = f"{type(e).__name__}: {e}"
    if not anonymous:
        return ok or (f"the bucket answers, but {empty}" if empty else failure)
    denied = failure.startswith("HTTP 403")
    creds = "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
    if empty:
        how = f"an anonymous request ({UNSIGNED_ENV}=1)" if unsigned else f"{NO_CREDENTIALS}; an anonymous request"
        return f"{how} lists the bucket, but {empty}"
    if unsigned:
        if ok:
            return f"an anonymous request ({UNSIGNED_ENV}=1) can read it now: {ok}"
        if denied:
            return (f"an anonymous request ({UNSIGNED_ENV}=1) got {failure}: the bucket is not public; unset "
                    f"{UNSIGNED_ENV} and {creds}")
        return f"an anonymous request ({UNSIGNED_ENV}=1) got {failure}"
    if ok:
        return (f"{NO_CREDENTIALS}; an anonymous request can read it (a public bucket): set {UNSIGNED_ENV}=1 for "
                f"anonymous reads, or {creds}")
    return f"{NO_CREDENTIALS}; an anonymous request got {failure}" + (f": {creds}" if denied else "")


#: The fix for reads that fail while the store answers: runai's S3 client (runai-model-streamer 0.17, AWS CRT) drops
#: a request that moves no bytes for RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS and does not retry it ("failure to meet
#: throughput minimum" in its own log, "File access error" here); an overloaded S3-compatible server (MinIO or moto
#: on a busy host) misses that window.
SLOW_S3_HINT = ("; a slow or overloaded endpoint: runai's S3 client drops a request that moves no bytes for "
                "RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS (1000 ms by default): raise it (e.g. 30000) and keep fewer "
                "requests in flight (RUNAI_STREAMER_S3_MAX_INFLIGHT_MIB=16, or a lower \"concurrency\")")


def storage_error(uri: str, exc: BaseException, action: str = "read") -> StorageError:
    """Build the one error for a failed object-storage operation on ``uri`` (the original as context); an error
    that is already a :class:`StorageError` (a configuration conflict found before any request) is returned as is."""
    if isinstance(exc, StorageError):
        return exc
    cause = _s3_probe(uri, exc) if scheme_of(uri) == "s3://" else f"{type(exc).__name__}: {exc}"
    said = {"list": "Listing said", "stat": "The metadata request said"}.get(action, "Streamer said")
    if "transient" in cause and scheme_of(uri) == "s3://" and action == "read":
        cause += SLOW_S3_HINT
    return StorageError(
        f"cannot {action} {uri}: {cause}. {said}: {type(exc).__name__}: {exc}. "
        f"Endpoint and credentials come from: {env_summary()}. For S3-compatible stores set AWS_ENDPOINT_URL "
        f"and, for path-style addressing, RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0; for public buckets "
        f"{UNSIGNED_ENV}=1; set AWS_EC2_METADATA_DISABLED=true outside EC2 so a missing credential does not wait on "
        f"the metadata service."
    )


def page_cache_fraction(paths: list[str], windows: int = 64, window_pages: int = 64) -> Optional[float]:
    """Fraction (0..1) of the pages of local ``paths`` resident in the page cache, from ``mincore(2)``.

    Asks about ``windows`` evenly spaced windows of ``window_pages`` pages per file (default 64 x 256 KiB), not the
    whole file: ``mincore`` walks every page it is asked about, so whole files would cost time in proportion to the
    checkpoint's size at the start of every load (docs/benchmarks.md). Returns None for object storage, empty
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
    vec = ctypes.create_string_buffer(window_pages)
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        npages = (size + page - 1) // page
        starts = sorted({npages * k // windows for k in range(windows)}) if npages > windows * window_pages else [0]
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = c_mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                for first in starts:
                    n = min(window_pages if len(starts) > 1 else npages, npages - first)
                    buf = vec if n <= window_pages else ctypes.create_string_buffer(n)
                    if c_mincore(addr + first * page, min(n * page, size - first * page), buf) != 0:
                        return None
                    resident += sum(b & 1 for b in buf.raw[:n])
                    total += n
            finally:
                c_munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else None


def list_safetensors(source: str) -> list[str]:
    """All ``*.safetensors`` files directly under ``source`` (a directory or object-storage prefix), sorted.

    Raises :class:`StorageError` when object storage cannot be listed.
    """
    if not is_object_uri(source):
        return sorted(glob.glob(os.path.join(source, "*.safetensors")))
    from runai_model_streamer import list_safetensors as runai_list

    try:
        with scoped_environ(endpoint_env()):
            return sorted(_s3_list(source) if scheme_of(source) == "s3://" else runai_list(source))
    except Exception as e:  # noqa: BLE001 - every backend failure becomes one StorageError
        raise storage_error(source, e, "list") from e


@dataclass(frozen=True)
class FileIdentity:
    """What identifies one version of a shard without reading its data.

    ``size`` (bytes) always; local files: ``mtime_ns``, ``st_dev``, ``st_ino`` (of the file a symlink points to);
    object storage: ``etag`` and ``version_id`` where the store reports them (S3 ``VersionId`` only on versioned
    buckets; GCS ``generation``; Azure ``version_id`` with blob versioning on).
    """

    size: int
    mtime_ns: Optional[int] = None
    st_dev: Optional[int] = None
    st_ino: Optional[int] = None
    etag: Optional[str] = None
    version_id: Optional[str] = None


def file_identity(path: str) -> FileIdentity:
    """Size and identity of a local file (``os.stat``, symlinks followed) or object (one request: S3 a 1-byte ranged
    ``GetObject`` with the listing's bounded timeouts, GCS ``get_blob``, Azure ``get_blob_properties``, through the
    clients runai's backends build, so the same endpoint and credentials).

    Raises ``OSError`` (local) or :class:`StorageError` naming the URI (object storage).
    """
    scheme = scheme_of(path)
    if not scheme:
        st = os.stat(path)
        return FileIdentity(st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino)
    try:
        with scoped_environ(endpoint_env()):
            return _OBJECT_STAT[scheme](path)
    except Exception as e:  # noqa: BLE001 - every backend failure becomes one StorageError
        raise storage_error(path, e, "stat") from e


def _s3_stat(uri: str) -> FileIdentity:
    # A 1-byte ranged GET, not HeadObject: it needs exactly the permission the streamer's reads need (some stores
    # and bucket policies authorise HEAD differently), and its Content-Range carries the object's size.
    from botocore.exceptions import ClientError

    bucket, key, _ = _s3_parts(uri)
    client = _s3_client(LIST_TIMEOUTS["connect_timeout"], LIST_TIMEOUTS["read_timeout"], LIST_TIMEOUTS["attempts"],
                        unsigned=os.environ.get(UNSIGNED_ENV) == "1")
    try:
        got = client.get_object(Bucket=bucket, Key=key, Range="bytes=0-0")
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") == "InvalidRange":  # only an empty object has no byte 0
            return FileIdentity(0)
        raise
    got["Body"].close()
    size = int(got["ContentRange"].rsplit("/", 1)[1]) if got.get("ContentRange") else int(got["ContentLength"])
    return FileIdentity(size, etag=got.get("ETag"), version_id=got.get("VersionId"))


def _bucket_and_key(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.split("://", 1)[1].partition("/")
    return bucket, key


def _gcs_stat(uri: str) -> FileIdentity:
    from runai_model_streamer_gcs.files.files import _create_client

    bucket, key = _bucket_and_key(uri)
    blob = _create_client().bucket(bucket).get_blob(key)
    if blob is None:
        raise FileNotFoundError(f"no such object: {uri}")
    return FileIdentity(int(blob.size), etag=blob.etag,
                        version_id=None if blob.generation is None else str(blob.generation))


def _azure_stat(uri: str) -> FileIdentity:
    from runai_model_streamer_azure.files.files import _create_client

    container, key = _bucket_and_key(uri)
    props = _create_client().get_blob_client(container, key).get_blob_properties()
    return FileIdentity(int(props.size), etag=props.etag, version_id=getattr(props, "version_id", None))


#: scheme -> metadata request of that store (see :func:`file_identity`)
_OBJECT_STAT = {"s3://": _s3_stat, "gs://": _gcs_stat, "az://": _azure_stat}


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
