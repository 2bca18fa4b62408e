"""The examples are validated: YAML parses and is consistent, units parse, scripts compile."""

import configparser
import json
import py_compile
import subprocess
from pathlib import Path

import yaml

from vllm_fastload.config import StreamerConfig, parse_bytes

EX = Path(__file__).resolve().parents[2] / "examples"


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_kubernetes_deployment_is_consistent():
    dep = yaml.safe_load((EX / "kubernetes" / "deployment.yaml").read_text())
    pod = dep["spec"]["template"]["spec"]
    c = {x["name"]: x for x in pod["containers"]}
    pre, eng = c["preload"], c["engine"]
    assert pre["command"][:2] == ["vllm-fastload", "preload"]
    sock_dir = _flag(pre["command"], "--weight-cache-socket-dir")
    eng_cfg = json.loads(_flag(eng["command"], "--model-loader-extra-config"))
    assert _flag(eng["command"], "--load-format") == "ipc_cache" and eng_cfg["socket_dir"] == sock_dir
    mounts = lambda x: {m["name"]: m["mountPath"] for m in x["volumeMounts"]}  # noqa: E731
    assert mounts(pre)["fastload-sock"] == mounts(eng)["fastload-sock"] and sock_dir.startswith(mounts(pre)["fastload-sock"])
    # same tensor-parallel size on both sides (else the fingerprint differs)
    assert _flag(pre["command"], "--tensor-parallel-size") == _flag(eng["command"], "--tensor-parallel-size")
    streamer = StreamerConfig.from_extra(json.loads(_flag(pre["command"], "--model-loader-extra-config")))
    limits = pre["resources"]["limits"]
    assert parse_bytes(limits["memory"].replace("Gi", "GiB"), key="m", minimum=0) >= 2 * streamer.memory_limit
    assert int(limits["cpu"]) >= streamer.concurrency
    assert pre["startupProbe"]["httpGet"]["port"] == int(_flag(pre["command"], "--weight-cache-health-port"))
    # the bounds of the threat model (docs/operations.md) are set explicitly where the health port is on the pod IP
    assert _flag(pre["command"], "--weight-cache-health-host") == "0.0.0.0"
    assert int(_flag(pre["command"], "--weight-cache-max-connections")) <= 1024
    assert float(_flag(pre["command"], "--weight-cache-idle-timeout-s")) <= 30
    assert pre["securityContext"]["allowPrivilegeEscalation"] is False


def test_systemd_units_parse_and_order():
    pre = configparser.ConfigParser(strict=False, interpolation=None)
    pre.read(EX / "systemd" / "vllm-fastload-preload@.service")
    eng = configparser.ConfigParser(strict=False, interpolation=None)
    eng.read(EX / "systemd" / "vllm-engine@.service")
    assert "vllm-fastload preload" in pre["Service"]["ExecStart"] and pre["Service"]["KillSignal"] == "SIGTERM"
    # fds for two servers of --weight-cache-max-connections plus the daemon's own (systemd's default is 1024)
    max_conn = int(pre["Service"]["ExecStart"].split("--weight-cache-max-connections")[1].split()[0])
    assert int(pre["Service"]["LimitNOFILE"]) >= 2 * max_conn + 64 and int(pre["Service"]["LimitNOFILE"]) > 1024
    assert pre["Service"]["PrivateTmp"] == "yes" and pre["Service"]["UMask"] == "0077"
    assert "vllm-fastload-preload@%i.service" in eng["Unit"]["After"]
    assert "--load-format ipc_cache" in eng["Service"]["ExecStart"]


def test_scripts_compile():
    py_compile.compile(str(EX / "python" / "offline_llm.py"), doraise=True)
    subprocess.run(["bash", "-n", str(EX / "s3-local" / "serve_from_local_s3.sh")], check=True)
