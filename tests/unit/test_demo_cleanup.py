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
    assert seen["dir_at_stop"] and not seen["dir"].exists()
