"""benchmarks/tp1_target.py: issue 28's TP=1 verdict from one load_bench results file (medians of every run)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from tp1_target import verdict  # noqa: E402


def results(ours, peer):
    return {"machine": "H100 x1", "loaders": [
        {"loader": "runai_fastload", "weights_s_runs": ours},
        {"loader": "instanttensor_buffered", "weights_s_runs": peer},
    ]}


@pytest.mark.parametrize("ours, peer, met", [
    ([0.33, 0.35, 0.40], [0.36, 0.38, 0.39], True),   # median 0.35 <= 0.36 and below 0.38
    ([0.33, 0.37, 0.37], [0.38, 0.39, 0.40], False),  # below the peer, but 0.37 > 0.36
    ([0.34, 0.35, 0.36], [0.30, 0.33, 0.35], False),  # <= 0.36, but the peer's 0.33 is lower
])
def test_the_verdict_takes_every_runs_median(ours, peer, met):
    got, line = verdict(results(ours, peer), "runai_fastload", "instanttensor_buffered")
    assert got is met
    assert ("met in this call" if met else "missed in this call") in line


def test_a_loader_without_runs_is_named(tmp_path):
    with pytest.raises(KeyError, match="instanttensor_buffered"):
        verdict(results([0.3], []), "runai_fastload", "instanttensor_buffered")
    f = tmp_path / "results.json"
    f.write_text(json.dumps(results([0.3], [])))
    p = subprocess.run([sys.executable, str(BENCH / "tp1_target.py"), str(f)], capture_output=True, text=True)
    assert p.returncode == 2 and "no weights phase of loader 'instanttensor_buffered'" in p.stderr
    f.write_text(json.dumps(results([0.33, 0.34], [0.40, 0.41])))
    p = subprocess.run([sys.executable, str(BENCH / "tp1_target.py"), str(f)], capture_output=True, text=True)
    assert p.returncode == 0 and "runai_fastload median 0.335 s" in p.stdout


def test_several_calls_need_every_one_met_on_one_machine_start(tmp_path):
    from tp1_target import verdict_of_calls

    met, unmet = results([0.33, 0.34], [0.40]), results([0.37, 0.38], [0.40])
    for r in (met, unmet):
        r["boot_id"] = "b1"
    ok, lines = verdict_of_calls([met, met, met], "runai_fastload", "instanttensor_buffered")
    assert ok and lines[-1] == "met in 3 of 3 call(s); one machine start"
    ok, lines = verdict_of_calls([met, unmet, met], "runai_fastload", "instanttensor_buffered")
    assert not ok and lines[-1].startswith("met in 2 of 3")
    assert "call 2 (H100 x1; boot b1): runai_fastload median 0.375 s" in lines[1]
    other = dict(met, boot_id="b2")
    ok, lines = verdict_of_calls([met, other, met], "runai_fastload", "instanttensor_buffered")
    assert not ok and lines[-1] == "met in 3 of 3 call(s); 2 machine starts"
    ok, lines = verdict_of_calls([met, dict(met, boot_id=None)], "runai_fastload", "instanttensor_buffered")
    assert not ok  # a call without a boot id is not known to be the same machine
    assert lines[-1] == "met in 2 of 2 call(s); a call without a boot id (not known to be one machine start)"
    files = []
    for i, r in enumerate((met, met, unmet)):
        files.append(tmp_path / f"r{i}.json")
        files[-1].write_text(json.dumps(r))
    p = subprocess.run([sys.executable, str(BENCH / "tp1_target.py"), *map(str, files[:2])], capture_output=True,
                       text=True)
    assert p.returncode == 0 and "met in 2 of 2 call(s); one machine start" in p.stdout
    p = subprocess.run([sys.executable, str(BENCH / "tp1_target.py"), *map(str, files)], capture_output=True,
                       text=True)
    assert p.returncode == 1 and "met in 2 of 3" in p.stdout


@pytest.mark.parametrize("change, says", [
    (lambda r: r["loaders"][0].update(failed_runs=2), "2 run(s) of loader 'runai_fastload' failed"),
    (lambda r: r["loaders"][0]["weights_s_runs"].append(None), "a run of loader 'runai_fastload' has no weights"),
    (lambda r: r["loaders"][1]["weights_s_runs"].append(True), "weights_s_runs holds True"),
    (lambda r: r["loaders"][1]["weights_s_runs"].append(-0.3), "weights_s_runs holds -0.3"),
    (lambda r: r["loaders"][1]["weights_s_runs"].append("0.3"), "weights_s_runs holds '0.3'"),
    (lambda r: r.update(loaders=None), "no list of loaders ('loaders')"),
])
def test_a_call_with_a_failed_or_odd_run_is_not_judged_and_the_file_is_named(tmp_path, change, says):
    """A call is judged on every round or not at all: one good run of three must not pass as the call's median."""
    good = results([0.30, 0.31, 0.32], [0.40, 0.41, 0.42])
    bad = json.loads(json.dumps(good))
    change(bad)
    files = [tmp_path / "good.json", tmp_path / "bad.json"]
    files[0].write_text(json.dumps(good))
    files[1].write_text(json.dumps(bad))
    p = subprocess.run([sys.executable, str(BENCH / "tp1_target.py"), *map(str, files)], capture_output=True,
                       text=True)
    assert p.returncode == 2 and p.stdout == "", p
    assert p.stderr.startswith(f"tp1_target: {files[1]}: ") and says in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("content, says", [
    (None, "cannot be read as JSON"),               # no such file
    ('{"loaders":', "cannot be read as JSON"),
    (b"\xff\xfe\x00", "cannot be read as JSON"),
    ("[]", "holds a JSON list, not load_bench.py's results object"),
])
def test_a_file_that_is_no_results_object_is_named_with_exit_2(tmp_path, content, says):
    f = tmp_path / "results.json"
    if isinstance(content, bytes):
        f.write_bytes(content)
    elif content is not None:
        f.write_text(content)
    p = subprocess.run([sys.executable, str(BENCH / "tp1_target.py"), str(f)], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.startswith(f"tp1_target: {f}: ") and says in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_ours_and_the_peer_must_differ():
    with pytest.raises(ValueError, match="both name 'runai_fastload'"):
        verdict(results([0.3], [0.4]), "runai_fastload", "runai_fastload")
