"""ipc_cache engine against a daemon whose checkpoint changed underneath (issue 15, items 1 and 7), driven in one
process with the real RankServer and client as in test_ipc_tp_mismatch.py (same fixtures)."""

from __future__ import annotations

import os
from pathlib import Path
import types

import pytest
import torch

pytest.importorskip("vllm")

from tests.conftest import write_safetensors  # noqa: E402
from tests.unit.test_ipc_tp_mismatch import ipc_loader, parallel, setup, warnings_logged  # noqa: E402,F401
from vllm_fastload.errors import CheckpointError  # noqa: E402


def _stub_default_loader(monkeypatch):
    calls = []
    stub = types.SimpleNamespace(load_config=types.SimpleNamespace(load_format="auto"),
                                 load_model=lambda **kw: calls.append(kw) or "disk")
    monkeypatch.setattr("vllm_fastload.fallback.default_loader", lambda load_config: stub)
    return calls


def test_values_written_over_the_daemons_shard_make_the_engine_load_from_disk(setup, monkeypatch, warnings_logged):
    """Same header, other values (written in place after the daemon loaded): the daemon's weights are stale, the
    fingerprint says so (shard mtime) and the engine loads from disk with a warning naming the shard."""
    srv, model_config, vllm_config = setup
    calls = _stub_default_loader(monkeypatch)
    parallel(monkeypatch, 1, 0)
    p = os.path.join(model_config.model, "model.safetensors")
    st = os.stat(p)
    with open(p, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\0\0\0\0")
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert ipc_loader(srv.path).load_model(vllm_config, model_config) == "disk" and len(calls) == 1
    [msg] = [w for w in warnings_logged if "ipc_cache cannot serve this load" in w]
    assert (f"fingerprint mismatch with the daemon at {srv.path}: shards (daemon "
            f"['model.safetensors (mtime_ns={st.st_mtime_ns})'], engine "
            f"['model.safetensors (mtime_ns={st.st_mtime_ns + 1_000_000})'])") in msg


def test_a_duplicate_name_fails_the_engine_instead_of_falling_back(setup, monkeypatch):
    """vLLM's default loader would load both copies (the last read wins): a duplicate without an index is an error
    even with "fallback": true."""
    srv, model_config, vllm_config = setup
    calls = _stub_default_loader(monkeypatch)
    parallel(monkeypatch, 1, 0)
    write_safetensors(Path(model_config.model) / "overlay.safetensors",
                      {"w": torch.zeros(1000, dtype=torch.float32)})
    with pytest.raises(CheckpointError, match=r"^tensor 'w' is stored in 2 shards \(.*/model.safetensors, "
                                              r".*/overlay.safetensors\)"):
        ipc_loader(srv.path).load_model(vllm_config, model_config)
    assert calls == []
