"""Fan-out of runai_streamer at TP > 1 (streaming/fanout.py): the grouping and assignment logic on simulated rank
and host layouts, and real multi-process runs over gloo on CPU (the real runai reader, the real process groups):
every rank gets every tensor bit for bit, each byte is read once per host, a failing, dying or stopping rank fails
the others with its reason within the timeout. The NCCL path runs in tests/gpu on the device."""

import time

import pytest

from tests.conftest import write_zoo, zoo_digests
from tests.unit.fanout_worker import run_ranks
from vllm_fastload.streaming.fanout import assign_owners, fanout_groups


# -- pure logic ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_owners_balanced_by_bytes_and_deterministic(n):
    import random

    rng = random.Random(n)
    # Llama-like: two 1 GiB tensors (embedding, lm_head), many mid-size, some tiny, a few empty
    sizes = [2**30, 2**30] + [rng.choice([32, 8, 112]) * 2**20 for _ in range(200)] + [8192] * 65 + [0] * 3
    owner = assign_owners(sizes, n)
    assert owner == assign_owners(sizes, n)  # every rank computes the same
    assert [o for s, o in zip(sizes, owner) if s == 0] == [-1] * 3
    load = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(n)]
    assert sum(load) == sum(sizes)
    assert max(load) - min(load) <= max(sizes)  # LPT: shares differ by at most one tensor
    if n > 1:
        assert max(load) / (sum(sizes) / n) < 1.1


def test_owners_more_ranks_than_tensors():
    assert assign_owners([10, 5], 4) == [0, 1]
    with pytest.raises(ValueError):
        assign_owners([1], 0)


@pytest.mark.parametrize("ranks, hosts, expect", [
    ([0, 1, 2, 3], ["a"] * 4, [(0, 1, 2, 3)]),                           # TP=4 on one host
    ([0, 1, 2, 3], ["a", "a", "b", "b"], [(0, 1), (2, 3)]),              # TP=4 over two hosts: one group per host
    ([4, 5, 6, 7], ["b"] * 4, [(4, 5, 6, 7)]),                           # PP stage 2's TP group: its own fan-out
    ([0, 1, 2, 3], ["a", "b", "a", "b"], [(0, 2), (1, 3)]),              # ranks interleaved over hosts
    ([0, 1, 2, 3], ["a", "a", "a", "b"], [(0, 1, 2), (3,)]),             # uneven: rank 3 reads alone
    ([0], ["a"], [(0,)]),
])
def test_groups_follow_hosts(ranks, hosts, expect):
    assert fanout_groups(ranks, hosts) == expect


def test_groups_length_mismatch():
    with pytest.raises(ValueError, match="3 ranks but 2"):
        fanout_groups([0, 1, 2], ["a", "b"])


# -- real processes over gloo ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    d = tmp_path_factory.mktemp("fanout-zoo")
    expected = write_zoo(d / "a.safetensors", seed=1)
    expected_b = write_zoo(d / "b.safetensors", seed=2)  # the same names in a second shard: keys are per file
    return [str(d / "a.safetensors"), str(d / "b.safetensors")], [expected, expected_b]


def _run(tmp_path, files, world, tp, hosts, mode=None, faulty_rank=None, timeout=20.0, distributed=True):
    return run_ranks(tmp_path, files, world, tp, hosts, mode=mode, faulty_rank=faulty_rank, timeout=timeout,
                     distributed=distributed)


def test_two_ranks_get_every_tensor_bit_exact_each_byte_read_once(tmp_path, zoo):
    files, expected = zoo
    res = _run(tmp_path, files, world=2, tp=2, hosts=["h", "h"])
    total = sum(len(raw) for e in expected for _, _, raw in e.values())
    want = [zoo_digests(e) for e in expected]
    for r in res:
        assert "error" not in r and r["fan"] is not None, r
        for name, got in r["tensors"].items():
            assert sorted(map(tuple, got)) == sorted(tuple(w[name]) for w in want if name in w), name
        assert set(r["tensors"]) == set(expected[0]) | set(expected[1])
        assert r["fan"]["read_bytes"] + r["fan"]["received_bytes"] == total
    assert sum(r["fan"]["read_bytes"] for r in res) == total  # every byte read once on the host
    assert all(r["fan"]["read_bytes"] > 0 for r in res)
    assert abs(res[0]["fan"]["read_bytes"] - res[1]["fan"]["read_bytes"]) <= 1000 * 37 * 4  # <= the largest tensor


def test_tp_group_over_two_hosts_reads_once_per_host(tmp_path, zoo):
    """TP=4 whose ranks sit two per host: two fan-out groups, each reading the whole checkpoint once."""
    files, expected = zoo
    res = _run(tmp_path, files, world=4, tp=4, hosts=["a", "a", "b", "b"])
    total = sum(len(raw) for e in expected for _, _, raw in e.values())
    assert [tuple(r["fan"]["ranks"]) for r in res] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert sum(r["fan"]["read_bytes"] for r in res[:2]) == total
    assert sum(r["fan"]["read_bytes"] for r in res[2:]) == total
    want = zoo_digests(expected[0])
    for r in res:
        assert "error" not in r, r
        assert all(want[n] in got for n, got in r["tensors"].items() if n in want)


