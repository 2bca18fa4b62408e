"""``vllm-fastload inspect <dir | s3://...>``: what the loaders will read, what is wrong with it, how to tune.

Per shard: tensor count, bytes, largest tensor (MiB), dtypes, tensors whose file offset is not a multiple of
their element size (alignment), header problems (the checks of :mod:`vllm_fastload.checkpoint`). Across shards, the
checks the loaders run before reading data (:func:`~vllm_fastload.checkpoint.read_checkpoint`, same messages):
names stored in more than one shard (a problem without an index, a warning when the index decides) and shards
without tensors. Then a suggested
``memory_limit`` and ``concurrency`` for ``runai_streamer`` and, when vLLM is installed, the fingerprint the
loaders compute for the given engine args (TP rank 0). With ``--content-digest``, the checkpoint's content digest
(every tensor read and hashed), the value ``expected_content_digest`` pins.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from collections import Counter
from typing import Any, Optional

from .checkpoint import (
    DTYPE_BYTES,
    SafetensorsHeader,
    no_tensors_problem,
    read_header,
    resolve_duplicates,
    select_shards,
)
from .content import checkpoint_digest
from .errors import CheckpointError, FastloadError
from .heap import gc_paused
from .storage import is_object_uri


def shard_report(path: str) -> dict[str, Any]:
    """Facts of one shard; ``problem`` is the header error text (then the other fields are absent)."""
    return _shard(path)[0]


def _shard(path: str) -> tuple[dict[str, Any], Optional[SafetensorsHeader]]:
    """:func:`shard_report` and the parsed header (None when it has a problem)."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    try:
        h = read_header(path)
    except (FastloadError, OSError) as e:
        return {"shard": name, "problem": str(e)}, None
    base = 8 + h.header_len
    unaligned = [t.name for t in h.tensors.values()
                 if t.nbytes and DTYPE_BYTES[t.dtype] >= 1 and (base + t.begin) % int(DTYPE_BYTES[t.dtype])]
    big = h.largest
    return {"shard": name, "tensors": len(h.tensors), "bytes": h.data_bytes,
            "largest_tensor": big.name if big else None,
            "largest_mib": round(big.nbytes / 2**20, 2) if big else 0.0,
            "dtypes": dict(sorted(Counter(t.dtype for t in h.tensors.values()).items())),
            "unaligned_tensors": len(unaligned), "unaligned_examples": unaligned[:3],
            "header_sha256": h.header_sha256, "problem": None}, h


def suggest(shards: list[dict], remote: bool) -> Optional[dict[str, Any]]:
    """``memory_limit`` (bytes): twice the largest tensor, at least 1 GiB, at most the whole checkpoint;
    ``concurrency``: 16 for object storage, else 2 x CPUs capped to 32 (starting points to tune from; the reader
    sweep behind them is in docs/benchmarks.md). None when no shard could be read: there is nothing to tune for."""
    ok = [s for s in shards if not s.get("problem")]
    if not ok:
        return None
    largest = max((int(s["largest_mib"] * 2**20) for s in ok), default=0)
    total = sum(s["bytes"] for s in ok)
    mem = min(max(2 * largest, 2**30), max(total, largest))
    conc = 16 if remote else min(32, 2 * (os.cpu_count() or 8))
    return {"memory_limit": mem, "memory_limit_gib": round(mem / 2**30, 2), "concurrency": conc,
            "extra_config": json.dumps({"memory_limit": mem, "concurrency": conc})}


