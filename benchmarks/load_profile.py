"""Where vLLM's "Model loading took" goes: one ``LLM()`` in this process under cProfile (issue 16, item 3).

    python benchmarks/load_profile.py --model DIR --load-format ipc_cache [--extra JSON] [--daemon] [--out DIR]

``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's engine core (and so the model runner's ``load_model``) in this
process, so cProfile sees it. Writes ``profile.txt``: the functions under the model runner's ``load_model`` sorted by
cumulative seconds, and the callees of ``load_model`` itself; ``--daemon`` starts ``vllm-fastload preload`` for the
model first (ipc_cache). cProfile adds overhead to Python-heavy code: compare shares, not absolute seconds, with
``load_bench.py``'s figures.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--load-format", required=True)
    ap.add_argument("--extra", default="{}", help="--model-loader-extra-config JSON")
    ap.add_argument("--daemon", action="store_true", help="start vllm-fastload preload first (ipc_cache)")
    ap.add_argument("--out", type=Path, default=Path("profile-out"))
    a = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    a.out.mkdir(parents=True, exist_ok=True)
    extra = json.loads(a.extra)
    daemon = None
    if a.daemon:
        sys.path.insert(0, str(HERE.parent / "src"))
        from vllm_fastload.servers import PreloadDaemon

        sock = Path(tempfile.mkdtemp(prefix="flprof", dir="/tmp"))
        daemon = PreloadDaemon(str(a.model), sock, ["--max-model-len", "1024"], log_path=a.out / "preload.log")
        if not daemon.wait_ready():
            daemon.stop()
            raise SystemExit("preload daemon exited:\n" + daemon.log()[-4000:])
        extra.setdefault("socket_dir", str(sock))
    try:
        from vllm import LLM, SamplingParams

        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        llm = LLM(model=str(a.model), load_format=a.load_format, enforce_eager=True, skip_tokenizer_init=True,
                  max_model_len=1024, gpu_memory_utilization=0.5, model_loader_extra_config=extra)
        prof.disable()
        llm_s = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": [1, 450, 783]}], SamplingParams(temperature=0, max_tokens=1,
                                                                            detokenize=False))
        first_token_s = time.perf_counter() - t
    finally:
        if daemon is not None:
            daemon.stop()
    stats = pstats.Stats(prof)
    buf = io.StringIO()
    stats.stream = buf
    print(f"LLM() {llm_s:.2f} s under cProfile, first token {first_token_s:.3f} s, load format {a.load_format}",
          file=buf)
    stats.sort_stats("cumulative").print_callees(r"model_runner.py.*\(load_model\)|gpu_model_runner.py.*\(load_model\)")
    stats.sort_stats("cumulative").print_stats(r"model_loader|vllm_fastload|model_runner", 45)
    (a.out / "profile.txt").write_text(buf.getvalue())
    print(buf.getvalue()[:20000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
