"""ipc_cache on CUDA (run on the device: ``bash benchmarks/device.sh ipctests``).

The VMM transport across processes (bytes, strides, survival of the exporter's SIGKILL, an exporter with
``expandable_segments``), and real vLLM engines against a real ``vllm-fastload preload`` daemon: greedy ids equal
built-in ``auto`` (zero_copy and copy, bf16 and online FP8, TP=1 and TP=2), the KV cache sized as if the weights
were the engine's own, a copy client next to a zero_copy one, the engine surviving the daemon's SIGKILL, and
``"fallback": false`` failing within ``connect_timeout_s``. Every process is stopped by its PID.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.gpu.conftest import NO_CUDA

if not torch.cuda.is_available():
    pytest.skip(NO_CUDA, allow_module_level=True)

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]

from tests.conftest import Engine, assert_same_state, greedy_differs, one_shot  # noqa: E402
from tests.gpu.zoo_cuda import zoo  # noqa: E402
from vllm_fastload.ipc.daemon.export import pack  # noqa: E402
from vllm_fastload.ipc.memory.cuda_vmm import CudaVmmTransport  # noqa: E402
from vllm_fastload.ipc.memory.layout import sample_checksums, view_at  # noqa: E402
from vllm_fastload.ipc.wire.client import status_of  # noqa: E402
from vllm_fastload.ipc.wire.messages import SegmentMeta, TensorRow, TensorTable  # noqa: E402
from vllm_fastload.servers import PreloadDaemon  # noqa: E402

# --- transport ------------------------------------------------------------------------------------------------
EXPORTER = r"""
import json, socket, sys, time, torch
from tests.gpu.zoo_cuda import zoo
from vllm_fastload.ipc.memory.backends import get_transport
from vllm_fastload.ipc.daemon.export import pack
device = torch.device("cuda", 0)
seg, entries = pack({k: v.cuda() for k, v in zoo().items()}, device)
meta = get_transport(device).describe(seg, device)
s = socket.socket(fileno=int(sys.argv[1]))
socket.send_fds(s, [json.dumps({"entries": entries.model_dump(),
                                "meta": meta.model_dump()}).encode()], [seg.fd])
time.sleep(600)
"""


def test_checksums_of_a_cuda_buffer_equal_the_host_copy_s():
    """The engine checksums mapped GPU memory (D2H window copies), the CPU tests a host buffer: same numbers."""
    g = torch.Generator().manual_seed(5)
    buf = torch.randint(0, 256, (5 * 4096 + 333,), dtype=torch.uint8, generator=g)
    entries = TensorTable.of({"a": TensorRow("uint8", [5 * 4096], [1], 0, 5 * 4096, 0, "param"),
                              "b": TensorRow("uint8", [77], [1], 5 * 4096 + 256, 77, 0, "param"),
                              "c": TensorRow("uint8", [300], [1], 1000, 300, 0, "param")})
    assert sample_checksums(buf.cuda(), entries).tolist() == sample_checksums(buf, entries).tolist()


def test_many_checksum_windows_of_a_cuda_buffer_are_gathered_and_equal_the_host_copy_s():
    """Past GATHER_MIN_WINDOWS the CUDA transport gathers the windows with one kernel; the tensors at the buffer's
    end (windows that would run past it) still come by driver copies: the checksums equal the host path's."""
    from vllm_fastload.ipc.memory.cuda_vmm import GATHER_MIN_WINDOWS

    g = torch.Generator().manual_seed(6)
    ts = {f"t{i}": torch.randn(int(torch.randint(1, 3000, (1,), generator=g)), generator=g)
          for i in range(GATHER_MIN_WINDOWS + 500)}
    # 12-byte tensors read as 16-byte windows, enough of them to be gathered; the last one's window would run past
    # the buffer's end (cut just after it below), so it comes by a driver copy
    ts.update({f"s{i}": torch.randn(3, generator=g) for i in range(GATHER_MIN_WINDOWS + 10)})
    seg, table = pack(ts)
    buf = seg.buf[:table.offset[-1] + table.nbytes[-1]].clone()
    assert sample_checksums(buf.cuda(), table).tolist() == sample_checksums(buf, table).tolist()


