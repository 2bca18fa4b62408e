"""``python -m vllm_fastload.demo`` removes the socket directory it made for the preload daemon (after the daemon
stopped), whatever the rows answered; servers are stand-ins here (the real demo runs in `make demo`)."""

from pathlib import Path

import pytest

from vllm_fastload import demo


@pytest.mark.parametrize("daemon_ready", [True, False])
def test_the_socket_directory_is_gone_after_the_demo(tmp_path, monkeypatch, capsys, daemon_ready):
    seen = {}

    class Daemon:
        def __init__(self, model, sock_dir, log_path=None):
            seen["dir"] = Path(sock_dir)
            (Path(sock_dir) / "gpu-0.sock").write_text("")  # what a daemon leaves in it

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            seen["dir_at_stop"] = seen["dir"].exists()  # the daemon stops before the directory goes

        def wait_ready(self):
            return daemon_ready

        def log(self):
            return "daemon log"

        def diagnosis(self):
            return "reason: ConfigError: bad flag"

        def reason(self):
            return "ConfigError: bad flag"

        log_path = "preload.log"

    class S3:
        def __init__(self, log_path=None):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def upload_dir(self, *a):
            return "s3://models/m"

        def env(self):
            return {}

    monkeypatch.setattr(demo, "PreloadDaemon", Daemon)
    monkeypatch.setattr(demo, "MotoS3", S3)
    monkeypatch.setattr(demo, "_serve", lambda label, *a, **k: {"source": label, "format": "x", "seconds": 0.1,
                                                                 "answer": "The capital of France is Paris."})
    rc = demo.main(["--model-dir", str(tmp_path), "--logs", str(tmp_path / "logs")])
    assert rc == (0 if daemon_ready else 1)
    if not daemon_ready:  # the row names the daemon's own error line
        assert "| daemon exited: ConfigError: bad flag (log preload.log)" in capsys.readouterr().out
    assert seen["dir_at_stop"] and not seen["dir"].exists()
    # --logs given: the directory is the caller's and stays either way
    assert (tmp_path / "logs").is_dir()


@pytest.mark.parametrize("answer,kept", [("Paris.", False), ("L'Étoile", True)])
def test_the_temporary_log_directory_goes_only_when_every_row_answered(tmp_path, monkeypatch, answer, kept):
    import tempfile

    made = []
    real = tempfile.mkdtemp

    def mkdtemp(suffix=None, prefix=None, dir=None):
        d = real(suffix, prefix, dir or tmp_path)
        if prefix == "fastload-demo-":
            made.append(Path(d))
        return d

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(demo, "_serve", lambda label, *a, **k: {"source": label, "format": "x", "seconds": 0.1,
                                                                 "answer": answer})

    class Nothing:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def wait_ready(self):
            return True

        def upload_dir(self, *a):
            return "s3://models/m"

        def env(self):
            return {}

    monkeypatch.setattr(demo, "PreloadDaemon", Nothing)
    monkeypatch.setattr(demo, "MotoS3", Nothing)
    demo.main(["--model-dir", str(tmp_path)])
    [logdir] = made
    assert logdir.exists() == kept


def test_a_failed_row_answers_with_the_plugins_error_line(tmp_path, monkeypatch, capsys):
    """The table's reason for a server that died is the plugin's line (here a StorageError), not vLLM's generic
    "Engine core initialization failed"; the diagnosis goes to stderr."""
    from vllm_fastload.servers import ManagedProcess

    log = tmp_path / "vllm.log"
    log.write_text("(EngineCore pid=7) vllm_fastload.errors.StorageError: cannot read s3://models/m: timeout\n"
                   "RuntimeError: Engine core initialization failed. See root cause above.\n")

    class Server(ManagedProcess):
        def __init__(self, model, extra, log_path=None, env=None):
            self.argv, self.log_path, self.pid = ["python", "-m", "vllm"], log, 7
            self.proc = type("P", (), {"poll": lambda self: 1})()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def wait_ready(self):
            return False

    monkeypatch.setattr(demo, "VllmServer", Server)
    (tmp_path / "logs").mkdir()
    row = demo._serve("s3", "s3://models/m", "runai_streamer", {}, tmp_path / "logs")
    assert row["format"] == "FAILED"
    assert row["answer"] == f"server exited: StorageError: cannot read s3://models/m: timeout (log {log})"
    assert capsys.readouterr().err.startswith("reason: StorageError: cannot read s3://models/m: timeout")


def test_sigterm_to_the_demo_stops_the_servers_it_started(tmp_path):
    """`python -m vllm_fastload.demo` turns SIGTERM into SystemExit, so its `with` blocks stop their servers: a
    stand-in process of servers.ManagedProcess (its own session) is gone after the demo's process got SIGTERM."""
    import os
    import signal
    import subprocess
    import sys
    import time

    code = f"""
import time
from pathlib import Path
from vllm_fastload.demo import exit_on_sigterm
from vllm_fastload.servers import ManagedProcess
exit_on_sigterm()
with ManagedProcess(["sleep", "300"], Path({str(tmp_path / "child.log")!r})) as p:
    print(p.pid, flush=True)
    time.sleep(60)
"""
    demo = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(demo.stdout.readline())
    os.kill(child, 0)  # running
    demo.send_signal(signal.SIGTERM)
    assert demo.wait(30) == 143
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the demo's server outlived its SIGTERM")