def fingerprint_for(source: str, engine_args: list[str]) -> Optional[dict[str, Any]]:
    """The fingerprint the loaders compute for ``source`` with these engine args (TP rank 0), or None without
    vLLM. Raises what vLLM raises for bad engine args."""
    try:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        return None
    from .fingerprint import Fingerprint, of_model

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # argparse prints its whole usage before the one line that matters
            args = parser.parse_args(["--model", source, *engine_args])
    except SystemExit:
        last = [ln for ln in said.getvalue().splitlines() if ln.strip()][-1:]
        why = last[0].split("error: ", 1)[-1] if last else " ".join(engine_args)
        raise ValueError(f"vLLM rejected the engine args: {why}") from None
    vcfg = EngineArgs.from_cli_args(args).create_engine_config()
    _, fp = of_model(vcfg.model_config, vcfg, log_warnings=False)  # inspect lists them itself
    pc = vcfg.parallel_config  # this process has no parallel state: take the sizes the engine will have
    fp = Fingerprint.from_dict({**fp.to_dict(), "tp_size": pc.tensor_parallel_size,
                                "pp_size": pc.pipeline_parallel_size})
    return {"short": fp.short(), "fields": {k: v for k, v in fp.to_dict().items() if k != "shards"}}


def no_shards_problem(source: str) -> str:
    """Why ``source`` has nothing to stream, and what to do: a missing path, an empty directory, or other
    weight formats (listed)."""
    if is_object_uri(source):
        return (f"no *.safetensors under {source}: check the URI (runai_streamer falls back to vLLM's default loader, "
                f"which reads object storage only through runai)")
    if not os.path.exists(source):
        return f"{source} does not exist: pass the model directory (the one holding config.json and *.safetensors)"
    if not os.path.isdir(source):
        return f"{source} is not a directory: pass the model directory (the one holding config.json and *.safetensors)"
    present = sorted(os.listdir(source))
    weights = [f for f in present if f.endswith((".bin", ".pt", ".pth", ".gguf", ".ckpt"))]
    if not present:
        return f"{source} is empty: no weights to load with any load format"
    if weights:
        return (f"no *.safetensors in {source} (found {', '.join(weights[:5])}): runai_streamer falls back to vLLM's "
                f"default loader; convert to safetensors (e.g. transformers' save_pretrained(safe_serialization=True)) "
                f"to stream")
    return (f"no weight files in {source} (found {', '.join(present[:8])}{' ...' if len(present) > 8 else ''}): "
            f"pass the model directory")


#: How the problem of engine args vLLM refuses starts (the shard report stands; only the fingerprint failed).
FINGERPRINT_PROBLEM = "fingerprint not computed"


def inspect(source: str, engine_args: Optional[list[str]] = None, with_fingerprint: bool = True,
            content_digest: bool = False) -> dict[str, Any]:
    """The whole report (JSON-ready). With ``content_digest`` (local checkpoints only) every tensor is read and
    the report gains ``content_digest`` (``blake3:<hex>``, :mod:`~vllm_fastload.content`) and
    ``content_digest_s`` (seconds). Raises :class:`~vllm_fastload.errors.StorageError` when ``source`` cannot
    be listed and :class:`~vllm_fastload.errors.CheckpointError` for an index naming a missing shard or (with
    ``content_digest``) an object-storage source."""
    with gc_paused():  # objects per tensor (headers, the duplicate check): no collection walks them meanwhile
        return _inspect(source, engine_args, with_fingerprint, content_digest)


