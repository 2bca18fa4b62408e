"""Which CUDA IPC mechanism for ipc_cache? Legacy cudaIpc handles (PyTorch reductions) vs VMM POSIX fds.

For each mechanism an exporter process allocates one buffer (``--gib``, random bytes) and hands it to a consumer
process over a Unix socket (legacy: the handle bytes; VMM: the fd with SCM_RIGHTS). The consumer times open+map,
checks the bytes (sum of the buffer as int64 equals the exporter's), then the exporter is SIGKILLed and the
consumer checks the bytes again (does the memory outlive its exporter?). Also tried with the exporter under
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``. Prints a Markdown table. Needs one CUDA GPU.

    python3 benchmarks/ipc_probe.py [--gib 4]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))


def exporter(kind: str, path: str, gib: float) -> None:
    import torch

    torch.cuda.set_device(0)
    n = int(gib * 2**30)
    g = torch.Generator(device="cuda").manual_seed(1)
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
    total = int(buf.sum(dtype=torch.int64))
    torch.cuda.synchronize()
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)
    print("READY", flush=True)
    conn, _ = srv.accept()
    if kind == "legacy":
        dev, handle, size, off, rc_h, rc_off, ev_h, ev_sync = buf.untyped_storage()._share_cuda_()
        msg = {"dev": dev, "handle": base64.b64encode(handle).decode(), "size": size, "off": off,
               "rc_h": base64.b64encode(rc_h).decode(), "rc_off": rc_off,
               "ev_h": base64.b64encode(ev_h or b"").decode(), "ev_sync": ev_sync, "n": n, "sum": total}
        conn.sendall(json.dumps(msg).encode() + b"\n")
    else:
        from vllm_fastload.ipc.memory.cuda_vmm import VmmBuffer

        vb = VmmBuffer.allocate(0, n)
        vb.tensor()[:n].copy_(buf)
        torch.cuda.synchronize()
        del buf
        fd = vb.export_fd()
        socket.send_fds(conn, [json.dumps({"size": vb.size, "n": n, "sum": total}).encode() + b"\n"], [fd])
        os.close(fd)
    time.sleep(3600)


def consumer(kind: str, path: str, export_pid: int) -> dict:
    import torch

    torch.cuda.set_device(0)
    torch.cuda.synchronize()
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    t0 = time.perf_counter()
    if kind == "legacy":
        msg = json.loads(s.makefile().readline())
        st = torch.UntypedStorage._new_shared_cuda(
            msg["dev"], base64.b64decode(msg["handle"]), msg["size"], msg["off"], base64.b64decode(msg["rc_h"]),
            msg["rc_off"], base64.b64decode(msg["ev_h"]) or None, msg["ev_sync"])
        t = torch.empty(0, dtype=torch.uint8, device="cuda").set_(st)[: msg["n"]]
    else:
        from vllm_fastload.ipc.memory.cuda_vmm import VmmBuffer

        data, fds, _, _ = socket.recv_fds(s, 4096, 1)
        msg = json.loads(data.decode())
        vb = VmmBuffer.import_fd(0, fds[0], msg["size"])
        t = vb.tensor()[: msg["n"]]
    torch.cuda.synchronize()
    open_s = time.perf_counter() - t0
    ok1 = int(t.sum(dtype=torch.int64)) == msg["sum"]
    os.kill(export_pid, signal.SIGKILL)
    time.sleep(2.0)
    try:
        ok2 = int(t.sum(dtype=torch.int64)) == msg["sum"]
        torch.cuda.synchronize()
        after = "bytes intact" if ok2 else "bytes CHANGED"
    except Exception as e:  # noqa: BLE001
        after = f"error: {type(e).__name__}: {str(e)[:80]}"
    free, total = torch.cuda.mem_get_info()
    return {"open_map_ms": round(open_s * 1000, 2), "bytes_ok": ok1, "after_exporter_sigkill": after,
            "gpu_used_gib_after": round((total - free) / 2**30, 2)}


def run(kind: str, gib: float, expandable: bool) -> dict:
    d = tempfile.mkdtemp()
    path = os.path.join(d, "s")
    env = dict(os.environ)
    if expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    ex = subprocess.Popen([sys.executable, __file__, "--role", "exporter", "--kind", kind, "--path", path,
                           "--gib", str(gib)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = ex.stdout.readline()
        if "READY" not in line:
            return {"error": ex.stderr.read()[-300:]}
        c = subprocess.run([sys.executable, __file__, "--role", "consumer", "--kind", kind, "--path", path,
                            "--pid", str(ex.pid)], capture_output=True, text=True, timeout=300)
        if c.returncode != 0:
            return {"error": (c.stderr or c.stdout)[-300:].replace("\n", " ")}
        return json.loads(c.stdout.strip().splitlines()[-1])
    finally:
        if ex.poll() is None:
            ex.kill()
        ex.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="main")
    ap.add_argument("--kind", default="vmm")
    ap.add_argument("--path")
    ap.add_argument("--pid", type=int)
    ap.add_argument("--gib", type=float, default=4.0)
    a = ap.parse_args()
    if a.role == "exporter":
        exporter(a.kind, a.path, a.gib)
    elif a.role == "consumer":
        print(json.dumps(consumer(a.kind, a.path, a.pid)), flush=True)
    else:
        print(f"| mechanism | exporter allocator | open+map ms ({a.gib:g} GiB) | bytes | after exporter SIGKILL "
              f"| GPU used after (GiB) |")
        print("|---|---|---|---|---|---|")
        for kind in ("legacy", "vmm"):
            for exp in (False, True):
                r = run(kind, a.gib, exp)
                alloc = "expandable_segments" if exp else "default"
                if "error" in r:
                    print(f"| {kind} | {alloc} | error: {r['error'][:160]} | | | |", flush=True)
                else:
                    print(f"| {kind} | {alloc} | {r['open_map_ms']} | {'ok' if r['bytes_ok'] else 'WRONG'} | "
                          f"{r['after_exporter_sigkill']} | {r['gpu_used_gib_after']} |", flush=True)


if __name__ == "__main__":
    main()
