"""The direct GPU read path (streaming/direct.py) with runai's real reader and a stand-in for CUDA streams/events.

The H2D copies here are plain CPU copies (torch CPU build): what is checked is the part that does not need a GPU:
pieces planned and reassembled bit-exactly from runai's out-of-order answers, runai's ring recycled through
PinnedSlots (released slots reused, no pinned memory beyond the arena), and the same errors as the ring path.
The real CUDA path runs in tests/gpu/test_pipeline_gpu.py on the device.
"""

import contextlib
import gc
import logging

import pytest
import torch

from tests.conftest import assert_zoo_bit_exact, write_zoo
from vllm_fastload.checkpoint import read_header
from vllm_fastload.streaming import direct
from vllm_fastload.streaming.timing import StageTimes


class FakeEvent:
    def __init__(self, *a, **k):
        self.recorded = 0

    def record(self, stream=None):
        self.recorded += 1

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 0.0


class FakeStream:
    def __init__(self, *a, **k):
        self.waited = 0
        self.waited_for = []

    def wait_event(self, ev):
        self.waited += 1

    def wait_stream(self, other):
        self.waited_for.append(other)

    def synchronize(self):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    consumer = FakeStream()
    consumer.copy_streams = []  # the streams the path made (its copy stream)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: consumer.copy_streams.append(FakeStream()) or
                        consumer.copy_streams[-1])
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: consumer)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    consumer.current = []  # every stream the path made current, in order
    monkeypatch.setattr(torch.cuda, "set_stream", consumer.current.append)
    extra = []
    monkeypatch.setattr(direct, "pinned_empty", lambda n: extra.append(n) or torch.empty(n, dtype=torch.uint8))
    return consumer, extra


@pytest.fixture
def host_registry(monkeypatch):
    """A fake CUDA runtime for :func:`hostmem.page_locked`: records cudaHostRegister / cudaHostUnregister."""
    class Calls(list):
        devices: list

    calls = Calls()

    class Runtime:
        def cudaHostRegister(self, ptr, n, flags):
            calls.append(("register", ptr, n))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    current = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)  # the device made current for each CUDA call
    calls.devices = current
    return calls


def device_buffers(path, piece):
    """How many device buffers (and so copy events the consumer waits for) the direct path makes for the file at
    ``path`` read in ranges of ``piece`` bytes: one per tensor read alone or in pieces, one per shared range."""
    _, where, _ = direct.split_into_pieces([read_header(str(path))], piece)
    ranges = [parts for places in where for parts in places]
    return len({p[0].key for p in ranges if len(p) == 1}) + sum(1 for p in ranges if len(p) > 1)


def _stream(path, piece, depth, arena=True):
    headers = [read_header(str(path))]
    times, stats = StageTimes(), {}
    a = torch.empty(direct.arena_bytes(piece, depth), dtype=torch.uint8) if arena else None
    stream = direct.stream_to_device(headers, torch.device("cpu"), direct.Ring(piece, depth), times, a, stats)
    got = {n: t.clone() for n, t in stream}
    return got, times, stats


@pytest.mark.parametrize("piece, depth", [(4096, 2), (5000, 3), (2**20, 16)])
def test_zoo_reassembled_bit_exact_from_pieces(tmp_path, fake_cuda, piece, depth):
    consumer, extra = fake_cuda
    expected = write_zoo(tmp_path / "model.safetensors")
    got, times, stats = _stream(tmp_path / "model.safetensors", piece, depth)
    assert_zoo_bit_exact(got, expected)
    assert times.bytes == sum(len(raw) for _, _, raw in expected.values())
    assert times.tensors == len(expected)
    assert consumer.waited == device_buffers(tmp_path / "model.safetensors", piece)  # one wait per copy event
    assert extra == [] and stats["pinned_extra_bytes"] == 0  # the arena sufficed: slots were recycled