@pytest.mark.parametrize("expandable", [False, True], ids=["default-allocator", "expandable_segments"])
def test_vmm_transport_across_processes_and_exporter_sigkill(expandable):
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    path = os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    if expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    p = subprocess.Popen([sys.executable, "-c", EXPORTER, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    theirs.close()
    try:
        mine.settimeout(120)
        data, fds, _, _ = socket.recv_fds(mine, 1 << 20, 1)
        assert fds, p.stderr.read() if p.poll() is not None else "no fd received"
        msg = json.loads(data.decode())
        seg = CudaVmmTransport().open(fds[0], SegmentMeta(**msg["meta"]), torch.device("cuda", 0))
        want = zoo()
        entries = TensorTable(**msg["entries"])
        crcs = dict(zip(entries.names, sample_checksums(seg.buf, entries).tolist()))

        def check():
            for k, t in want.items():
                got = view_at(seg.buf, entries[k], k)
                assert got.device.type == "cuda" and got.dtype == t.dtype and got.shape == t.shape, k
                assert got.stride() == t.stride(), k  # the transposed view keeps its layout
                assert torch.equal(got.cpu().contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), k
                assert crcs[k] == entries[k].checksum, k

        check()
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
        time.sleep(1)
        check()  # the exporter is gone; the memory lives while we map it
        seg.close()
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        mine.close()


# --- real vLLM ----------------------------------------------------------------------------------------------------
@pytest.fixture
def sock():
    """A short socket dir (GPU socket names carry the 36-character UUID; Unix paths stop at 107 bytes)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="fl", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def start_daemon(model, sock, logs, name, args=()):
    os.chmod(sock, 0o700)
    d = PreloadDaemon(str(model), sock, list(args), log_path=logs / f"{name}.log")
    assert d.wait_ready(600), d.log()[-4000:]
    return d


def socket_of(sock: Path) -> str:
    socks = sorted(sock.glob("*.sock"))
    assert len(socks) == 1, socks
    return str(socks[0])


def test_zero_copy_copy_accounting_and_daemon_death(small, sock, tmp_path):
    ref, _ = one_shot(small, "auto", tmp_path / "auto.log")

    def same_answer(now):
        # the same bytes bit for bit; the ids those of a reference engine up to a near tie (greedy_differs): a later
        # generate of the same engine gave other ids than its first on an H100 (2026-12-06, the state identical)
        assert_same_state(now["state"], got["state"])
        assert greedy_differs(now, ref) is None, greedy_differs(now, ref)

    daemon = start_daemon(small, sock, tmp_path, "preload")
    zc = None
    try:
        assert "fastload: rank 0 exported" in daemon.log()
        st = status_of(socket_of(sock))
        assert st.state == "ready" and st.device == "gpu-" + str(torch.cuda.get_device_properties(0).uuid)
        rep_z = tmp_path / "zc.json"
        zc = Engine(small, "ipc_cache", extra={"socket_dir": str(sock), "report_path": str(rep_z)},
                    log=tmp_path / "zc.log")
        got = zc.result()
        assert_same_state(got["state"], ref["state"])  # every tensor bit-identical to auto's, none more or less
        assert greedy_differs(got, ref) is None, greedy_differs(got, ref)
        r = json.loads(rep_z.read_text())
        assert r["format_used"] == "ipc_cache" and r["extra"]["mode"] == "zero_copy" and "no disk read" in r["note"]
        assert r["extra"]["reprocessed_modules"] == 0  # the engine ran no post-processing
        # The mapped weights count as the engine's own: same KV cache as a disk load at the same utilization.
        cfg = json.loads((small / "config.json").read_text())
        block_bytes = (2 * cfg["num_hidden_layers"] * 16 * cfg["num_key_value_heads"]
                       * cfg["hidden_size"] // cfg["num_attention_heads"] * 2)
        weight_blocks = r["bytes"] / block_bytes
        # Without the accounting the engine would get ~weight_blocks more blocks than auto.
        assert got["blocks"] < ref["blocks"] + weight_blocks / 2, (got["blocks"], ref["blocks"], weight_blocks)

        # A copy client next to the zero_copy one: both correct, the daemon keeps its memory for zero_copy.
        rep_c = tmp_path / "copy.json"
        cp, log_c = one_shot(small, "ipc_cache", tmp_path / "copy.log",
                             extra={"socket_dir": str(sock), "mode": "copy", "report_path": str(rep_c)})
        assert_same_state(cp["state"], ref["state"])
        assert greedy_differs(cp, ref) is None, greedy_differs(cp, ref)
        assert "copy mode: daemon kept (zero_copy clients)" in log_c
        same_answer(zc.gen())
        st = status_of(socket_of(sock))
        assert st.clients == 1 and st.client_modes == ["zero_copy"] and st.state == "ready"

        # The daemon dies: the engine keeps answering from the memory it maps.
        os.kill(daemon.pid, signal.SIGKILL)
        time.sleep(2)
        same_answer(zc.gen())  # the same bytes answer

        # With fallback off and no daemon, the next start fails within connect_timeout_s, naming the socket.
        t = time.monotonic()
        e = Engine(small, "ipc_cache", extra={"socket_dir": str(sock), "fallback": False, "connect_timeout_s": 2},
                   log=tmp_path / "strict.log")
        with pytest.raises(AssertionError, match="engine exited"):
            e.result()
        e.stop()
        assert "no preload daemon at" in e.log()
        assert time.monotonic() - t < 120
    finally:
        if zc is not None:
            zc.stop()
        daemon.stop()


@pytest.mark.parametrize("tp,quant", [(1, "fp8"), (2, None)], ids=["tp1-fp8", "tp2-bf16"])
def test_zero_copy_matches_auto(tiny, sock, tmp_path, tp, quant):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    ref, _ = one_shot(tiny, "auto", tmp_path / "auto.log", tp=tp, quant=quant)
    args = ["--tensor-parallel-size", str(tp)] + (["--quantization", quant] if quant else [])
    daemon = start_daemon(tiny, sock, tmp_path, "preload", args)
    try:
        rep = tmp_path / "zc.json"
        got, log = one_shot(tiny, "ipc_cache", tmp_path / "zc.log", tp=tp, quant=quant,
                            extra={"socket_dir": str(sock), "report_path": str(rep), "fallback": False})
        assert_same_state(got["state"], ref["state"])  # per rank: every tensor bit-identical to auto's
        assert greedy_differs(got, ref) is None, greedy_differs(got, ref)
        assert log.count("no disk read") >= tp  # every rank mapped
        r = json.loads(rep.read_text())
        assert r["extra"]["reprocessed_modules"] == 0  # FP8 weights and scales mapped, not re-quantized
        if quant == "fp8":  # every linear weight travels as FP8, one byte per element of the checkpoint's *_proj
            from safetensors import safe_open

            proj = 0
            for f in tiny.glob("*.safetensors"):
                with safe_open(str(f), "pt") as sf:
                    proj += sum(sf.get_slice(k).get_shape()[0] * sf.get_slice(k).get_shape()[1]
                                for k in sf.keys() if k.endswith("_proj.weight"))
            m = re.search(r"bytes by dtype: [^)]*float8_e4m3fn=(\d+)", daemon.log())
            assert m and int(m.group(1)) == proj, daemon.log()[-2000:]
    finally:
        daemon.stop()
