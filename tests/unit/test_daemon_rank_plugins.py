"""The preload daemon's rank processes (spawned, so they start without vLLM's general plugins) must load through
this package's loaders: at TP > 1 they once resolved ``runai_streamer`` to vLLM's built-in loader (40 s per rank
on the H200 instead of 0.44 s)."""

import multiprocessing as mp

import pytest

pytest.importorskip("vllm")


def _child(q):
    from vllm.config import LoadConfig
    from vllm.model_executor import model_loader as ml

    from vllm_fastload.ipc.daemon.export import rank_loader

    before = ml.get_model_loader(LoadConfig(load_format="runai_streamer"))
    after = rank_loader(LoadConfig(load_format="runai_streamer"))
    q.put((type(before).__module__, type(after).__module__ + "." + type(after).__name__))


def test_spawned_rank_resolves_runai_streamer_to_this_package():
    ctx = mp.get_context("spawn")  # as the daemon starts its ranks
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    try:
        before, after = q.get(timeout=240)
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    assert not before.startswith("vllm_fastload")  # a fresh spawned process has vLLM's built-in loader...
    assert after == "vllm_fastload.streaming.loader.RunaiStreamerLoader"  # ...and rank_loader gives ours
