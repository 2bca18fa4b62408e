"""The offline ``LLM(...)`` API with both load formats of vllm-fastload.

    python examples/python/offline_llm.py MODEL_DIR                 # runai_streamer
    python examples/python/offline_llm.py MODEL_DIR --ipc SOCK_DIR  # ipc_cache (start `vllm-fastload preload` first)
"""

import argparse
import json

from vllm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ipc", metavar="SOCKET_DIR", help="use ipc_cache with the daemons in this directory")
    a = ap.parse_args()
    if a.ipc:
        kw = dict(load_format="ipc_cache", model_loader_extra_config={"socket_dir": a.ipc})
    else:
        kw = dict(load_format="runai_streamer", model_loader_extra_config={"concurrency": 16})
    llm = LLM(model=a.model, enforce_eager=True, max_model_len=2048, **kw)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(json.dumps({"load_format": kw["load_format"], "text": out[0].outputs[0].text}))


if __name__ == "__main__":
    main()
