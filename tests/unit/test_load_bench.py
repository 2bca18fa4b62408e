"""benchmarks/load_bench.py: a loader name with ``_nostats`` runs its base loader with vLLM's usage reporter off;
every run lands in ``runs.jsonl`` as it ends."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import load_bench  # noqa: E402


@pytest.mark.parametrize("name, base", [
    ("runai_fastload_nostats", "runai_fastload"),
    ("instanttensor_buffered_nostats", "instanttensor_buffered"),
    ("runai_fastload", "runai_fastload"),
])
def test_the_suffix_names_its_base_loader(name, base):
    assert load_bench.base_loader(name) == base
    assert base in load_bench.LOADERS


def test_a_peer_with_the_suffix_needs_the_peers_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "instanttensor" else real(n, *a))
    assert not load_bench.available("instanttensor_buffered_nostats")
    assert load_bench.available("runai_fastload_nostats")


@pytest.mark.parametrize("name, stats_off", [("runai_fastload_nostats", True), ("runai_fastload", False),
                                             ("instanttensor_buffered_nostats", True)])
def test_the_engine_of_a_nostats_loader_runs_with_usage_stats_off(monkeypatch, tmp_path, name, stats_off):
    """The child engine's environment: VLLM_NO_USAGE_STATS=1 only for the suffixed name, the base loader's own
    settings kept; a failed run's log is named by the name asked for."""
    monkeypatch.delenv("VLLM_NO_USAGE_STATS", raising=False)
    seen = {}

    def fake_run(cmd, capture_output, text, env, timeout):
        seen["env"] = env
        return subprocess.CompletedProcess(cmd, 1, "engine log\n", "")

    monkeypatch.setattr(load_bench.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match=f"^{name} failed"):
        load_bench.run_one(name, "/nonexistent", 1, 0.5, tmp_path / f"{name}.report.json", {})
    assert (seen["env"].get("VLLM_NO_USAGE_STATS") == "1") is stats_off
    if name.startswith("instanttensor_buffered"):
        assert seen["env"]["INSTANTTENSOR_BACKEND"] == "BUFFERED"
    assert (tmp_path / f"{name}.failed.log").read_text() == "engine log\n"


def test_every_run_is_appended_to_runs_jsonl_as_it_ends(monkeypatch, tmp_path):
    """A call cut by its time limit keeps the runs it finished: each run (a failed one too) is one JSON line of
    runs.jsonl the moment it ends, before results.json exists; the log tail stays out of it."""
    import argparse
    import json

    answers = iter([{"loader": "auto", "default_weights_s": 1.82, "model_loading_s": 10.06, "log_tail": "x" * 999},
                    RuntimeError("auto failed (exit 1; whole log in somewhere):\ntraceback")])

    def fake_run_one(*args, **kwargs):
        got = next(answers)
        if isinstance(got, Exception):
            raise got
        return dict(got)

    monkeypatch.setattr(load_bench, "run_one", fake_run_one)
    a = argparse.Namespace(cold=False, model=tmp_path, tp=1, gmu=0.5, out=tmp_path, extra="{}", dtype=None,
                           max_model_len=1024)
    load_bench.one_run("auto", a, [])
    lines = (tmp_path / "runs.jsonl").read_text().splitlines()
    assert [json.loads(x)["default_weights_s"] for x in lines] == [1.82]
    assert "log_tail" not in json.loads(lines[0])
    assert not (tmp_path / "results.json").exists()
    load_bench.one_run("auto", a, [])
    lines = (tmp_path / "runs.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["failed"].startswith("auto failed (exit 1")
