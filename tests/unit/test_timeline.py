"""The per-copy H2D timeline (streaming/timeline.py): its account of idle copy-engine time, and that a direct load
with ``FASTLOAD_H2D_TIMELINE`` writes one row per copy (CUDA events stood in for on CPU, as in
test_direct_reader.py)."""

import itertools
import json

import pytest
import torch

from tests.conftest import assert_zoo_bit_exact, write_zoo
from tests.unit.test_direct_reader import FakeEvent, _stream, fake_cuda  # noqa: F401 - fake_cuda is a fixture
from vllm_fastload.checkpoint import read_header
from vllm_fastload.streaming import direct
from vllm_fastload.streaming.timeline import summarize
from vllm_fastload.streaming.timing import StageTimes


def test_summary_splits_idle_copy_engine_time_into_read_waits_and_issue_delays():
    rows = [
        # ask, got, issued, start, end, bytes
        [0.000, 0.010, 0.011, 0.012, 0.020, 8_000_000],  # the first read: 12 ms before the first copy starts
        [0.011, 0.011, 0.013, 0.020, 0.028, 8_000_000],  # queued behind the first: no gap
        [0.014, 0.034, 0.035, 0.036, 0.044, 8_000_000],  # gap 28-36 ms: 6 ms waiting for the read, 2 ms not
        [0.036, 0.036, 0.050, 0.051, 0.059, 8_000_000],  # gap 44-51 ms: the thread was busy until 50 ms
        [0.051, 0.051, 0.051, 0.05901, 0.067, 4_000_000],  # 10 us gap: launch
    ]
    s = summarize(rows)
    assert s["copies"] == 5 and s["bytes"] == 36_000_000
    assert s["span_s"] == pytest.approx(0.067)
    assert s["first_copy_s"] == pytest.approx(0.012)
    assert s["copying_s"] == pytest.approx(0.04 - 0.00001)
    assert s["idle_s"] == pytest.approx(0.008 + 0.007 + 0.00001)
    assert s["idle_read_s"] == pytest.approx(0.006)
    # gap 2: after the read (34 ms) the copy was issued at 35 ms -> 1 ms busy, 1 ms launch; gap 3: 6 ms busy
    assert s["idle_issue_s"] == pytest.approx(0.001 + 0.006)
    assert s["idle_launch_s"] == pytest.approx(0.001 + 0.001 + 0.00001)
    assert s["copy_gb_per_s"] == pytest.approx(36_000_000 / (0.04 - 0.00001) / 1e9, rel=1e-3)
    assert [g["copy"] for g in s["largest_gaps"]] == [2, 3]
    assert s["largest_gaps"][0]["read_wait_s"] == pytest.approx(0.006)
    assert summarize([]) == {}


class ClockedEvent(FakeEvent):
    """A stand-in event that remembers when it was recorded (one tick per record) and gives elapsed ms."""
    ticks = itertools.count()

    def record(self, stream=None):
        super().record(stream)
        self.t = next(self.ticks) * 1e-4

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


@pytest.mark.parametrize("threads", [None, 2])
def test_a_direct_load_with_the_variable_set_writes_one_row_per_copy(tmp_path, fake_cuda, monkeypatch,  # noqa: F811
                                                                      threads):
    monkeypatch.setattr(torch.cuda, "Event", ClockedEvent)
    out = tmp_path / "t" / "timeline.json"
    monkeypatch.setenv("FASTLOAD_H2D_TIMELINE", str(out))
    expected = write_zoo(tmp_path / "model.safetensors")
    piece = 4096
    if threads is None:
        got, times, stats = _stream(tmp_path / "model.safetensors", piece, 3)
    else:
        times, stats = StageTimes(), {}
        arena = torch.empty(direct.arena_bytes(piece, 3), dtype=torch.uint8)
        got = {n: t.clone() for n, t in direct.stream_to_device(
            [read_header(str(tmp_path / "model.safetensors"))], torch.device("cpu"),
            direct.Ring(piece, 3, threads=threads), times, arena, stats)}
    assert_zoo_bit_exact(got, expected)
    doc = json.loads(out.read_text())
    _, where, _ = direct.split_into_pieces([read_header(str(tmp_path / "model.safetensors"))], piece)
    rows = doc["copies"]
    assert sum(r[5] for r in rows) == times.bytes == sum(len(raw) for _, _, raw in expected.values())
    assert len(rows) == sum(len(places) for places in where) > 10  # one copy per planned range
    for ask, got_s, issued, start, end, n in rows:
        assert ask <= got_s <= issued and start < end and n > 0
    assert [r[3] for r in rows] == sorted(r[3] for r in rows)  # issue order is GPU order on one stream
    assert doc["summary"]["copies"] == len(rows) and doc["summary"]["bytes"] == times.bytes
    assert stats["h2d_timeline"] == str(out)
    assert times.h2d_s == pytest.approx(sum(r[4] - r[3] for r in rows))  # every copy timed, none estimated
    assert times.timeline is None  # written once, then dropped


def test_without_the_variable_no_timeline_is_kept(tmp_path, fake_cuda, monkeypatch):  # noqa: F811
    monkeypatch.delenv("FASTLOAD_H2D_TIMELINE", raising=False)
    write_zoo(tmp_path / "model.safetensors")
    _, times, stats = _stream(tmp_path / "model.safetensors", 4096, 3)
    assert "h2d_timeline" not in stats and times.timeline is None


def test_a_timeline_that_cannot_be_written_leaves_the_load_whole(tmp_path, fake_cuda, monkeypatch, caplog):  # noqa: F811
    """The diagnostic's file is a directory: the load still hands out every tensor and says why at WARNING."""
    import logging

    monkeypatch.setattr(torch.cuda, "Event", ClockedEvent)
    monkeypatch.setenv("FASTLOAD_H2D_TIMELINE", str(tmp_path))  # a directory: write_text raises
    expected = write_zoo(tmp_path / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="vllm.fastload"):
        got, times, _ = _stream(tmp_path / "model.safetensors", 4096, 3)
    assert_zoo_bit_exact(got, expected)
    assert times.timeline is None
    assert any("could not write the H2D timeline" in r.getMessage() and str(tmp_path) in r.getMessage()
               for r in caplog.records)