@pytest.mark.parametrize("in_pool", [True, False])
def test_in_a_pool_each_buffer_is_the_consumers_and_the_copy_stream_waits_for_it(tmp_path, fake_cuda, monkeypatch,
                                                                                 in_pool):
    """Inside ``devmem.outside_pools`` (vLLM's sleep mode) each non-empty tensor's buffer comes from
    ``devmem.copy_target`` on the consumer's stream: the copy stream waits for the consumer once per buffer, before
    its first copy (copy_target returns only after the wait), and nothing is ``record_stream``-ed. Outside a pool
    the measured scheme stays: no such wait."""
    from vllm_fastload.streaming import devmem

    consumer, _ = fake_cuda
    expected = write_zoo(tmp_path / "model.safetensors")
    recorded = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: recorded.append(s), raising=False)
    with devmem.outside_pools(in_pool):
        got, _, _ = _stream(tmp_path / "model.safetensors", 4096, 2)
    assert_zoo_bit_exact(got, expected)
    (copy_stream,) = consumer.copy_streams
    n = device_buffers(tmp_path / "model.safetensors", 4096)
    assert copy_stream.waited_for == ([consumer] * n if in_pool else [])
    assert recorded == []  # CPU stand-in: record_stream is only called for CUDA buffers


def test_released_slots_are_reused_not_reallocated(tmp_path, fake_cuda, monkeypatch):
    """148 KB in 4 KiB pieces through a 2-deep ring: runai takes far more slots than the arena has; every one
    after the first few is a released slot handed out again (after its copy event)."""
    _, extra = fake_cuda
    write_zoo(tmp_path / "model.safetensors")
    taken, released = [], []
    orig_take, orig_rel = direct.PinnedSlots._take, direct.PinnedSlots._released
    monkeypatch.setattr(direct.PinnedSlots, "_take", lambda self, n: taken.append(orig_take(self, n)) or taken[-1])
    monkeypatch.setattr(direct.PinnedSlots, "_released", lambda self, i: released.append(i) or orig_rel(self, i))
    _stream(tmp_path / "model.safetensors", 4096, 2)
    slots = direct.arena_bytes(4096, 2) // direct.arena_slot_bytes(4096)
    assert len(taken) > 3 * slots and len(released) >= len(taken) - 2  # far more takes than the arena has slots
    assert set(taken) <= set(range(slots)) and extra == []


def test_without_arena_registers_one_and_unregisters_it_after_the_load(tmp_path, fake_cuda, host_registry):
    _, extra = fake_cuda
    expected = write_zoo(tmp_path / "model.safetensors")
    got, _, stats = _stream(tmp_path / "model.safetensors", 8192, 2, arena=False)
    assert {n: t.view(torch.uint8).view(-1).tolist() for n, t in got.items()} == {
        n: list(raw) for n, (_, _, raw) in expected.items()}
    need = (2 + direct.SPARE_SLOTS) * direct.arena_slot_bytes(8192)
    n = direct.arena_bytes(8192, 2)
    assert need <= n < 2 * need and n & (n - 1) == 0  # rounded up to a power of two
    assert extra == []  # not from PyTorch's pinned allocator
    gc.collect()  # runai's slots are gone once the stream ended
    assert [c[0] for c in host_registry] == ["register", "unregister"]
    assert host_registry[0][2] == n and host_registry[1][1] == host_registry[0][1]
    assert stats["pinned_bytes"] == n and stats["pinned_extra_bytes"] == 0


def test_page_locked_memory_stays_registered_while_any_view_lives(host_registry):
    from vllm_fastload.streaming.hostmem import page_locked

    t = page_locked(3 * 2**20)
    assert host_registry == [("register", t.data_ptr(), 3 * 2**20)] and t.sum().item() == 0
    piece, arr = t[4096:8192], t[:16].numpy()
    del t
    gc.collect()
    assert len(host_registry) == 1
    del piece
    gc.collect()
    assert len(host_registry) == 1  # the numpy array (what runai reads into) still uses it
    arr[0] = 1
    ptr = host_registry[0][1]
    del arr
    gc.collect()
    assert host_registry[1:] == [("unregister", ptr)]
    assert host_registry.devices == [3, 3]  # registered and unregistered with the registering device current
    with pytest.raises(ValueError, match="nbytes must be > 0"):
        page_locked(0)


