"""ipc_cache engine against a daemon whose checkpoint changed underneath (issue 15, items 1 and 7), driven in one
process with the real RankServer and client as in test_ipc_tp_mismatch.py (same fixtures)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from tests.conftest import write_safetensors  # noqa: E402
from tests.unit.test_ipc_tp_mismatch import ipc_loader, parallel, setup  # noqa: E402,F401
from vllm_fastload.errors import CheckpointError  # noqa: E402


def _stub_default_loader(monkeypatch):
    """The disk load of a fallback (our runai_streamer, issue 27 item 1) reads the real files into a sink: the
    returned list collects, per load, the names it loaded."""
    from vllm_fastload.streaming.loader import RunaiStreamerLoader

    calls = []

    def load_model(self, vllm_config=None, model_config=None, prefix=""):
        class Sink(torch.nn.Module):
            def load_weights(self, weights):
                names = [n for n, _ in weights]
                calls.append(names)
                return set(names)

        self.load_weights(Sink(), model_config)
        return calls[-1]

    monkeypatch.setattr(RunaiStreamerLoader, "load_model", load_model)
    monkeypatch.setattr(RunaiStreamerLoader, "_check_all_loaded", lambda *a: None)
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
    assert ipc_loader(srv.path).load_model(vllm_config, model_config) == ["w"] and len(calls) == 1
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


def _pinned_stub(monkeypatch):
    """The fallback's disk load, hashing against the pin as the real one does (our runai_streamer)."""
    _stub_default_loader(monkeypatch)


@pytest.mark.parametrize("daemon_digest", [None, "other", "pinned"])
def test_a_pinned_engine_maps_only_a_daemon_that_hashed_the_pinned_bytes(setup, monkeypatch, warnings_logged,
                                                                        daemon_digest):
    """Issue 15, item 7: ``expected_content_digest`` on the engine. A daemon without a digest or with another one
    is not mapped (the warning names the daemon, both digests or the missing ``content_hash``); the disk load that
    follows is checked against the pin too."""
    from vllm_fastload.checkpoint import read_checkpoint, select_shards
    from vllm_fastload.content import checkpoint_digest

    srv, model_config, vllm_config = setup
    _pinned_stub(monkeypatch)
    parallel(monkeypatch, 1, 0)
    pinned = checkpoint_digest(read_checkpoint(select_shards(model_config.model)))
    other = "blake3:" + "3" * 64
    if daemon_digest is not None:
        srv.state.manifest = srv.state.manifest.model_copy(
            update={"content_digest": pinned if daemon_digest == "pinned" else other})
    if daemon_digest == "pinned":  # past the content check, the next step (the checksum samples) runs

        class Passed(Exception):
            pass

        def passed(*a, **k):
            raise Passed

        monkeypatch.setattr("vllm_fastload.ipc.memory.layout.sample_checksums", passed)
        with pytest.raises(Passed):
            ipc_loader(srv.path, expected_content_digest=pinned).load_model(vllm_config, model_config)
        assert [w for w in warnings_logged if "content" in w] == []
        return
    out = ipc_loader(srv.path, expected_content_digest=pinned).load_model(vllm_config, model_config)
    content = [w for w in warnings_logged if "content" in w]
    assert out == ["w"]  # the disk load ran and its bytes matched the pin
    [msg] = content
    if daemon_digest is None:
        assert f"the daemon at {srv.path} did not hash its weights" in msg and '"content_hash": true' in msg
    else:
        assert f"holds weights with content digest {other}, but expected_content_digest is {pinned}" in msg


def test_a_pinned_engine_whose_disk_bytes_differ_fails_after_the_fallback(setup, monkeypatch):
    from vllm_fastload.errors import ContentMismatch

    srv, model_config, vllm_config = setup
    _pinned_stub(monkeypatch)
    parallel(monkeypatch, 1, 0)
    wrong = "blake3:" + "4" * 64
    with pytest.raises(ContentMismatch, match=f"expected_content_digest is {wrong}"):
        ipc_loader(srv.path, expected_content_digest=wrong).load_model(vllm_config, model_config)
