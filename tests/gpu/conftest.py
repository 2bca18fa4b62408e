"""Fixtures of the GPU tests: random Llama models made on the device (no hub, no carried weights)."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

#: why every GPU test module skips on a machine without CUDA (CI has none)
NO_CUDA = ("no CUDA GPU on this machine (CI has none): these tests need an NVIDIA GPU with vLLM 0.26; there, run "
           "`bash benchmarks/device.sh gpu` (runai_streamer) or `bash benchmarks/device.sh ipctests` (ipc_cache)")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    """A failed GPU test's traceback at once, not only in pytest's summary at the end: device calls run under a
    time limit, and a call cut short after a failure (2026-12-06) came back without the reason."""
    if report.failed:  # the test, or its fixtures' setup or teardown (a daemon that did not start)
        sys.stderr.write(f"\n--- FAILED ({report.when}) {report.nodeid}\n{report.longreprtext[-6000:]}\n---\n")
        sys.stderr.flush()


def _models_dir(tmp_path_factory, name: str) -> Path:
    """``$FASTLOAD_GPU_MODELS/<name>`` when set (benchmarks/device.sh keeps models out of the pytest basetemp, which
    it puts under $OUT so the engines' and daemons' logs come back), else a pytest temporary directory."""
    root = os.environ.get("FASTLOAD_GPU_MODELS")
    return Path(root) / name if root else tmp_path_factory.mktemp(name) / name


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """2 layers, ~20 MB (benchmarks/make_model.py --shape tiny)."""
    from make_model import make

    return make(_models_dir(tmp_path_factory, "tiny-llama"), "tiny")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """~0.4 GB: large enough that counting the weights twice or not at all shows in the KV cache size."""
    from make_model import make

    return make(_models_dir(tmp_path_factory, "small-llama"), "small")
