"""Read throughput of runai-model-streamer alone (no vLLM, no GPU copy) under several settings.

    python benchmarks/reader_probe.py DIR [--configs 'io_uring_direct:16:-1,sync_buffered:16:2GiB,...']

Each config ``strategy:concurrency:memory_limit`` runs in a fresh process (the filesystem strategy is fixed per
process); prints GB/s of iterating every tensor of every ``*.safetensors`` in DIR with ``owned=False``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import glob, sys, time, json
from runai_model_streamer import SafetensorsStreamer
files = sorted(glob.glob(sys.argv[1] + "/*.safetensors"))
t = time.perf_counter(); n = 0
with SafetensorsStreamer() as s:
    s.stream_files(files, owned=False)
    for _, x in s.get_tensors():
        n += x.numel() * x.element_size()
dt = time.perf_counter() - t
print("PROBE " + json.dumps({"bytes": n, "s": dt, "gbps": n / dt / 1e9}))
"""

DEFAULT = ("io_uring_direct:16:-1,io_uring_buffered:16:-1,sync_buffered:16:-1,sync_buffered:32:4GiB,"
           "io_uring_buffered:32:4GiB,sync_buffered:16:1GiB")


def main() -> int:
    d = sys.argv[1]
    configs = sys.argv[2] if len(sys.argv) > 2 else DEFAULT
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from vllm_fastload.config import parse_bytes

    print("| strategy | concurrency | memory_limit | s | GB/s |\n|---|---|---|---|---|")
    for c in configs.split(","):
        strat, conc, mem = c.split(":")
        env = {**os.environ, "RUNAI_STREAMER_FS_STRATEGY": strat, "RUNAI_STREAMER_CONCURRENCY": conc,
               "RUNAI_STREAMER_MEMORY_LIMIT": str(parse_bytes(mem, minimum=-1))}
        p = subprocess.run([sys.executable, "-c", CHILD, d], capture_output=True, text=True, env=env, timeout=300)
        out = p.stdout + p.stderr
        if "PROBE " not in out:
            print(f"| {strat} | {conc} | {mem} | failed | {out[-300:]!r} |", flush=True)
            continue
        r = json.loads(out.split("PROBE ", 1)[1].splitlines()[0])
        print(f"| {strat} | {conc} | {mem} | {r['s']:.2f} | {r['gbps']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
