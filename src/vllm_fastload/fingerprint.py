"""The identity of what a load produced. Both load formats compute it the same way.

A :class:`Fingerprint` covers the checkpoint (sorted shard names, sizes, a SHA-256 of each safetensors header and
each shard's identity: local files' mtime_ns, device and inode; objects' ETag and version id), the model
architecture, the bytes of its ``config.json``, dtype, quantization, RoPE settings, revision, KV-cache dtype, the
parallel layout (TP/PP/DP size and rank; expert parallelism and its expert placement) and the vLLM and plugin
versions. Two loads with equal fingerprints produce the same weights; :meth:`Fingerprint.mismatched_fields` says why
two differ. This module imports neither vLLM nor torch; :func:`from_vllm` reads the vLLM objects it is given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

from . import __version__
from .checkpoint import SafetensorsHeader, ShardPlan, model_shards, read_checkpoint
from .storage import FileIdentity


@dataclass(frozen=True, kw_only=True)
class ShardFacts(FileIdentity):
    """One shard: the identity of the file version read (:class:`~vllm_fastload.storage.FileIdentity`: local files'
    ``mtime_ns``, ``st_dev``, ``st_ino``, where a rewrite in place changes the mtime and a replaced file the inode;
    objects' ``etag`` and ``version_id``, None where the store does not report them), with ``size`` (bytes) the
    size its header declares, plus the file name (no directory) and the SHA-256 of its header JSON."""

    name: str
    header_sha256: str

    @classmethod
    def of(cls, header: SafetensorsHeader) -> ShardFacts:
        """Facts of a parsed header (identity fields None when the header was parsed without one)."""
        ident = {} if header.identity is None else dataclasses.asdict(header.identity)
        ident["size"] = header.declared_size
        return cls(name=header.path.rstrip("/").rsplit("/", 1)[-1], header_sha256=header.header_sha256, **ident)


@dataclass(frozen=True)
class Fingerprint:
    """Identity of a loaded model (see module docstring). All fields are JSON-serialisable."""

    shards: tuple[ShardFacts, ...]
    architecture: str
    dtype: str
    quantization: Optional[str]
    rope: Optional[str]
    revision: Optional[str]
    kv_cache_dtype: Optional[str]
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    dp_rank: int
    vllm_version: str
    plugin_version: str = __version__
    #: SHA-256 of the model folder's config.json bytes (None for object storage or without one): the skeleton an
    #: engine builds follows it (tied embeddings, head counts, layer count), so a change after the daemon loaded
    #: must not map the daemon's tensors into another model
    config_sha256: Optional[str] = None
    #: how a MoE model's experts are laid out over the ranks (:func:`_expert_layout`); None without expert
    #: parallelism: with it each rank holds whole experts instead of a TP slice of each, and EPLB's redundant
    #: experts add rows, so the same TP rank loads other tensors
    expert_parallel: Optional[str] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", tuple(sorted(self.shards, key=lambda s: s.name)))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (shards as dicts), for JSON."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Fingerprint:
        """Inverse of :meth:`to_dict`. Raises ``TypeError``/``KeyError`` on a malformed dict."""
        d = dict(d)
        d["shards"] = tuple(ShardFacts(**s) for s in d["shards"])
        return cls(**d)

    def digest(self) -> str:
        """SHA-256 (hex) of the canonical JSON of all fields."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def short(self) -> str:
        """First 12 hex digits of :meth:`digest`, for log lines."""
        return self.digest()[:12]

    def mismatched_fields(self, other: Fingerprint) -> list[tuple[str, Any, Any]]:
        """Fields that differ, as ``(field, self_value, other_value)``, in declaration order.

        For ``shards`` the values are the shards that differ: a name alone when the other side lacks it, else
        ``"name (field=value, ...)"`` with this side's value of each differing fact (size, header, mtime, inode,
        ETag, ...). An empty list means the fingerprints are equal.
        """
        out: list[tuple[str, Any, Any]] = []
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a == b:
                continue
            if f.name == "shards":
                a, b = _shard_differences(a, b), _shard_differences(b, a)
            out.append((f.name, a, b))
        return out

    def explain(self, other: Fingerprint) -> str:
        """Human text of :meth:`mismatched_fields`: ``field: mine != theirs; ...``."""
        return "; ".join(f"{n}: {a!r} != {b!r}" for n, a, b in self.mismatched_fields(other))


def _shard_differences(mine: tuple[ShardFacts, ...], theirs: tuple[ShardFacts, ...]) -> list[str]:
    """The shards of ``mine`` not equal in ``theirs`` (see :meth:`Fingerprint.mismatched_fields`)."""
    other = {s.name: s for s in theirs}
    out = []
    for s in sorted(set(mine) - set(theirs), key=lambda s: s.name):
        o = other.get(s.name)
        if o is None:
            out.append(s.name)
            continue
        diff = [f"{f.name}={getattr(s, f.name)!r}" for f in dataclasses.fields(s)
                if getattr(s, f.name) != getattr(o, f.name)]
        out.append(f"{s.name} ({', '.join(diff)})")
    return out


def _rope_of(hf_config: Any) -> Optional[str]:
    parts = {}
    for key in ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings"):
        v = getattr(hf_config, key, None)
        if v is not None:
            parts[key] = v
    return json.dumps(parts, sort_keys=True, default=str) if parts else None


def _parallel() -> dict[str, int]:
    """TP/PP/DP size and rank of this process from vLLM's parallel state (1/0 when not initialised)."""
    out = {"tp_size": 1, "tp_rank": 0, "pp_size": 1, "pp_rank": 0, "dp_size": 1, "dp_rank": 0}
    try:
        from vllm.distributed import parallel_state as ps

        if ps.model_parallel_is_initialized():
            out["tp_size"] = ps.get_tensor_model_parallel_world_size()
            out["tp_rank"] = ps.get_tensor_model_parallel_rank()
            out["pp_size"] = ps.get_pp_group().world_size
            out["pp_rank"] = ps.get_pp_group().rank_in_group
            dp = getattr(ps, "get_dp_group", None)
            if dp is not None:
                try:
                    out["dp_size"], out["dp_rank"] = dp().world_size, dp().rank_in_group
                except (AssertionError, AttributeError):
                    pass
    except ImportError:
        pass
    return out


def _expert_layout(vllm_config: Any) -> Optional[str]:
    """``vllm_config.parallel_config``'s expert layout as one string (``"placement=linear, eplb=off"``; with EPLB
    ``", eplb=on, redundant_experts=N"``), None when expert parallelism is off or there is no parallel config.
    Fields read (vLLM's ``ParallelConfig``, 0.26 and 0.32): ``enable_expert_parallel``,
    ``expert_placement_strategy``, ``enable_eplb``, ``eplb_config.num_redundant_experts`` (older vLLM:
    ``num_redundant_experts`` on the parallel config itself); a field this vLLM lacks is left out."""
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is None or not getattr(pc, "enable_expert_parallel", False):
        return None
    parts = [f"placement={getattr(pc, 'expert_placement_strategy', 'linear')}"]
    if getattr(pc, "enable_eplb", False):
        eplb = getattr(pc, "eplb_config", None)
        redundant = getattr(eplb, "num_redundant_experts", getattr(pc, "num_redundant_experts", None))
        parts.append("eplb=on" + (f", redundant_experts={redundant}" if redundant is not None else ""))
    else:
        parts.append("eplb=off")
    return ", ".join(parts)


def of_model(model_config: Any, vllm_config: Any = None, log_warnings: bool = True) -> tuple[ShardPlan, Fingerprint]:
    """Shards and fingerprint of what vLLM's ``model_config`` loads in this process (headers read and validated,
    duplicate names resolved: :func:`~vllm_fastload.checkpoint.read_checkpoint`, whose errors it raises).
    Index-resolved duplicates are logged as WARNINGs (as the loaders log them) unless ``log_warnings`` is false."""
    from .log import logger

    plan = model_shards(model_config)
    ckpt = read_checkpoint(plan)
    for w in ckpt.warnings() if log_warnings else ():
        logger.warning("fastload: %s", w)
    return plan, from_vllm(model_config, ckpt.headers, vllm_config)


def from_vllm(model_config: Any, headers: Iterable[SafetensorsHeader], vllm_config: Any = None) -> Fingerprint:
    """Fingerprint of loading ``headers`` into the model ``model_config`` describes, in this process.

    ``model_config`` is vLLM's ``ModelConfig``; ``vllm_config`` (optional, default: vLLM's current config) gives the
    KV-cache dtype. The parallel layout is read from ``vllm.distributed.parallel_state``.
    """
    import vllm

    if vllm_config is None:
        try:
            from vllm.config import get_current_vllm_config_or_none

            vllm_config = get_current_vllm_config_or_none()
        except ImportError:
            vllm_config = None
    cache = getattr(vllm_config, "cache_config", None)
    archs = (getattr(model_config, "architectures", None) or getattr(model_config.hf_config, "architectures", None)
             or ["?"])
    return Fingerprint(
        shards=tuple(ShardFacts.of(h) for h in headers),
        architecture=str(archs[0]),
        dtype=str(model_config.dtype).removeprefix("torch."),
        quantization=getattr(model_config, "quantization", None),
        rope=_rope_of(model_config.hf_config),
        revision=getattr(model_config, "revision", None),
        kv_cache_dtype=str(getattr(cache, "cache_dtype", None)) if cache is not None else None,
        vllm_version=str(vllm.__version__),
        config_sha256=config_sha256(str(model_config.model)),
        expert_parallel=_expert_layout(vllm_config),
        **_parallel(),
    )


def config_sha256(model: str) -> Optional[str]:
    """SHA-256 (hex) of ``model``'s ``config.json`` when ``model`` is a local folder holding one, else None."""
    import os

    path = os.path.join(model, "config.json")
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:  # object storage, a hub id, no config.json: vLLM's config check is all there is
        return None
