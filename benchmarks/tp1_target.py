"""Issue 28's TP=1 read target, judged on ``load_bench.py`` results files: our weights phase <= 0.36 s and
below instanttensor BUFFERED's, both taken as the median of every run of the call (``weights_s_runs``).

Usage: ``python benchmarks/tp1_target.py RESULTS.json [RESULTS.json ...] [--ours runai_fastload] [--peer
instanttensor_buffered]``; prints one line per call and the verdict. The issue asks for three calls that meet it on
one host (``bash benchmarks/device.sh target``, three times on one warm machine): given several files, the verdict
also says how many met it and whether they come from one machine start (the results' ``boot_id``). Exit 0 when
every call given meets the target (and, with several, all come from one machine start), 1 when not, 2 when a
loader's runs are missing."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

#: The weights phase issue 28 asks for at TP=1 on the 16 GB model, in seconds.
TARGET_S = 0.36


def verdict(results: dict, ours: str, peer: str) -> tuple[bool, str]:
    """``(met, line)`` for one results file (``load_bench.py``'s ``results.json`` as a dict); raises KeyError
    naming a loader with no weights phase in ``results``."""
    medians = {}
    for name in (ours, peer):
        runs = [r for r in results["loaders"] if r.get("loader") == name]
        weights = [w for r in runs for w in (r.get("weights_s_runs") or []) if w is not None]
        if not weights:
            raise KeyError(f"no weights phase of loader {name!r} in these results")
        medians[name] = statistics.median(weights)
    o, p = medians[ours], medians[peer]
    met = o <= TARGET_S and o < p
    return met, (f"{ours} median {o:.3f} s, {peer} median {p:.3f} s: target (<= {TARGET_S} s and below the peer) "
                 f"{'met' if met else 'missed'} in this call")


def verdict_of_calls(calls: list[dict], ours: str, peer: str) -> tuple[bool, list[str]]:
    """``(met, lines)`` over several results files (dicts, one per device call, in order): one line per call
    (its machine and :func:`verdict`'s line) and a last line counting the calls that met the target and saying
    whether every call names the same ``boot_id`` (one machine start; a file without one counts as another
    machine). ``met``: every call met it, and with more than one call they share one boot. Raises KeyError as
    :func:`verdict` does."""
    lines, hits = [], 0
    for i, results in enumerate(calls, 1):
        met, line = verdict(results, ours, peer)
        hits += met
        lines.append(f"call {i} ({results.get('machine', 'machine unknown')}; boot {results.get('boot_id')}): {line}")
    boots = {r.get("boot_id") for r in calls}
    one_host = len(calls) == 1 or (len(boots) == 1 and None not in boots)
    lines.append(f"met in {hits} of {len(calls)} call(s); "
                 + ("one machine start" if one_host else f"{len(boots)} machine starts (or a boot id unknown)"))
    return hits == len(calls) and one_host, lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="load_bench.py results.json of each call")
    ap.add_argument("--ours", default="runai_fastload")
    ap.add_argument("--peer", default="instanttensor_buffered")
    a = ap.parse_args()
    calls = []
    for path in a.results:
        with open(path) as f:
            calls.append(json.load(f))
    try:
        met, lines = verdict_of_calls(calls, a.ours, a.peer)
    except KeyError as e:
        print(f"tp1_target: {e.args[0]}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