def test_rank_alone_on_its_host_reads_per_rank(tmp_path, zoo):
    files, _ = zoo
    res = _run(tmp_path, files, world=2, tp=2, hosts=["a", "b"])
    assert all(r["fan"] is None and "no other rank of the TP group [0, 1] on this host" in r["why"] for r in res)


def test_auto_on_cpu_stays_per_rank_with_reason(tmp_path, zoo):
    files, _ = zoo
    res = _run(tmp_path, files, world=2, tp=2, hosts=["h", "h"], distributed="auto")
    assert all(r["fan"] is None and "a CPU load" in r["why"] for r in res)


def test_failing_rank_fails_every_rank_with_its_reason(tmp_path, zoo):
    files, _ = zoo
    res = _run(tmp_path, files, world=2, tp=2, hosts=["h", "h"], mode="fail", faulty_rank=1)
    assert res[1]["error"] == "OSError: injected read failure on rank 1"
    assert res[0]["error"].startswith("FanoutError: ")
    assert "rank 1: OSError: injected read failure on rank 1" in res[0]["error"]
    assert '"distributed": false' in res[0]["error"]


def test_dead_rank_fails_the_others_within_the_timeout(tmp_path, zoo):
    files, _ = zoo
    t = time.perf_counter()
    res = _run(tmp_path, files, world=2, tp=2, hosts=["h", "h"], mode="die", faulty_rank=1, timeout=10.0)
    assert res[1].get("exit") == 7
    assert res[0]["error"].startswith("FanoutError: ") and res[0]["seconds"] < 30, res[0]
    assert "another rank stopped answering" in res[0]["error"] and "distributed_timeout_s=10.0 s" in res[0]["error"]
    assert time.perf_counter() - t < 90


def test_consumer_that_stops_fails_the_others(tmp_path, zoo):
    files, _ = zoo
    res = _run(tmp_path, files, world=2, tp=2, hosts=["h", "h"], mode="stop", faulty_rank=0)
    assert "error" not in res[0]  # it stopped on its own
    assert "FanoutError" in res[1]["error"] and "weight_loader stopped consuming" in res[1]["error"], res[1]


def test_ranks_that_see_different_checkpoints_read_per_rank(tmp_path, zoo):
    """One model copy per container on a shared hostname, a symlink flipped during start-up: ranks whose shard
    paths, header hashes or file identities differ must not exchange tensors (each would get the other's bytes)."""
    files, _ = zoo
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(open(files[0], "rb").read())  # the same bytes in another file: still per rank (safe)
    res = run_ranks(tmp_path, files, 2, 2, ["h", "h"], distributed=True, files_of={"1": [str(copy), files[1]]})
    for r in res:
        assert r["fan"] is None and "the ranks [0, 1] of this host see different checkpoint files" in r["why"], r


def test_plans_that_differ_at_the_first_round_fail_every_rank(tmp_path, zoo):
    """The safety net behind the check above: if the headers a rank streams differ from the others' after all, every
    rank refuses before the first broadcast (a mismatched NCCL broadcast is undefined behaviour)."""
    files, _ = zoo
    res = run_ranks(tmp_path, files, 2, 2, ["h", "h"], distributed=True, run_files_of={"1": files[:1]})
    for r in res:
        assert r["error"].startswith("FanoutError: ") and "rank groups [[0], [1]]" in r["error"], r
        assert r["fan"]["rounds"] == 0 and r["tensors"] == {}


def test_fan_out_reads_without_the_pin(monkeypatch):
    # the io_uring reader pins its thread to one CPU while it reads (uring.UringRing's pin); a fan-out's reading
    # thread also runs the NCCL broadcasts, and a thread NCCL starts there would keep that one CPU: its ring says no
    import types

    import torch

    from vllm_fastload.config import StreamerConfig
    from vllm_fastload.report import LoadReport
    from vllm_fastload.streaming import direct, loader, runai_env

    rings = []

    def stream_tensors(headers, device, ring, *args, **kw):
        rings.append(ring)
        raise RuntimeError("stream stopped here")

    monkeypatch.setattr(direct, "stream_tensors", stream_tensors)
    cfg = StreamerConfig()
    load = loader._Load(plan=None, checkpoint=types.SimpleNamespace(headers=[]),
                        report=LoadReport(load_format="runai_streamer", source="/m"),
                        reader=runai_env.LocalReader(threads=16, uring=True))
    assert load.ring(cfg).pin and load.ring(cfg).uring  # a per-rank load of this reader may pin
    fan = types.SimpleNamespace(owners=lambda entries: [], me=0)
    steps = loader.RunaiStreamerLoader._fanned_out_tensors(types.SimpleNamespace(config=cfg), load,
                                                           torch.device("cpu"), fan)
    with pytest.raises(RuntimeError, match="stream stopped here"):
        next(steps)
    assert [r.pin for r in rings] == [False] and rings[0].uring
