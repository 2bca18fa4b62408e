"""The examples are validated: YAML parses and is consistent, units parse, scripts compile."""

import configparser
import json
import py_compile
import subprocess
from pathlib import Path

import pytest
import yaml

EX = Path(__file__).resolve().parents[2] / "examples"


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def _k8s():
    docs = list(yaml.safe_load_all((EX / "kubernetes" / "deployment.yaml").read_text()))
    return {d["kind"]: d for d in docs}


def test_kubernetes_manifests_pass_the_kubernetes_schema():
    kv = pytest.importorskip("kubernetes_validate")
    for doc in _k8s().values():
        kv.validate(doc, kv.latest_version(), strict=True)  # raises on any field the API does not have


def test_kubernetes_daemon_and_engine_share_one_gpu_container():
    """The NVIDIA device plugin gives each requesting container its own GPU: daemon and engine must be one
    container (under supervise.sh) or the engine could never map the daemon's memory."""
    docs = _k8s()
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e["value"] for e in c["env"]}
    # the ConfigMap carries supervise.sh verbatim
    assert docs["ConfigMap"]["data"]["supervise.sh"] == (EX / "kubernetes" / "supervise.sh").read_text()
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert c["command"] == ["/bin/sh", mount["supervise"] + "/supervise.sh"]
    assert env["SOCKET_DIR"].startswith(mount["fastload-sock"])
    weight = env["WEIGHT_ARGS"].split()
    assert "--tensor-parallel-size" in weight  # one variable for both sides: the fingerprint cannot differ
    engine = env["ENGINE_ARGS"].split()
    assert float(_flag(engine, "--gpu-memory-utilization")) <= 0.85  # the daemon's weights are not free memory
    preload = env["PRELOAD_ARGS"].split()
    assert all(f.startswith("--weight-cache-") for f in preload if f.startswith("--"))
    # the threat model's bounds are set where the health port is on the pod IP
    assert _flag(preload, "--weight-cache-health-host") == "0.0.0.0"
    assert int(_flag(preload, "--weight-cache-max-connections")) <= 1024
    assert float(_flag(preload, "--weight-cache-idle-timeout-s")) <= 30
    assert c["livenessProbe"]["httpGet"]["port"] == int(env["HEALTH_PORT"])  # the daemon
    assert c["readinessProbe"]["httpGet"]["port"] == 8000 == int(_flag(engine, "--port"))  # the engine
    assert c["securityContext"]["allowPrivilegeEscalation"] is False


def _stub(bin_dir, name, body):
    p = bin_dir / name
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(0o755)


def _supervisor(tmp_path, daemon_dies_after=None, engine_ignores_term=False):
    """Start supervise.sh with stand-ins for vllm-fastload (a /health server) and vllm (the first run exits 3, later
    ones run until SIGTERM, or ignore it). Returns (process, log path, health port)."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    life = (f"sleep {daemon_dies_after}; kill $PY; echo daemon-died >> {log}; exit 9" if daemon_dies_after
            else "wait $PY")
    _stub(bin_dir, "vllm-fastload", f"""echo "daemon $*" >> {log}
python3 -c "
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()" &
PY=$!
trap 'kill $PY; echo daemon-stopped >> {log}; exit 0' TERM
{life}
""")
    on_term = (f"echo engine-ignores-term >> {log}" if engine_ignores_term
               else f"echo engine-stopped >> {log}; exit 0")
    _stub(bin_dir, "vllm", f"""n=$(grep -c '^engine' {log})