def test_page_locked_falls_back_to_pytorch_when_registration_is_refused(monkeypatch, caplog):
    from vllm_fastload.streaming import hostmem

    class Refusing:
        def cudaHostRegister(self, ptr, n, flags):
            return 712  # cudaErrorHostMemoryAlreadyRegistered

    got = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing())
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(hostmem.torch, "empty",
                        lambda n, **kw: got.append((n, kw)) or torch.zeros(n, dtype=torch.uint8))
    with caplog.at_level(logging.INFO, logger="vllm.fastload"):
        t = hostmem.page_locked(2**20, device=0)
    assert got == [(2**20, {"dtype": torch.uint8, "pin_memory": True})] and t.numel() == 2**20
    assert "cudaHostRegister returned CUDA error 712" in caplog.text


def test_runai_keeps_its_own_allocator_outside_our_ring_build(tmp_path, fake_cuda):
    """While a direct stream is paused in the consumer (or kept alive by a failed load), another runai stream of the
    process must get runai's own slots (its owned=True tensors stay its caller's)."""
    from runai_model_streamer import SafetensorsStreamer
    from runai_model_streamer.file_streamer import requests_iterator as ri

    original = ri._alloc_slot
    write_zoo(tmp_path / "model.safetensors")
    h = [read_header(str(tmp_path / "model.safetensors"))]
    g = direct.stream_to_device(h, torch.device("cpu"), direct.Ring(4096, 2), StageTimes())
    next(g)  # paused inside the stream, its ring built
    assert ri._alloc_slot is original
    with SafetensorsStreamer() as s:
        s.stream_files([str(tmp_path / "model.safetensors")], device="cpu", owned=True)
        other = {n: t for n, t in s.get_tensors()}
    g2 = direct.stream_to_device(h, torch.device("cpu"), direct.Ring(4096, 2), StageTimes())
    next(g2)
    g.close()
    g2.close()  # closed in FIFO order: nothing left patched
    assert ri._alloc_slot is original and len(other) == len(h[0].tensors)


def test_a_larger_runai_slot_recarves_the_arena_instead_of_allocating(tmp_path, fake_cuda, monkeypatch):
    """runai's pads follow the mount's probed block size; when its first request is larger than the arena's slots,
    the arena is cut again for that size (no pinned memory beyond it)."""
    _, extra = fake_cuda
    expected = write_zoo(tmp_path / "model.safetensors")
    arena = torch.empty(direct.arena_bytes(8192, 2), dtype=torch.uint8)
    monkeypatch.setattr(direct, "arena_slot_bytes", lambda piece: 4096)  # slots cut too small for runai's request
    stats = {}
    got = dict(direct.stream_to_device([read_header(str(tmp_path / "model.safetensors"))], torch.device("cpu"),
                                       direct.Ring(8192, 2), StageTimes(), arena, stats))
    assert set(got) == set(expected) and extra == [] and stats["pinned_extra_bytes"] == 0


def test_split_into_pieces_cover_every_byte_once(tmp_path):
    write_zoo(tmp_path / "model.safetensors")
    h = read_header(str(tmp_path / "model.safetensors"))
    (path, offsets, sizes), = direct.split_into_pieces([h], 1000)[0]
    assert max(sizes) == 1000 and sum(sizes) == sum(t.nbytes for t in h.tensors.values())
    assert offsets[0] == 8 + h.header_len
    assert all(a + n == b for a, n, b in zip(offsets, sizes, offsets[1:]))  # contiguous, in file order
    with pytest.raises(ValueError, match="pinned_slot_bytes"):
        direct.split_into_pieces([h], 0)


