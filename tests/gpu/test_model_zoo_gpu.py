"""The model zoo's MoE and MLA rows on a GPU (vLLM 0.26): `auto` and `ipc_cache` zero_copy give the same greedy ids and
the ipc_cache engine maps (no fallback, no disk read). Before the processing-unit rule, these engines died at
their first forward (Mixtral: "assert self.moe_kernel is not None"; DeepSeek-V3: "grouped_topk ... Meta tensors")
after a load that logged success. Online FP8 of a fused-MoE layer (qwen3-moe-small-fp8online: vLLM quantizes it
while its weights load) was refused at daemon start until the daemon captured such layers as loaded
(state.capture_processing). The whole zoo with every loader: `bash benchmarks/device.sh zoo`."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from tests.gpu.conftest import NO_CUDA  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip(NO_CUDA, allow_module_level=True)
pytest.importorskip("vllm")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.mark.parametrize("name", ["mixtral-small", "deepseek-v3-small", "llama-small-gptq-act", "llama-small-awq",
                                  "llama-small-ct-fp8-tensor", "llama-small-fp8online", "gpt-oss-small-mxfp4"])
def test_zoo_row_maps_and_matches_auto(name, tmp_path_factory):
    from zoo_bench import run_model

    out = tmp_path_factory.mktemp("zoo-out")
    res = run_model(name, ["auto", "ipc_zero_copy"], tmp_path_factory.mktemp("zoo-models"), out, gmu=0.2)
    assert res["verdict"] == [], res


def test_online_fp8_moe_is_served_by_the_daemon_in_both_modes(tmp_path_factory):
    """vLLM quantizes online-FP8 fused-MoE layers while loading them; the daemon captures them as loaded and the
    engines re-process them (state.capture_processing): both modes map, with no fallback and no disk read, and
    generate. Greedy ids are not compared here: vLLM 0.26's own engine is not reproducible on this row (`auto`
    gave two different greedy sequences for one prompt in two runs of the same command; docs/benchmarks.md, model
    zoo), so an ids check would judge vLLM, not the cache."""
    from zoo_bench import run_model

    out = tmp_path_factory.mktemp("zoo-out")
    res = run_model("qwen3-moe-small-fp8online", ["ipc_zero_copy", "ipc_copy"], tmp_path_factory.mktemp("zoo-models"),
                    out, gmu=0.2)
    assert res["verdict"] == [], res
    engines = [r for r in res["rows"] if r["loader"] != "daemon"]
    assert len(engines) == 2 and all(r["result"] for r in engines), res
