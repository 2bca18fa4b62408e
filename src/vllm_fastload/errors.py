"""Exception types raised by vllm-fastload. All derive from :class:`FastloadError` (a ``RuntimeError``); a few also
from ``ValueError`` where callers catch them as such."""

from __future__ import annotations


class FastloadError(RuntimeError):
    """Base class of every error the plugin raises on purpose (the message says what and how to fix)."""


class ConfigError(FastloadError, ValueError):
    """``--model-loader-extra-config`` is invalid. Raised before anything is loaded or any env var changes."""


class CheckpointError(FastloadError, ValueError):
    """A checkpoint file or index is malformed or incomplete; the message names the file (and tensor)."""


class StorageError(FastloadError):
    """Object storage (s3://, gs://, az://) could not be listed or read; the message names the URI,
    the cause and the environment variables that configure endpoint and credentials."""


class FallbackRefused(FastloadError):
    """The fast path cannot serve this load and ``"fallback": false`` forbids the default loader."""


class SocketDirError(FastloadError):
    """The weight-cache socket directory cannot be used (missing permission, not a directory, a symbolic link, on a
    read-only file system, owned by another user, writable by others); the message names the directory, where it
    came from (flag, extra-config key, ``$XDG_RUNTIME_DIR`` or the default) and the fix."""


class UntrustedPeer(FastloadError):
    """The process at the other end of a weight-cache socket runs as another user (not this one, not root): its
    manifest and memory are never used; the message names the socket and both uids."""


class CacheUnavailable(FastloadError):
    """The ``ipc_cache`` preload daemon cannot serve this load: no daemon, a timeout, a refusal, another protocol,
    or an answer or memory that cannot be used; the message says which. Every error meaning "load from disk
    instead" derives from it."""


class ManifestError(CacheUnavailable, ValueError):
    """The daemon's manifest is a valid message but does not describe usable memory (an entry outside its segment,
    a size that does not match shape, stride and dtype, an unknown dtype, a value that does not decode, a segment
    of another device or transport); the message names the tensor or segment."""


class ContentMismatch(FastloadError):
    """The bytes a load read hash to another content digest than the one pinned with ``expected_content_digest``
    (:mod:`vllm_fastload.content`); the message names the source and both digests. Not a fallback case: any loader
    would read the same files."""
