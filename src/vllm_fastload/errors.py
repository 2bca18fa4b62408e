"""Exception types raised by vllm-fastload. All derive from :class:`FastloadError` (a ``RuntimeError``)."""

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


class ContentMismatch(FastloadError):
    """The bytes a load read hash to another content digest than the one pinned with ``expected_content_digest``
    (:mod:`vllm_fastload.content`); the message names the source and both digests. Not a fallback case: any loader
    would read the same files."""