def _small_tensors(path, sizes, dtype=torch.uint8):
    """A safetensors file of tensors ``s<i>`` of ``sizes[i]`` bytes each, back to back; name -> bytes."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    tensors = {f"s{i:04d}": torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for i, n in enumerate(sizes)}
    save_file(tensors, str(path))
    return {k: v.numpy().tobytes() for k, v in tensors.items()}


def test_small_tensors_back_to_back_share_ranges_of_at_most_a_slot(tmp_path):
    """2000 tensors of 48 bytes: ranges of up to 4096 bytes, each a run of whole tensors at multiples of 16 in
    it, every tensor in exactly one range at its file bytes; a tensor larger than a slot is still split."""
    _small_tensors(tmp_path / "m.safetensors", [48] * 2000 + [10000])
    h = read_header(str(tmp_path / "m.safetensors"))
    (chunks,), (places,), empty = direct.split_into_pieces([h], 4096)
    _, offsets, sizes = chunks
    assert empty == [] and max(sizes) <= 4096
    whole = [parts for parts in places if len(parts) > 1]
    assert len(whole) == -(-2000 * 48 // (4096 // 48 * 48))  # 85 tensors a range: 24 ranges, not 2000
    seen = {}
    for off, n, parts in zip(offsets, sizes, places):
        for p in parts:
            t = h.tensors[p.key[1]]
            assert off - 8 - h.header_len + p.range_offset == t.begin + p.tensor_offset
            assert p.range_offset % direct.COALESCE_ALIGN == 0 and p.range_offset + p.nbytes <= n
            seen[p.key[1]] = seen.get(p.key[1], 0) + p.nbytes
    assert seen == {name: t.nbytes for name, t in h.tensors.items()}
    assert [len(p) for p in places[-3:]] == [1, 1, 1]  # s2000: 10000 bytes in 3 pieces of its own


def test_a_tensor_off_the_alignment_or_outside_the_share_starts_a_new_range(tmp_path):
    """Tensors of 20 bytes: the second would start at byte 20 of a range (not a multiple of 16), so none share;
    with ``only`` leaving out s1, s0 and s2 are not back to back and do not share either."""
    _small_tensors(tmp_path / "m.safetensors", [20, 20, 20, 32, 32])
    h = read_header(str(tmp_path / "m.safetensors"))
    (places,) = direct.split_into_pieces([h], 4096)[1]
    assert [[p.key[1] for p in parts] for parts in places] == [["s0000"], ["s0001"], ["s0002"], ["s0003", "s0004"]]
    only = {(0, "s0000"), (0, "s0002"), (0, "s0003")}
    (places,) = direct.split_into_pieces([h], 4096, only)[1]
    assert [[p.key[1] for p in parts] for parts in places] == [["s0000"], ["s0002"], ["s0003"]]


@pytest.mark.parametrize("threads", [None, 2])
def test_many_small_tensors_cost_one_buffer_and_copy_per_range(tmp_path, fake_cuda, monkeypatch, threads):
    """3000 tensors of 64 bytes through runai's and our reader: bit-exact, and 47 device buffers, H2D copies and
    consumer waits (ranges of 4096 bytes), not one per tensor; every tensor yielded is a view of its range's
    buffer."""
    expected = _small_tensors(tmp_path / "m.safetensors", [64] * 3000)
    buffers, copies = [], []
    real_target, real_copy = direct.copy_target, StageTimes.h2d_copy
    monkeypatch.setattr(direct, "copy_target", lambda n, *a: buffers.append(n) or real_target(n, *a))
    monkeypatch.setattr(StageTimes, "h2d_copy", lambda self, *a, **k: copies.append(1) or real_copy(self, *a, **k))
    headers = [read_header(str(tmp_path / "m.safetensors"))]
    arena = torch.empty(direct.arena_bytes(4096, 4), dtype=torch.uint8)
    times, got, storages = StageTimes(), {}, set()
    for n, t in direct.stream_to_device(headers, torch.device("cpu"), direct.Ring(4096, 4, threads), times, arena):
        got[n] = t.clone()
        storages.add(t.untyped_storage().nbytes())
    assert {n: t.numpy().tobytes() for n, t in got.items()} == expected
    assert sorted(buffers) == sorted([4096] * 46 + [3000 * 64 - 46 * 4096]) and len(copies) == 47
    assert storages == {4096, 3000 * 64 - 46 * 4096}
    assert fake_cuda[0].waited == 47  # the consumer waits once per range, not per tensor
    assert times.tensors == 3000 and times.bytes == 3000 * 64


def test_unsupported_dtype_is_named(tmp_path):
    write_zoo(tmp_path / "model.safetensors")
    h = read_header(str(tmp_path / "model.safetensors"))
    assert direct.unsupported([h]) is None
    t = next(iter(h.tensors.values()))
    bad = type(h)(**{**h.__dict__, "tensors": {t.name: type(t)(**{**t.__dict__, "dtype": "F4"})}})
    assert f"tensor {t.name!r}" in direct.unsupported([bad]) and "F4" in direct.unsupported([bad])


def test_page_locked_survives_a_kernel_without_huge_pages(host_registry, monkeypatch):
    """madvise is only a hint: EINVAL (a kernel without transparent huge pages) must not fail the load."""
    import mmap as mmap_module

    from vllm_fastload.streaming import hostmem

    class NoHints(mmap_module.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(hostmem.mmap, "mmap", NoHints)
    t = hostmem.page_locked(2**20)
    assert host_registry[0] == ("register", t.data_ptr(), 2**20)


def test_a_refused_registration_does_not_reach_the_callers_thread(monkeypatch):
    """The CUDA calls run on their own short-lived thread (per-thread CUDA error state stays there)."""
    import threading

    from vllm_fastload.streaming import hostmem

    threads = []

    class Refusing:
        def cudaHostRegister(self, ptr, n, flags):
            threads.append(threading.current_thread())
            return 712

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing())
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(hostmem.torch, "empty", lambda n, **kw: torch.zeros(n, dtype=torch.uint8))
    hostmem.page_locked(2**20, device=0)
    assert threads and threads[0] is not threading.current_thread() and threads[0].name == "fastload-hostreg"


def test_changed_runai_internals_send_the_load_to_the_ring_path(monkeypatch):
    """The direct path replaces runai's requests_iterator._alloc_slot while it builds its ring: a runai release that
    renamed or re-signed it must make the load fall back to the ring path with the reason (logged at WARNING by the
    loader), not crash or misbehave inside runai."""
    from runai_model_streamer.file_streamer import requests_iterator as ri
    from runai_model_streamer.file_streamer import slot_pool

    assert direct.internals_changed() is None  # the installed runai is one the path was written for
    monkeypatch.delattr(ri, "_alloc_slot")
    why = direct.internals_changed()
    assert why.startswith(direct.INTERNALS_CHANGED) and "_alloc_slot(slot_size) is missing" in why
    assert direct.unsupported([]) == why
    monkeypatch.setattr(ri, "_alloc_slot", lambda size, pinned: None, raising=False)
    assert "['size', 'pinned']" in direct.internals_changed()
    monkeypatch.setattr(ri, "_alloc_slot", lambda slot_size: None)

    class Slot:
        __slots__ = ("buffer",)

    monkeypatch.setattr(slot_pool, "Slot", Slot)
    assert "slot_pool.Slot has slots ('buffer',)" in direct.internals_changed()


def test_loader_logs_changed_internals_at_warning(monkeypatch, caplog):
    from runai_model_streamer.file_streamer import requests_iterator as ri

    from vllm_fastload.config import StreamerConfig
    from vllm_fastload.streaming.loader import RunaiStreamerLoader

    monkeypatch.delattr(ri, "_alloc_slot")
    loader = RunaiStreamerLoader.__new__(RunaiStreamerLoader)
    loader.config = StreamerConfig.from_extra({})
    why = loader._reads_into_pinned(torch.device("cuda", 0), [])
    assert why.startswith(direct.INTERNALS_CHANGED)