def _inspect(source: str, engine_args: Optional[list[str]], with_fingerprint: bool,
             content_digest: bool) -> dict[str, Any]:
    """:func:`inspect`'s report."""
    plan = select_shards(source)
    read = [_shard(f) for f in plan.files]
    shards = [s for s, _ in read]
    out = {"source": source, "index": plan.index, "ignored": list(plan.ignored), "shards": shards,
           "problems": [s["problem"] for s in shards if s.get("problem")], "warnings": [],
           "suggested": suggest(shards, is_object_uri(source))}
    headers = [h for _, h in read if h is not None]
    empty = no_tensors_problem(plan, headers) if len(headers) == len(plan.files) else None
    if empty:
        out["problems"].append(empty)
    checkpoint = None
    try:
        checkpoint = resolve_duplicates(plan, headers)
        out["warnings"] = checkpoint.warnings()
    except CheckpointError as e:
        out["problems"].append(str(e))
    if not plan.files:
        out["problems"].append(no_shards_problem(source))
        out["suggested"] = None
    if content_digest and (out["problems"] or checkpoint is None):
        out["content_digest"] = None
        out["content_digest_not_computed"] = "the checkpoint has problems (listed above): no load would accept it"
    elif content_digest:
        t = time.perf_counter()
        out["content_digest"] = checkpoint_digest(checkpoint)
        out["content_digest_s"] = round(time.perf_counter() - t, 3)
    if with_fingerprint and not out["problems"]:
        try:
            out["fingerprint"] = fingerprint_for(source, engine_args or [])
        except Exception as e:  # noqa: BLE001 - the shard report stands; the fingerprint part fails alone
            out["problems"].append(f"{FINGERPRINT_PROBLEM}: {one_line(e)} (the shard report above is complete; "
                                   f"fix the engine args, or pass --no-fingerprint)")
    return out


def one_line(e: BaseException) -> str:
    """The line of an exception's message that says what is wrong (pydantic's first error for a vLLM config)."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
            return f"{type(e).__name__}: {first.get('msg', '')}".replace("Value error, ", "")
        except (TypeError, IndexError, AttributeError):
            pass
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    return text if text.startswith("vLLM rejected") else f"{type(e).__name__}: {text}"


def _size_text(nbytes: int) -> str:
    """``nbytes`` in the largest of GiB, MiB, KiB that it reaches (two decimals), else in bytes."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} bytes"


def render(rep: dict[str, Any]) -> str:
    """Human-readable text of :func:`inspect`'s report."""
    lines = [f"{rep['source']}" + (f" (index {os.path.basename(rep['index'])})" if rep["index"] else "")]
    for s in rep["shards"]:
        if s.get("problem"):
            lines.append(f"  {s['shard']}: PROBLEM: {s['problem']}")
            continue
        dt = ", ".join(f"{k} x{v}" for k, v in s["dtypes"].items())
        n = s["tensors"]
        lines.append(f"  {s['shard']}: {n} tensor{'' if n == 1 else 's'}, {s['bytes'] / 2**30:.2f} GiB, largest "
                     f"{s['largest_tensor']} {s['largest_mib']} MiB; dtypes {dt}")
        if s["unaligned_tensors"]:
            lines.append(f"    warning: {s['unaligned_tensors']} tensor(s) at offsets not aligned to their element "
                         f"size (e.g. {', '.join(s['unaligned_examples'])}): runai copies each to align it")
    for f in rep["ignored"]:
        lines.append(f"  ignored (not in the index): {f}")
    for w in rep.get("warnings", []):
        lines.append(f"  warning: {w}")
    for p in rep["problems"]:
        if p.startswith(FINGERPRINT_PROBLEM):  # about the engine args, not a shard: not indented under them
            lines.append(f"PROBLEM (engine args): {p}")
        elif not any(p == s.get("problem") for s in rep["shards"]):
            lines.append(f"  PROBLEM: {p}")
    sg = rep["suggested"]
    if sg:
        lines.append(f"suggested runai_streamer extra-config: {sg['extra_config']}  "
                     f"(memory_limit {_size_text(sg['memory_limit'])})")
    if rep.get("content_digest_not_computed"):
        lines.append(f"content digest not computed: {rep['content_digest_not_computed']}")
    if rep.get("content_digest"):
        lines.append(f"content digest {rep['content_digest']} ({rep['content_digest_s']} s; pin it with "
                     f"\"expected_content_digest\")")
    fp = rep.get("fingerprint")
    if fp:
        f = fp["fields"]
        lines.append(f"fingerprint {fp['short']} (architecture {f['architecture']}, dtype {f['dtype']}, quantization "
                     f"{f['quantization']}, TP {f['tp_size']} rank {f['tp_rank']}, vLLM {f['vllm_version']})")
    return "\n".join(lines)
