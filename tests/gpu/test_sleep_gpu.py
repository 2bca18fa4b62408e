"""vLLM's sleep mode with our loaders on CUDA (issue 16, item 2; vLLM's sleep mode runs on CUDA only).

One engine per case with ``enable_sleep_mode=True``, run by ``benchmarks/sleep_bench.py``'s child (the benchmark
runs it on the 16 GB model): greedy ids, then ``sleep(level=1)`` / ``wake_up()`` and ``sleep(level=2)`` /
``wake_up()``, greedy ids after each wake. Level 2 discards the weights vLLM allocated, so the engine reloads them
(``reload_weights``, the RL loops' flow) except for ``ipc_cache`` zero_copy, whose weights are the daemon's memory
(outside vLLM's sleep allocator: they stay mapped and valid).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.gpu.conftest import NO_CUDA

if not torch.cuda.is_available():
    pytest.skip(NO_CUDA, allow_module_level=True)

pytest.importorskip("vllm")

from tests.gpu.test_ipc_cache_gpu import sock, start_daemon  # noqa: E402,F401 (sock: a fixture)

_spec = importlib.util.spec_from_file_location(
    "sleep_bench", Path(__file__).resolve().parents[2] / "benchmarks" / "sleep_bench.py")
sleep_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sleep_bench)  # the benchmark's child: one engine, sleep / wake at levels 1 and 2


@pytest.mark.parametrize("case", ["runai_streamer", "zero_copy", "copy"])
def test_sleep_and_wake_keep_greedy_ids(tiny, sock, tmp_path, case):
    daemon = None if case == "runai_streamer" else start_daemon(tiny, sock, tmp_path, "preload")
    try:
        out, log = sleep_bench.run_case(tiny, case, str(sock), tmp_path / f"{case}.log")
    finally:
        if daemon is not None:
            daemon.stop()
    print(case, {k: v for k, v in out.items() if not k.startswith(("before", "after"))})
    assert out["after1"] == out["before"], log[-3000:]
    assert out["after2"] == out["before"], log[-3000:]
    if case != "runai_streamer":
        assert "Mapped " in log  # mapped from the daemon, not a fallback


def test_sleep_mode_kv_cache_is_sized_as_with_the_default_loader(small, tmp_path):
    """With ``enable_sleep_mode`` vLLM allocates the weights in its sleep allocator's pool and, when the load ends,
    frees the pool's empty segments behind PyTorch's counters, which the KV cache is then sized from: memory our
    streamer's device buffers took and gave back during the load must not become KV cache beyond
    ``gpu_memory_utilization``. A KV block of the 0.4 GB model holds 128 KiB, so a leftover of the weights' size
    would be about 3,000 blocks beyond ``auto``'s; the loaders' own difference is a block or two."""
    got = {case: sleep_bench.run_case(small, case, None, tmp_path / f"{case}.log")[0]["memory"]
           for case in ("auto", "runai_streamer")}
    print(got)
    auto, ours = got["auto"]["kv_blocks"], got["runai_streamer"]["kv_blocks"]
    assert abs(ours - auto) <= max(4, auto // 10000), got
