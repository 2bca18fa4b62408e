"""One rank of a simulated fan-out group (run as ``python -m tests.unit.fanout_worker ARGS_JSON``).

Starts torch.distributed (gloo, file:// rendezvous), stands in for vLLM's TP group, calls the real
``fanout.negotiate`` and ``Fanout.run`` over the real runai reader on CPU, and writes what this rank received
(name -> dtype, shape, sha256 of the bytes) and its statistics to ``out``. ``mode`` injects a fault:
``fail`` (this rank's reader raises after 2 tensors), ``die`` (the process exits after 2 tensors),
``stop`` (the consumer stops iterating after 2 tensors). ``device``: ``cpu`` (gloo carries the tensors) or
``cuda`` (the pinned direct reader; tensors over NCCL with one GPU per rank, or over gloo when ``gpu`` puts
several ranks on one GPU, which NCCL refuses).
"""

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]


def run_ranks(tmp_path, files, world, tp, hosts, mode=None, faulty_rank=None, **kw) -> list[dict]:
    """Start ``world`` worker processes (one per rank, ``tp`` ranks per TP group, ``hosts[r]`` the simulated host
    of rank ``r``), ``mode`` injected on ``faulty_rank``; other keys go to every worker (``timeout``,
    ``distributed``, ``device``, ``gpus``, ``data_backend``, ``piece``). Returns each rank's output (or its exit
    code and log when it wrote none). Kills only the processes it started, also when it fails."""
    init = f"file://{tmp_path}/rdzv-{time.monotonic_ns()}"
    procs, outs = [], []
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        for r in range(world):
            out = Path(tmp_path) / f"rank{r}-{time.monotonic_ns()}.json"
            args = {"rank": r, "world": world, "tp": tp, "init": init, "hosts": hosts, "files": files,
                    "out": str(out), "mode": mode if r == faulty_rank else None, **kw}
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.unit.fanout_worker", json.dumps(args)],
                                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
            outs.append(out)
        results = []
        for p, out in zip(procs, outs):
            log, _ = p.communicate(timeout=180)
            results.append(json.loads(out.read_text()) if out.exists() else {"exit": p.returncode, "log": log[-3000:]})
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def main() -> int:
    a = json.loads(sys.argv[1])
    import torch
    import torch.distributed as dist

    from vllm_fastload.checkpoint import read_header
    from vllm_fastload.streaming import direct, fanout
    from vllm_fastload.streaming.timing import StageTimes

    rank, world = a["rank"], a["world"]
    device = torch.device(a.get("device", "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(a["gpus"][rank])
        device = torch.device("cuda", a["gpus"][rank])
    dist.init_process_group("gloo", init_method=a["init"], rank=rank, world_size=world)
    # vLLM's TP groups: consecutive blocks of tp ranks (as vLLM lays them out), each with a gloo CPU group
    tp = a["tp"]
    blocks = [list(range(b, b + tp)) for b in range(0, world, tp)]
    made = [dist.new_group(b, backend="gloo") for b in blocks]  # every rank creates every group, as vLLM does
    data = made
    if a.get("data_backend", "gloo") != "gloo":
        data = [dist.new_group(b, backend=a["data_backend"]) for b in blocks]
    mine = next(i for i, b in enumerate(blocks) if rank in b)
    group = SimpleNamespace(ranks=blocks[mine], world_size=tp, rank_in_group=blocks[mine].index(rank),
                            cpu_group=made[mine], device_group=data[mine])
    fanout.host_identity = lambda: a["hosts"][rank]
    headers = [read_header(p) for p in a.get("files_of", {}).get(str(rank), a["files"])]
    fan, why = fanout.negotiate(a.get("distributed", True), device, a.get("timeout", 20.0), tp=group, headers=headers)
    out = {"why": why, "fan": None, "tensors": {}}
    if fan is not None:
        if a.get("run_files_of", {}).get(str(rank)):  # headers that change after the plan (a safety-net test)
            headers = [read_header(p) for p in a["run_files_of"][str(rank)]]
        entries = fanout.entries_of(headers)
        owner = fan.owners(entries)
        only = {(f, t.name) for (f, t), o in zip(entries, owner) if o == fan.me}
        local = direct.stream_tensors(headers, device, direct.Ring(a.get("piece", 4096), 2), StageTimes(), only=only)

        def faulty(it):
            for k, item in enumerate(it):
                if k == 2 and a.get("mode") == "fail":
                    raise OSError(f"injected read failure on rank {rank}")
                if k == 2 and a.get("mode") == "die":
                    os._exit(7)
                yield item

        t0 = time.perf_counter()
        it = fan.run(entries, owner, faulty(local), device)
        try:
            for k, (name, t) in enumerate(it):
                if k == 2 and a.get("mode") == "stop":
                    break
                if device.type == "cuda":
                    torch.cuda._sleep(1000)  # a slow consumer: slots must not be refilled under pending copies
                raw = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                digest = hashlib.sha256(raw).hexdigest()
                out["tensors"].setdefault(name, []).append([str(t.dtype), list(t.shape), digest])
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["error"] = f"{type(e).__name__}: {e}"
        finally:
            it.close()  # as the loader does: a consumer that stopped tells the others
        out["seconds"] = time.perf_counter() - t0
        out["fan"] = {**fan.stats.to_dict(), "me": fan.me, "owned": len(only)}
        fan.close()
    with open(a["out"], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
