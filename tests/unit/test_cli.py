"""The `vllm-fastload` command line: what a bare call prints, and `preload MODEL` taking the model positionally."""

import sys
import time

import pytest

from vllm_fastload import cli


def test_bare_command_lists_every_subcommand(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    for sub, words in (("build-demo-model", "SmolLM2"), ("inspect", "fingerprint"), ("preload", "daemon"),
                       ("status", "socket dir")):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(sub))
        assert words in line, line


def test_preload_takes_the_model_positionally(monkeypatch, tmp_path):
    seen = []
    import vllm_fastload.ipc.daemon.main as daemon

    m = str(tmp_path)
    monkeypatch.setattr(daemon, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["preload", m, "--tensor-parallel-size", "2"]) == 0
    assert cli.main(["preload", "--model", m]) == 0
    assert cli.main(["preload", "org/hub-model"]) == 0  # not a local path: vLLM resolves it
    assert seen == [["--model", m, "--tensor-parallel-size", "2"], ["--model", m], ["--model", "org/hub-model"]]


def test_unknown_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve"])
    assert e.value.code == 2 and "invalid choice: 'serve'" in capsys.readouterr().err


def test_status_exit_codes_are_the_same_with_json(tmp_path, capsys):
    d = tmp_path / "sock"
    d.mkdir(mode=0o700)
    assert cli.main(["status", "--weight-cache-socket-dir", str(d)]) == 1
    assert cli.main(["status", "--weight-cache-socket-dir", str(d), "--json"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "[]"


def test_preload_without_a_model_refuses_in_one_line(capsys, monkeypatch):
    """Without a model vLLM would take its default one and try the hub five times: refuse before that."""
    import vllm_fastload.ipc.daemon.main as daemon

    monkeypatch.setattr(daemon, "main", lambda argv: pytest.fail("the daemon must not start"))
    assert cli.main(["preload", "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["vllm-fastload preload: error: no model: pass it first (`vllm-fastload preload /models/llama ...`) "
                   "or as --model, with the engine args the engine will use"]


def test_preload_help_leads_with_the_daemon_flags(capsys):
    assert cli.main(["preload", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: vllm-fastload preload MODEL")
    for flag in ("--weight-cache-socket-dir", "--weight-cache-health-port", "--weight-cache-max-connections"):
        assert flag in out
    assert "--help=all" in out and len(out.splitlines()) < 60


def test_preload_unknown_flag_is_a_short_error(capsys, tmp_path):
    pytest.importorskip("vllm")
    with pytest.raises(SystemExit) as e:
        cli.main(["preload", str(tmp_path), "--bogus-flag"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert err[-2:] == ["vllm-fastload preload: error: unrecognized arguments: --bogus-flag",
                        "(`vllm-fastload preload --help` lists the daemon's flags, `--help=all` vLLM's engine args)"]
    assert not any(line.startswith("usage:") for line in err)


@pytest.mark.parametrize("flag, value, says", [
    ("--weight-cache-idle-timeout-s", "inf", "'inf' is not a float > 0 and at most 86400"),
    ("--weight-cache-attach-timeout-s", "1e10", "'1e10' is not a float > 0 and at most 86400"),
    ("--weight-cache-idle-timeout-s", "0", "'0' is not a float > 0 and at most 86400"),
    ("--weight-cache-health-port", "70000", "'70000' is not a TCP port from 1 to 65535"),
    ("--weight-cache-health-port", "-1", "'-1' is not a TCP port from 1 to 65535"),
    ("--weight-cache-health-port", "0", "'0' is not a TCP port from 1 to 65535"),
])
def test_preload_refuses_a_timeout_or_port_it_cannot_use_naming_the_flag(flag, value, says, capsys, monkeypatch):
    """A timeout of inf or 1e10 s was taken, the daemon said ready and then failed every connection (a socket
    timeout is a time_t deadline); port 70000 died in bind() with a traceback (adversarial pass, 2026-12-05)."""
    import vllm_fastload.ipc.daemon.main as daemon

    monkeypatch.setattr(daemon, "build_and_export", lambda *a, **k: pytest.fail("the daemon must not load"))
    with pytest.raises(SystemExit) as e:
        cli.main(["preload", "/tmp", f"{flag}={value}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: {says}" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, says", [
    (["preload", "--model="], "no model"),
    (["preload", "--model", ""], "no model"),
    (["preload", "/no/such/model", "--dtype", "float32"], "model directory /no/such/model does not exist"),
])
def test_preload_refuses_an_empty_or_missing_model_in_one_line(argv, says, capsys, monkeypatch):
    import vllm_fastload.ipc.daemon.main as daemon

    monkeypatch.setattr(daemon, "main", lambda argv: pytest.fail("the daemon must not start"))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


def test_inspect_refuses_an_empty_source(capsys):
    assert cli.main(["inspect", ""]) == 2
    assert "the source is empty" in capsys.readouterr().err


def test_status_with_only_stale_sockets_is_no_daemon(tmp_path, capsys):
    import socket

    d = tmp_path / "sock"
    d.mkdir(mode=0o700)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(d / "cpu-x-r0.sock"))  # bound, never listening: a stale socket
    s.close()
    assert cli.main(["status", "--weight-cache-socket-dir", str(d)]) == 1
    assert f"{d / 'cpu-x-r0.sock'}: not answering: nothing listens (a stale socket: remove it once no daemon of it " \
           f"runs)" in capsys.readouterr().out
    assert cli.main(["status", "--weight-cache-socket-dir", str(tmp_path / "missing")]) == 1
    assert "(the directory does not exist)" in capsys.readouterr().out


def test_status_does_not_call_a_listener_that_answers_wrongly_stale(tmp_path, capsys):
    """A listener that sends no valid status reply (a daemon of another protocol version, another program) or none
    at all was reported as "not answering (stale socket?)", inviting the removal of a live daemon's socket
    (adversarial pass, 2026-12-07)."""
    import socket
    import threading

    d = tmp_path / "sock"
    d.mkdir(mode=0o700)
    servers, stop = [], threading.Event()

    def serve(name, reply):
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(d / name))
        s.listen(4)
        servers.append(s)

        def run():
            while not stop.is_set():
                try:
                    c, _ = s.accept()
                except OSError:
                    return
                if reply is not None:
                    c.sendall(reply)
                    c.close()
                else:
                    stop.wait(10)  # accepts, never answers
                    c.close()
        threading.Thread(target=run, daemon=True).start()

    serve("cpu-a-r0.sock", b"garbage that is no frame\n" * 4)
    serve("cpu-b-r0.sock", None)
    try:
        assert cli.main(["status", "--weight-cache-socket-dir", str(d)]) == 1
    finally:
        stop.set()
        for s in servers:
            s.close()
    out = capsys.readouterr().out
    assert f"{d / 'cpu-a-r0.sock'}: a listener answered, but not with a valid status reply (" in out
    assert f"{d / 'cpu-b-r0.sock'}: a listener accepted but sent no status reply within 2 s" in out
    assert "not a stale socket" in out and "nothing listens" not in out


def test_a_daemon_that_exits_before_ready_raises_with_its_log(tmp_path):
    """PreloadDaemon.ready_or_raise (the benchmarks start their daemon with it): a daemon that cannot start is
    stopped and its refusal is in the error, not a hang or a bare False."""
    from vllm_fastload.servers import PreloadDaemon

    d = PreloadDaemon("/no/such/model", tmp_path / "socks", log_path=tmp_path / "preload.log")
    with pytest.raises(RuntimeError, match=r"(?s)preload daemon exited:.*model directory /no/such/model does not "
                                           r"exist"):
        d.ready_or_raise(60)
    assert not d.alive()


def test_status_calls_a_non_socket_named_sock_what_it_is(tmp_path, capsys):
    """A regular file or folder named *.sock was reported as "not answering (stale socket?)"."""
    d = tmp_path / "sock"
    d.mkdir(mode=0o700)
    (d / "cpu-x-r0.sock").write_text("hi")
    (d / "cpu-x-r1.sock").mkdir()
    assert cli.main(["status", "--weight-cache-socket-dir", str(d)]) == 1
    out = capsys.readouterr().out
    assert f"{d / 'cpu-x-r0.sock'}: not a socket (a regular file)" in out
    assert f"{d / 'cpu-x-r1.sock'}: not a socket (a directory)" in out


LINGERING_DAEMON = """
import sys, threading, time
import vllm_fastload.cli as cli
import vllm_fastload.ipc.daemon.main as daemon
from vllm_fastload.errors import FastloadError

def stops(*args):
    # what a library may leave behind: a non-daemon thread, which Python waits for before it exits
    threading.Thread(target=time.sleep, args=(600,), name="left-behind").start()
    if {how!r} == "refused":
        raise FastloadError("post-processed module 'experts' cannot be exported")
    if {how!r} == "usage":
        sys.exit(2)  # what the daemon's argument parser does for a bad flag
    return 0

daemon.EXIT_GRACE_S = 1.0
if {rank!r}:  # one rank's process of a TP > 1 daemon (multiprocessing's target)
    daemon.serve_rank = stops
    daemon._rank_main(())
daemon.main = stops
sys.argv = ["vllm-fastload", "preload", {model!r}]
raise SystemExit(cli.console())
"""


@pytest.mark.parametrize("rank", [False, True])
@pytest.mark.parametrize("how, code, rank_code", [("refused", 2, 1), ("usage", 2, 2), ("stopped", 0, 0)])
def test_a_preload_daemon_that_stopped_exits_although_a_thread_is_left(tmp_path, how, code, rank_code, rank):
    """A daemon whose load failed (or that stopped serving) must end even when a library left a non-daemon thread
    (on a GPU, a refused model's daemon never ended in two device calls): the command's process, and each rank's
    process of a TP > 1 daemon (which the command joins), exits within the grace period with its status (also one
    set by ``sys.exit``) and the error. Without `exit_within` this subprocess sleeps 600 s."""
    import subprocess

    script = LINGERING_DAEMON.format(how=how, model=str(tmp_path), rank=rank)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 30
    # a rank's FastloadError propagates (multiprocessing would print it): status 1
    assert r.returncode == (rank_code if rank else code), r.stderr
    if how == "refused":
        said = ("FastloadError: post-processed module 'experts' cannot be exported" if rank else
                "vllm-fastload preload: error: post-processed module 'experts' cannot be exported")
        assert said in r.stderr


def test_a_caller_of_cli_main_is_not_given_an_exit_timer(monkeypatch, tmp_path):
    """Only the console script (``cli.console``) ends its process after the daemon returned: a caller of
    ``cli.main`` in its own process (a wrapper that restarts the daemon, a test), with its own argv or with
    ``sys.argv``, keeps running."""
    import threading

    import vllm_fastload.ipc.daemon.main as daemon

    monkeypatch.setattr(daemon, "main", lambda argv: 0)
    monkeypatch.setattr(sys, "argv", ["vllm-fastload", "preload", str(tmp_path)])
    before = {t.ident for t in threading.enumerate()}
    assert cli.main(["preload", str(tmp_path)]) == 0
    assert cli.main() == 0
    assert [t for t in threading.enumerate() if t.ident not in before and isinstance(t, threading.Timer)] == []


class _Rank:
    """A stand-in for a rank's ``multiprocessing.Process``: alive until ``ends_at`` (monotonic; None: never)."""

    def __init__(self, pid, ends_at=None):
        self.pid, self.ends_at, self.killed = pid, ends_at, False

    def is_alive(self):
        return not self.killed and (self.ends_at is None or time.monotonic() < self.ends_at)

    def join(self, timeout=None):
        if self.is_alive():
            time.sleep(min(timeout or 0.05, 0.05))

    def kill(self):
        self.killed = True


def test_a_rank_stuck_after_the_stop_is_killed_and_one_that_ends_is_not(caplog):
    """A stop was asked: the rank that ends on its own is waited for, the one stuck (its exit timer never started,
    e.g. inside a blocking call of a distributed backend) is killed after the deadline and named in the log."""
    import logging
    import threading

    from vllm_fastload.ipc.daemon.main import _join_ranks

    stopping = threading.Event()
    stopping.set()
    ends, stuck = _Rank(11, time.monotonic() + 0.1), _Rank(12)
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR):
        _join_ranks([ends, stuck], stopping, kill_after_s=1.0)
    assert stuck.killed and not ends.killed
    assert 1.0 <= time.monotonic() - t0 < 5
    assert "rank process 12 did not exit within 1 s of the stop; killing it" in caplog.text
    assert "rank process 11" not in caplog.text


def test_serving_ranks_are_never_killed_without_a_stop():
    """Without a stop nothing is killed, however long the ranks serve (here: until they end on their own)."""
    import threading

    from vllm_fastload.ipc.daemon.main import _join_ranks

    ranks = [_Rank(21, time.monotonic() + 0.6), _Rank(22, time.monotonic() + 0.8)]
    _join_ranks(ranks, threading.Event(), kill_after_s=0.1)
    assert not any(r.killed for r in ranks) and not any(r.is_alive() for r in ranks)


@pytest.mark.parametrize("what, says", [("file", "exists and is not a directory"),
                                         ("full", "exists and is not a complete model directory")])
def test_build_demo_model_refuses_a_path_it_cannot_use_in_one_line(what, says, tmp_path, capsys):
    """A file or a directory holding something else gave a traceback (adversarial pass, 2026-12-05)."""
    out = tmp_path / "out"
    if what == "file":
        out.write_text("x")
    else:
        out.mkdir()
        (out / "notes.txt").write_text("x")
    assert cli.main(["build-demo-model", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"vllm-fastload build-demo-model: error: {out} {says}")
    assert (out.read_text() == "x") if what == "file" else sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert "remove" not in err[0]  # the path may hold anything of the user's (a home directory typed by mistake)


def test_inspect_with_no_fingerprint_refuses_a_leftover_argument(tmp_path, capsys):
    """Without a fingerprint no engine args are read, so a typo such as --jsno was silently ignored."""
    with pytest.raises(SystemExit) as e:
        cli.main(["inspect", str(tmp_path), "--jsno", "--no-fingerprint"])
    assert e.value.code == 2
    assert ("error: unrecognized arguments: --jsno (with --no-fingerprint no engine args are read)"
            in capsys.readouterr().err)


def test_status_with_an_empty_socket_dir_refuses_instead_of_asking_the_default(capsys, monkeypatch, tmp_path):
    """``--weight-cache-socket-dir ""`` silently listed the default directory's daemons (the engine's
    ``socket_dir: ""`` is refused for the same reason)."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert cli.main(["status", "--weight-cache-socket-dir", ""]) == 2
    assert capsys.readouterr().err.strip() == (
        f"vllm-fastload status: error: --weight-cache-socket-dir is empty, which names no directory; omit it for the "
        f"default ({tmp_path / 'vllm-fastload'})")
