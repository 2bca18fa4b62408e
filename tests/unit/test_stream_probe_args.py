"""benchmarks/stream_probe.py refuses bad arguments with one line naming the argument, before it touches a GPU
(adversarial pass, 2026-12-07: ``--rounds 0`` reached an IndexError after a whole warm-up load, an unknown
``--make`` shape a KeyError traceback)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def probe(*args):
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stream_probe.py"), *args], capture_output=True,
                          text=True, env=env, timeout=120)


@pytest.mark.parametrize("args, says", [
    (["--rounds", "0"], "--rounds: 0; give 1 or more"),
    (["--rounds", "-3"], "--rounds: -3; give 1 or more"),
    (["--make", "bogus"], "argument --make: invalid choice: 'bogus'"),
    (["--variants", "torch,nope"], "--variants: unknown ['nope']"),
    (["--out", "/nonexistent-folder-of-this-test/x.json"], "--out /nonexistent-folder-of-this-test/x.json: its folder "
                                                           "does not exist"),
])
def test_bad_arguments_are_named_before_any_gpu_work(tmp_path, args, says):
    p = probe("--model", str(tmp_path), *args)
    assert p.returncode != 0 and says in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
