"""Issue 28's TP=1 read target, judged on one ``load_bench.py`` results file: our weights phase <= 0.36 s and
below instanttensor BUFFERED's, both taken as the median of every run of the call (``weights_s_runs``).

Usage: ``python benchmarks/tp1_target.py RESULTS.json [--ours runai_fastload] [--peer instanttensor_buffered]``;
prints one line per loader and the verdict; exit 0 when the call meets the target, 1 when not, 2 when a loader's
runs are missing. The target needs three such calls that meet it (``bash benchmarks/device.sh target``, three
times on one host)."""

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--ours", default="runai_fastload")
    ap.add_argument("--peer", default="instanttensor_buffered")
    a = ap.parse_args()
    with open(a.results) as f:
        results = json.load(f)
    try:
        met, line = verdict(results, a.ours, a.peer)
    except KeyError as e:
        print(f"tp1_target: {e.args[0]}", file=sys.stderr)
        return 2
    print(results.get("machine", ""))
    print(line)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
