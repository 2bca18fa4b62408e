"""The direct read path on a real GPU without vLLM: runai reads into registered huge-page memory (streaming.hostmem)
allocated on a thread, the GPU copies the pieces out; needs only torch with CUDA and runai-model-streamer."""

import gc

import pytest
import torch

from tests.gpu.conftest import NO_CUDA

if not torch.cuda.is_available():
    pytest.skip(NO_CUDA, allow_module_level=True)

pytest.importorskip("runai_model_streamer")

from tests.conftest import assert_zoo_bit_exact, write_zoo  # noqa: E402
from vllm_fastload.checkpoint import read_header  # noqa: E402
from vllm_fastload.streaming import direct  # noqa: E402
from vllm_fastload.streaming.hostmem import page_locked  # noqa: E402
from vllm_fastload.streaming.timing import StageTimes  # noqa: E402


@pytest.mark.parametrize("piece", [4096, 5000, 2**20])
def test_zoo_bit_exact_through_a_registered_arena_made_on_a_thread(tmp_path, piece):
    expected = write_zoo(tmp_path / "model.safetensors")
    future = direct.ArenaFuture(piece, 2, torch.cuda.current_device())
    arena, _ = future.result()
    assert arena.is_pinned() and arena.numel() == direct.arena_bytes(piece, 2)  # page-locked per the CUDA runtime
    times, stats, got = StageTimes(), {}, {}
    for name, t in direct.stream_to_device([read_header(str(tmp_path / "model.safetensors"))],
                                           torch.device("cuda", torch.cuda.current_device()), piece, 2, times,
                                           arena, stats):
        got[name] = t
        torch.cuda._sleep(1000)  # a slow consumer: a slot must not be refilled before its copies finished
    arena = None
    torch.cuda.synchronize()
    assert_zoo_bit_exact(got, expected)
    assert stats["pinned_extra_bytes"] == 0


def test_page_locked_copies_asynchronously_and_unregisters(monkeypatch):
    from vllm_fastload.streaming import hostmem

    unregistered = []
    real = hostmem._unregister
    monkeypatch.setattr(hostmem, "_unregister", lambda ptr, device, keep: unregistered.append((ptr, device)) or real(ptr, device, keep))
    t = page_locked(64 * 2**20)
    assert t.is_pinned()
    t.copy_(torch.arange(t.numel(), dtype=torch.int64).to(torch.uint8))
    d = torch.empty(t.numel(), dtype=torch.uint8, device="cuda")
    d.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(d.cpu(), t)
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert unregistered == [(ptr, torch.cuda.current_device())]



def test_device_buffers_stay_out_of_a_memory_pool_the_loading_thread_routes_to(tmp_path):
    """vLLM's sleep mode loads inside ``torch.cuda.use_mem_pool`` (its sleep allocator); buffers the streamer gives
    back must not be cached in that pool (vLLM frees the pool's empty segments behind PyTorch's counters and sizes
    the KV cache from them, streaming/devmem.py). Both read paths, bytes checked; the pool must end up empty."""
    from vllm_fastload.streaming.pipeline import H2DPipeline

    expected = write_zoo(tmp_path / "model.safetensors")
    dev = torch.device("cuda", torch.cuda.current_device())
    params = {name: torch.empty(len(raw), dtype=torch.uint8, device=dev) for name, (_, _, raw) in expected.items()}
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        for name, t in direct.stream_to_device([read_header(str(tmp_path / "model.safetensors"))], dev, 4096, 2,
                                               StageTimes()):
            params[name].copy_(t.reshape(-1).view(torch.uint8))
            del t
        torch.cuda.synchronize()
        direct_pool = pool.snapshot()
        with H2DPipeline(dev, pinned_slot_bytes=4096, pinned_slots=2) as pipe:
            host = {name: torch.frombuffer(bytearray(raw), dtype=torch.uint8) for name, (_, _, raw) in expected.items()
                    if raw}
            for name, t in pipe.run(iter(host.items())):
                assert torch.equal(t.cpu(), host[name]), name
                del t
        torch.cuda.synchronize()
    assert direct_pool == [], f"the direct path left {len(direct_pool)} segment(s) in the loading thread's pool"
    assert pool.snapshot() == [], "the pipeline left segments in the loading thread's pool"
    for name, (_, _, raw) in expected.items():
        assert params[name].cpu().numpy().tobytes() == raw, name