echo "engine $*" >> {log}
[ "$n" -eq 0 ] && exit 3
trap '{on_term}' TERM
while :; do sleep 1; done
""")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MODEL": "/models/m", "WEIGHT_ARGS": "--dtype bf16",
           "ENGINE_ARGS": "--port 8000 *", "PRELOAD_ARGS": "--weight-cache-idle-timeout-s 30",
           "SOCKET_DIR": str(tmp_path / "sock"), "HEALTH_PORT": str(port), "STOP_GRACE_S": "2"}
    p = subprocess.Popen(["/bin/sh", str(EX / "kubernetes" / "supervise.sh")], env=env, start_new_session=True,
                         cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    return p, log, port


def _wait_for(log, text, count=1, timeout=60):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and log.read_text().count(text) >= count:
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} x{count} not in {log.read_text() if log.exists() else '(no log)'}")


def _finish(p, timeout=30):
    import os
    import signal

    try:
        code = p.wait(timeout)
        return code, p.stderr.read()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_supervisor_restarts_the_engine_and_stops_both_on_sigterm(tmp_path):
    """supervise.sh waits for the daemon's /health, restarts an engine that exited (the same command: args split on
    spaces, no globbing of the '*'), and on SIGTERM stops the engine, then the daemon, exit 0."""
    import os
    import signal

    p, log, port = _supervisor(tmp_path)
    _wait_for(log, "engine ", 2)
    os.kill(p.pid, signal.SIGTERM)
    code, err = _finish(p)
    assert code == 0, err
    lines = log.read_text().splitlines()
    assert lines[0] == (f"daemon preload --model /models/m --dtype bf16 --weight-cache-idle-timeout-s 30 "
                        f"--weight-cache-socket-dir {tmp_path / 'sock'} --weight-cache-health-port {port}")
    engines = [ln for ln in lines if ln.startswith("engine ")]
    assert len(engines) == 2 and engines[0] == engines[1]  # the first exited (3), the same command ran again
    assert engines[0].startswith("engine serve /models/m --dtype bf16 --port 8000 * --load-format ipc_cache")
    assert lines[-2:] == ["engine-stopped", "daemon-stopped"]  # engine first, then the daemon
    assert "engine exited (3); restarting it against the running daemon in 2 s" in err


def test_supervisor_exits_when_the_daemon_dies_under_a_running_engine(tmp_path):
    p, log, _ = _supervisor(tmp_path, daemon_dies_after=6)
    code, err = _finish(p, timeout=60)
    assert code == 1 and "preload daemon exited (9) while the engine ran; stopping the engine" in err, err
    assert log.read_text().splitlines()[-1] == "engine-stopped"


def test_supervisor_kills_an_engine_that_ignores_sigterm(tmp_path):
    import os
    import signal

    p, log, _ = _supervisor(tmp_path, engine_ignores_term=True)
    _wait_for(log, "engine ", 2)
    os.kill(p.pid, signal.SIGTERM)
    code, err = _finish(p)
    assert code == 0 and "ignored SIGTERM for 2 s: SIGKILL" in err, err
    assert log.read_text().splitlines()[-2:] == ["engine-ignores-term", "daemon-stopped"]


def _unit(name):
    c = configparser.ConfigParser(strict=False, interpolation=None)
    c.read(EX / "systemd" / name)
    return c


def _env_file():
    return dict(ln.split("=", 1) for ln in (EX / "systemd" / "llama.env").read_text().splitlines()
                if ln.strip() and not ln.startswith("#"))


def test_systemd_units_per_instance_with_one_socket_dir():
    pre, eng = _unit("vllm-fastload-preload@.service"), _unit("vllm-engine@.service")
    pre_cmd, eng_cmd = pre["Service"]["ExecStart"], eng["Service"]["ExecStart"]
    assert "vllm-fastload preload" in pre_cmd and pre["Service"]["KillSignal"] == "SIGTERM"
    # per instance: the socket dir from the instance name, made by the daemon's unit, named the same by the engine's
    assert pre["Service"]["RuntimeDirectory"] == "vllm-fastload/%i" and pre["Service"]["RuntimeDirectoryMode"] == "0700"
    assert "--weight-cache-socket-dir /run/vllm-fastload/%i " in pre_cmd
    assert json.loads(eng_cmd.split("--model-loader-extra-config", 1)[1].strip().strip("'"))["socket_dir"] == \
        "/run/vllm-fastload/%i"
    assert "--weight-cache-health-port ${HEALTH_PORT}" in pre_cmd
    # separate argument variables: weights on both sides, each side's own flags only on its side
    assert "$WEIGHT_ARGS $PRELOAD_ARGS" in pre_cmd and "ENGINE_ARGS" not in pre_cmd
    assert "$WEIGHT_ARGS $ENGINE_ARGS" in eng_cmd and "PRELOAD_ARGS" not in eng_cmd
    env = _env_file()
    assert set(env) == {"MODEL", "WEIGHT_ARGS", "PRELOAD_ARGS", "HEALTH_PORT", "ENGINE_ARGS"}
    assert "--port" in env["ENGINE_ARGS"] and "--port" not in env["WEIGHT_ARGS"] + env["PRELOAD_ARGS"]
    # fds for two servers of --weight-cache-max-connections plus the daemon's own (systemd's default is 1024)
    max_conn = int(pre_cmd.split("--weight-cache-max-connections")[1].split()[0])
    assert int(pre["Service"]["LimitNOFILE"]) >= 2 * max_conn + 64 and int(pre["Service"]["LimitNOFILE"]) > 1024
    assert pre["Service"]["PrivateTmp"] == "yes" and pre["Service"]["UMask"] == "0077"
    assert "vllm-fastload-preload@%i.service" in eng["Unit"]["After"]
    assert "--load-format ipc_cache" in eng_cmd


def test_systemd_units_verify(tmp_path):
    """systemd's own checker on instances of both templates (binaries and the env file pointed at stand-ins)."""
    import shutil

    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for exe in ("vllm-fastload", "vllm"):
        _stub(bin_dir, exe, "exit 0\n")
    (tmp_path / "llama.env").write_text((EX / "systemd" / "llama.env").read_text())
    for template, instance in (("vllm-fastload-preload@.service", "vllm-fastload-preload@llama.service"),
                               ("vllm-engine@.service", "vllm-engine@llama.service")):
        text = (EX / "systemd" / template).read_text().replace("/opt/vllm/bin/", f"{bin_dir}/")
        text = text.replace("/etc/vllm-fastload/%i.env", str(tmp_path / "llama.env"))
        (tmp_path / instance).write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / "vllm-fastload-preload@llama.service"),
                        str(tmp_path / "vllm-engine@llama.service")], capture_output=True, text=True)
    problems = [ln for ln in (r.stdout + r.stderr).splitlines()
                if ln.strip() and "llama.service" in ln and "network-online.target" not in ln]
    assert r.returncode == 0 and not problems, r.stdout + r.stderr


def test_scripts_compile():
    py_compile.compile(str(EX / "python" / "offline_llm.py"), doraise=True)
    subprocess.run(["bash", "-n", str(EX / "s3-local" / "serve_from_local_s3.sh")], check=True)


def test_s3_local_example_gives_runai_the_moto_settings_the_tests_use():
    """The example exports the same S3 client settings for moto as vllm_fastload.servers.MotoS3 (one set of values;
    the example is a standalone script, so it states them itself)."""
    from vllm_fastload.servers import MOTO_CLIENT_ENV

    text = (EX / "s3-local" / "serve_from_local_s3.sh").read_text()
    exported = dict(w.split("=", 1) for ln in text.splitlines() if ln.startswith("export RUNAI_STREAMER_S3_")
                    for w in ln.split()[1:])
    assert exported == MOTO_CLIENT_ENV
    assert "--gpu-memory-utilization" in text and "--dtype float32" in text and "/tmp/moto.log" not in text
