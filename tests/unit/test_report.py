import json

from vllm_fastload.report import LoadReport


def test_line_and_json(tmp_path, caplog):
    r = LoadReport(load_format="runai_streamer", source="/m", tensors=272, bytes=2 * 2**30, wall_s=2.0,
                   read_wait_s=1.5, fingerprint="0123456789ab")
    path = tmp_path / "sub" / "report.json"
    with caplog.at_level("INFO", logger="vllm.fastload"):
        r.emit(str(path))
    line = ("fastload: runai_streamer loaded 272 tensors (2.00 GiB) from /m in 2.00 s (1.07 GB/s), "
            "fingerprint 0123456789ab")
    assert caplog.records[-1].message == line
    d = json.loads(path.read_text())
    assert d["line"] == line and d["fallback_reason"] is None and d["format_used"] == "runai_streamer"
    assert d["bytes"] == 2 * 2**30 and d["tensors"] == 272 and d["gb_per_s"] == round(2 * 2**30 / 2 / 1e9, 4)
    assert [p.name for p in path.parent.iterdir()] == ["report.json"]  # no temporary left behind


def test_fallback_line():
    r = LoadReport(load_format="runai_streamer", source="/m", format_used="auto", wall_s=1.0,
                   fallback_reason="no *.safetensors files in /m")
    assert "fell back to load format 'auto' (no *.safetensors files in /m)" in r.line()


def test_stage_times_feed_the_report():
    """StageTimes hands every figure over by name: report fields set, declared stages into extra (rounded),
    stages the path does not have left out."""
    from vllm_fastload.streaming.timing import StageTimes

    t = StageTimes(read_wait_s=0.5, bytes=4096, tensors=3).measures("slot_wait_s", "h2d_s")
    t.slot_wait_s += 0.123456
    r = LoadReport(load_format="runai_streamer", source="/m")
    t.feed(r)
    assert (r.read_wait_s, r.bytes, r.tensors) == (0.5, 4096, 3)
    assert r.extra == {"slot_wait_s": 0.1235, "h2d_s": 0.0}  # no memcpy_s / consumer_wait_s: not this path's
