"""Issue 28's TP=1 read target, judged on ``load_bench.py`` results files: our weights phase <= 0.36 s and
below instanttensor BUFFERED's, both taken as the median of every run of the call (``weights_s_runs``).

Usage: ``python benchmarks/tp1_target.py RESULTS.json [RESULTS.json ...] [--ours runai_fastload] [--peer
instanttensor_buffered]``; prints one line per call and the verdict. The issue asks for three calls that meet it on
one host (``bash benchmarks/device.sh target``, three times on one warm machine): given several files, the verdict
also says how many met it and whether they come from one machine start (the results' ``boot_id``). Exit 0 when
every call given meets the target (and, with several, all come from one machine start), 1 when not, 2 when a call
cannot be judged (a file that is no results object, a loader without runs, a run that failed or has no weights
phase: the target asks for every round), with one line naming the file and what is wrong."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

#: The weights phase issue 28 asks for at TP=1 on the 16 GB model, in seconds.
TARGET_S = 0.36


def _weights(results: dict, name: str) -> list[float]:
    """Every run's weights phase of loader ``name`` in ``results``, in seconds. Raises KeyError naming a loader
    with no run, ValueError for a run that failed or has no weights phase (a call with a missing run is not
    judged on the runs left: the target asks for every round) or a value that is no positive finite number."""
    if not isinstance(results, dict) or not isinstance(results.get("loaders"), list):
        raise ValueError("no list of loaders ('loaders'): not a results.json of load_bench.py")
    runs = [r for r in results["loaders"] if isinstance(r, dict) and r.get("loader") == name]
    weights = [w for r in runs for w in (r.get("weights_s_runs") or [])]
    if not weights:
        raise KeyError(f"no weights phase of loader {name!r} in these results")
    failed = sum(r.get("failed_runs") or 0 for r in runs)
    if failed:
        raise ValueError(f"{failed} run(s) of loader {name!r} failed (failed_runs): the call cannot be judged on "
                         f"the runs left; run it again")
    for w in weights:
        if w is None:
            raise ValueError(f"a run of loader {name!r} has no weights phase (null in weights_s_runs): the call "
                             f"cannot be judged on the runs left; see that run's log_tail")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < float("inf"):
            raise ValueError(f"loader {name!r}: weights_s_runs holds {w!r}, not a positive number of seconds")
    return weights


def verdict(results: dict, ours: str, peer: str) -> tuple[bool, str]:
    """``(met, line)`` for one results file (``load_bench.py``'s ``results.json`` as a dict); raises KeyError
    naming a loader with no weights phase in ``results``, ValueError as :func:`_weights` does and for ``ours``
    equal to ``peer``."""
    if ours == peer:
        raise ValueError(f"--ours and --peer both name {ours!r}: the target compares two loaders")
    medians = {name: statistics.median(_weights(results, name)) for name in (ours, peer)}
    o, p = medians[ours], medians[peer]
    met = o <= TARGET_S and o < p
    return met, (f"{ours} median {o:.3f} s, {peer} median {p:.3f} s: target (<= {TARGET_S} s and below the peer) "
                 f"{'met' if met else 'missed'} in this call")


def verdict_of_calls(calls: list[dict], ours: str, peer: str,
                     names: list[str] | None = None) -> tuple[bool, list[str]]:
    """``(met, lines)`` over several results files (dicts, one per device call, in order; ``names`` their paths,
    for errors): one line per call (its machine and :func:`verdict`'s line) and a last line counting the calls
    that met the target and saying whether every call names the same ``boot_id`` (one machine start; a file
    without one counts as another machine). ``met``: every call met it, and with more than one call they share one
    boot. Raises KeyError / ValueError as :func:`verdict` does, naming the file (or the call's number)."""
    lines, hits = [], 0
    for i, results in enumerate(calls, 1):
        try:
            met, line = verdict(results, ours, peer)
        except (KeyError, ValueError) as e:
            raise type(e)(f"{names[i - 1] if names else f'call {i}'}: {e.args[0]}") from None
        hits += met
        lines.append(f"call {i} ({results.get('machine', 'machine unknown')}; boot {results.get('boot_id')}): {line}")
    boots = {b if isinstance(b := r.get("boot_id"), str) and b else None for r in calls}
    if len(calls) == 1 or (len(boots) == 1 and None not in boots):
        where = "one machine start"
    elif None in boots:
        where = "a call without a boot id (not known to be one machine start)"
    else:
        where = f"{len(boots)} machine starts"
    lines.append(f"met in {hits} of {len(calls)} call(s); {where}")
    return hits == len(calls) and where == "one machine start", lines


def _read(path: str) -> dict:
    """The results file at ``path`` as a dict; raises ValueError naming the file for one that cannot be read or is
    no JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(results, dict):
        raise ValueError(f"{path}: holds a JSON {type(results).__name__}, not load_bench.py's results object")
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="load_bench.py results.json of each call")
    ap.add_argument("--ours", default="runai_fastload")
    ap.add_argument("--peer", default="instanttensor_buffered")
    a = ap.parse_args()
    try:
        calls = [_read(path) for path in a.results]
        met, lines = verdict_of_calls(calls, a.ours, a.peer, a.results)
    except (KeyError, ValueError) as e:
        print(f"tp1_target: {e.args[0]}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
