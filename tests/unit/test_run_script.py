"""tests.conftest.run_script: a script cut short by the timeout is stopped with SIGTERM, so its trap stops the
servers it started (subprocess.run's SIGKILL left the s3-local example's moto and vLLM running)."""

import os
import subprocess

import pytest

from tests.conftest import run_script


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


def test_a_timed_out_script_stops_what_it_started(tmp_path):
    pidfile = tmp_path / "child.pid"
    script = tmp_path / "s.sh"
    script.write_text(f"""set -u
sleep 300 & child=$!
echo $child > {pidfile}
trap 'kill $child; wait $child; echo cleaned > {tmp_path / "trap.txt"}' EXIT
trap 'exit 130' INT TERM
wait $child
""")
    with pytest.raises(subprocess.TimeoutExpired):
        run_script(["bash", str(script)], dict(os.environ), timeout_s=1)
    child = int(pidfile.read_text())
    assert (tmp_path / "trap.txt").read_text().strip() == "cleaned"  # the script's own cleanup ran
    assert not _alive(child)


def test_a_finished_script_gives_its_output_and_code(tmp_path):
    p = run_script(["bash", "-c", "echo out; echo err >&2; exit 3"], dict(os.environ), timeout_s=30)
    assert (p.returncode, p.stdout, p.stderr) == (3, "out\n", "err\n")
