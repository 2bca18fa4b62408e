"""streaming.pagecache on CPU, with stand-ins for cudaHostRegister / cudaHostUnregister: the regions registered in
file order, ranges handed out only once their regions are, the bytes the file's, refusals named, everything
unregistered and unmapped after."""

import mmap
import os
import threading

import pytest
import torch

from vllm_fastload.streaming import pagecache

PAGE = mmap.PAGESIZE


def _files(tmp_path, sizes):
    paths = []
    for i, n in enumerate(sizes):
        p = tmp_path / f"s{i}.bin"
        p.write_bytes(os.urandom(n))
        paths.append(str(p))
    return paths


def test_ranges_are_the_files_bytes_and_every_region_is_unregistered(tmp_path):
    paths = _files(tmp_path, [5 * PAGE + 17, 0, 2 * PAGE])
    registered, unregistered = [], []
    shards = pagecache.RegisteredShards(paths, lambda p, n: registered.append((p, n)) or 0, lambda p:
                                        unregistered.append(p) or 0, 2 * PAGE, 3)
    data = open(paths[0], "rb").read()
    got = shards.host(0, 2 * PAGE + 5, 2 * PAGE - 9)  # inside the second region
    assert bytes(got.numpy()) == data[2 * PAGE + 5:4 * PAGE - 4]
    with pytest.raises(ValueError, match=rf"bytes \[{PAGE - 5}, {2 * PAGE + 4}\) of {paths[0]} lie in two"):
        shards.host(0, PAGE - 5, PAGE + 9)  # a copy across two registrations: CUDA refuses it
    assert bytes(shards.host(2, 0, 2 * PAGE).numpy()) == open(paths[2], "rb").read()
    shards.host(0, 5 * PAGE, 17)
    del got
    shards.close()
    # shard 0: regions of 2, 2 and 1 (+17 bytes) pages; the empty shard none; shard 2: one
    assert sorted(n for _, n in registered) == [PAGE + 17, 2 * PAGE, 2 * PAGE, 2 * PAGE]
    assert sorted(unregistered) == sorted(p for p, _ in registered)


def test_a_refused_region_is_named_and_nothing_stays_registered(tmp_path):
    paths = _files(tmp_path, [4 * PAGE])
    unregistered = []
    base = {}

    def register(p, n):
        base.setdefault("p", p)
        return 1 if p != base["p"] else 0  # the second region is refused

    shards = pagecache.RegisteredShards(paths, register, lambda p: unregistered.append(p) or 0, 2 * PAGE, 1)
    shards.host(0, 0, PAGE)
    with pytest.raises(pagecache.RegistrationRefused, match=rf"{paths[0]} at byte {2 * PAGE} returned CUDA error 1"):
        shards.host(0, 2 * PAGE, 2 * PAGE)
    shards.close()
    assert unregistered == [base["p"]]


def test_a_range_waits_for_its_regions(tmp_path):
    paths = _files(tmp_path, [4 * PAGE])
    gate = threading.Event()

    def register(p, n):
        gate.wait(5)
        return 0

    shards = pagecache.RegisteredShards(paths, register, lambda p: 0, PAGE, 2)
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("t", shards.host(0, 3 * PAGE, PAGE)))
    th.start()
    th.join(0.2)
    assert th.is_alive() and "t" not in out  # no region registered yet
    gate.set()
    th.join(5)
    assert out["t"].numel() == PAGE and shards.wait_s > 0.1
    del out["t"]
    shards.close()


def test_region_must_be_whole_pages(tmp_path):
    with pytest.raises(ValueError, match="multiple of the page size"):
        pagecache.RegisteredShards(_files(tmp_path, [PAGE]), lambda p, n: 0, lambda p: 0, PAGE + 1, 1)


def test_refused_first_region_falls_back_to_the_ring_said_at_info(tmp_path, monkeypatch, caplog):
    from vllm_fastload.streaming import direct

    monkeypatch.setattr(pagecache, "cuda_register", lambda device: (lambda p, n: 801, lambda p: 0))
    path = _files(tmp_path, [3 * PAGE])[0]
    chunks = [(path, [8], [100])]
    with caplog.at_level("INFO", logger="vllm.fastload"):
        assert direct._pagecache_pieces(chunks, torch.device("cpu"), None, {}) is None
    assert f"cudaHostRegister of {path} at byte 0 returned CUDA error 801" in caplog.text
    assert "reading through the pinned ring" in caplog.text


def test_close_later_unregisters_on_a_thread(tmp_path):
    paths = _files(tmp_path, [2 * PAGE])
    unregistered = []
    shards = pagecache.RegisteredShards(paths, lambda p, n: 0, lambda p: unregistered.append(p) or 0, PAGE, 1)
    shards.host(0, 0, PAGE)
    shards.host(0, PAGE, PAGE)
    th = shards.close_later()
    th.join(5)
    assert not th.is_alive() and len(unregistered) == 2


def test_a_registration_started_early_is_handed_to_the_load_of_the_same_shards_only(tmp_path, monkeypatch):
    paths = _files(tmp_path, [2 * PAGE, PAGE])
    registered, unregistered = [], []
    monkeypatch.setattr(pagecache, "cuda_register",
                        lambda device: (lambda p, n: registered.append(p) or 0, lambda p: unregistered.append(p) or 0))
    pagecache.start_early(paths, 0)
    early = pagecache.take_early(paths)
    assert isinstance(early, pagecache.RegisteredShards) and pagecache.take_early(paths) is None
    assert bytes(early.host(1, 0, PAGE).numpy()) == open(paths[1], "rb").read()
    early.close()
    pagecache.start_early(paths, 0)
    assert pagecache.take_early(paths[:1]) is None  # other shards: dropped, unregistered on a thread
    for _ in range(100):  # what the dropped one registered before it was stopped (none to both regions)
        if sorted(unregistered) == sorted(registered):
            break
        threading.Event().wait(0.02)
    assert sorted(unregistered) == sorted(registered) and len(registered) >= 2 and pagecache._EARLY == []


def test_whole_files_makes_each_shard_one_registration(tmp_path):
    paths = _files(tmp_path, [3 * PAGE + 1, PAGE, 0])
    region = pagecache.whole_files(paths)
    assert region == 4 * PAGE
    registered = []
    shards = pagecache.RegisteredShards(paths, lambda p, n: registered.append(n) or 0, lambda p: 0, region, 1)
    shards.host(0, 5, 3 * PAGE - 4)
    shards.host(1, 0, PAGE)
    shards.close()
    assert sorted(registered) == [PAGE, 3 * PAGE + 1]


def test_a_registration_that_raises_is_a_refusal_naming_the_error(tmp_path):
    paths = _files(tmp_path, [PAGE])

    def register(p, n):
        raise RuntimeError("no CUDA runtime")

    shards = pagecache.RegisteredShards(paths, register, lambda p: 0, PAGE, 1)
    with pytest.raises(pagecache.RegistrationRefused, match="returned RuntimeError: no CUDA runtime"):
        shards.host(0, 0, 10)
    shards.close()
