"""What the tests share: small safetensors files (``write_safetensors``, ``write_raw``, ``write_zoo``) and the
checks of what a loader made of them (``assert_zoo_bit_exact``, ``zoo_digests``), stand-ins for vLLM's and the
daemon's objects (``make_fingerprint``, ``fake_model_config``), log capture (``log_records`` and the fixtures
``records`` / ``warnings_logged``), raw socket listeners (``unix_listener``, ``tcp_black_hole``), a vLLM engine in
its own process (``Engine``, ``one_shot``), and the fixtures ``demo_model`` and ``moto_s3``.

Test modules import the plain functions from here (``from tests.conftest import ...``); the fixtures reach every
test under tests/ without an import.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

import pytest


@pytest.fixture(autouse=True)
def _thaw_gc_heap():
    """Loads run in this pytest process freeze its garbage-collector heap (``freeze_gc``, vllm_fastload.heap),
    as they would an engine's once; thaw it after each test so the next one starts with a normal heap."""
    yield
    gc.unfreeze()


def write_safetensors(path: Path, tensors: dict, metadata=None) -> Path:
    """Write ``tensors`` (name -> torch tensor) with the safetensors library; returns ``path``."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def write_raw(path: Path, header: dict, data: bytes, pad_to: int | None = None, header_len: int | None = None) -> Path:
    """Write a safetensors file by hand (for malformed inputs): u64 length, JSON header, data bytes."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    if pad_to is not None:
        raw += b" " * (pad_to - len(raw))
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The embedded SmolLM2-135M-Instruct bf16 directory (built once, cached outside the repo)."""
    from vllm_fastload.demo_model import build_model

    return build_model()


def demo_plus_overlay(demo_model: Path, tmp_path: Path) -> Path:
    """Issue 15's example: the demo model (its shard linked, not copied) plus ``overlay.safetensors`` holding an
    all-zero ``model.norm.weight``, no index. Returns the directory."""
    import torch

    from vllm_fastload.checkpoint import read_header

    d = tmp_path / "overlaid"
    d.mkdir()
    (d / "model.safetensors").symlink_to(demo_model / "model.safetensors")
    norm = read_header(str(demo_model / "model.safetensors")).tensors["model.norm.weight"]
    write_safetensors(d / "overlay.safetensors", {"model.norm.weight": torch.zeros(norm.shape, dtype=torch.bfloat16)})
    return d


def demo_with_stale_copies(demo_model: Path, dest: Path) -> Path:
    """The demo model as two shards plus an index, each shard also holding a zeroed copy of a tensor the index
    assigns to the other one (issue 27, item 1): ``model.norm.weight`` belongs to shard 1 (shard 2 has zeros),
    ``model.layers.0.input_layernorm.weight`` to shard 2 (shard 1 has zeros). A loader that keeps the last copy it
    reads serves zeros whatever order it reads the shards in; ours load the assigned copies. Config and tokenizer
    files are linked. Returns ``dest``."""
    import torch
    from safetensors.torch import load_file

    dest.mkdir(parents=True)
    for f in demo_model.iterdir():
        if f.name != "model.safetensors":
            (dest / f.name).symlink_to(f)
    ts = load_file(str(demo_model / "model.safetensors"))
    norm, ln0 = "model.norm.weight", "model.layers.0.input_layernorm.weight"
    one = {**ts, ln0: torch.zeros_like(ts[ln0])}
    two = {norm: torch.zeros_like(ts[norm]), ln0: ts[ln0]}
    write_safetensors(dest / "model-00001-of-00002.safetensors", one)
    write_safetensors(dest / "model-00002-of-00002.safetensors", two)
    wm = {k: "model-00001-of-00002.safetensors" for k in ts} | {ln0: "model-00002-of-00002.safetensors"}
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return dest


@pytest.fixture(scope="module")
def moto_s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 for this module; stopped by PID afterwards."""
    from vllm_fastload.servers import MotoS3

    with MotoS3(log_path=tmp_path_factory.mktemp("moto") / "moto.log") as s3:
        yield s3


#: safetensors dtype -> torch dtype attribute name (those this torch lacks are skipped by the zoo)
ZOO_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu", "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16",
    "I32": "int32", "U32": "uint32", "F32": "float32", "I64": "int64", "U64": "uint64", "F64": "float64",
}


def write_zoo(path: Path, seed: int = 0) -> dict:
    """A safetensors file holding every dtype this torch has, odd byte lengths, zero-element tensors (first, in
    the middle, last, and sharing a start offset) and tensors at offsets not aligned to their element size.

    Returns name -> (torch dtype, shape, expected raw bytes). Written by hand (the safetensors library would
    sort tensors by alignment), header padded to 8k+3 bytes so the data section itself is unaligned.
    """
    import random

    import torch

    rng = random.Random(seed)
    items = [("empty.first", "F32", [0, 4]), ("odd.u8", "U8", [3])]
    for i, (st, attr) in enumerate(ZOO_DTYPES.items()):
        if not hasattr(torch, attr):
            continue
        items.append((f"t{i:02d}.{st}", st, [rng.randint(1, 5), rng.randint(1, 7)]))
        if i == 6:
            items.append(("empty.middle", "BF16", [0]))
            items.append(("odd.i8", "I8", [5]))
    items.append(("big.f32", "F32", [1000, 37]))  # spans many small ring slots
    items.append(("empty.last", "I64", [2, 0]))
    from vllm_fastload.checkpoint import DTYPE_BYTES

    header, data, expected, off = {}, bytearray(), {}, 0
    for name, st, shape in items:
        n = 1
        for d in shape:
            n *= d
        nbytes = int(n * DTYPE_BYTES[st])
        if st == "BOOL":
            raw = bytes(rng.randint(0, 1) for _ in range(nbytes))
        else:
            raw = bytes(rng.getrandbits(8) for _ in range(nbytes))
            if st == "F8_E8M0":
                raw = bytes(b if b != 0xFF else 0x7F for b in raw)  # 0xFF is NaN; still bit-exact, keep it tame
        header[name] = {"dtype": st, "shape": shape, "data_offsets": [off, off + nbytes]}
        data += raw
        expected[name] = (getattr(torch, ZOO_DTYPES.get(st, "float32")), tuple(shape), raw)
        off += nbytes
    raw_h = json.dumps(header, separators=(",", ":")).encode()
    pad = (8 - (len(raw_h) % 8) + 3) % 8
    write_raw(path, header, bytes(data), pad_to=len(raw_h) + pad)
    return expected


def assert_zoo_bit_exact(got: dict, expected: dict) -> None:
    """``got`` (name -> tensor, on any device) holds exactly the names of ``expected`` (what :func:`write_zoo`
    returns), each with its dtype, its shape and, bit for bit, its raw bytes."""
    import torch

    assert set(got) == set(expected)
    for name, (dtype, shape, raw) in expected.items():
        t = got[name]
        assert t.dtype == dtype and tuple(t.shape) == shape, name
        assert t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() == raw, name


def zoo_digests(expected: dict) -> dict:
    """name -> ``[str(dtype), list(shape), sha256 of the raw bytes]`` of :func:`write_zoo`'s ``expected``: the form in
    which tests/unit/fanout_worker.py reports every tensor a rank received."""
    return {n: [str(d), list(s), hashlib.sha256(raw).hexdigest()] for n, (d, s, raw) in expected.items()}


# --- stand-ins for vLLM's and the daemon's objects -------------------------------------------------------------
def make_fingerprint(**fields):
    """A :class:`~vllm_fastload.fingerprint.Fingerprint` of one shard (``model.safetensors``, 100 bytes), TP/PP/DP 1
    rank 0, bf16; ``fields`` replace any of its fields."""
    from vllm_fastload.fingerprint import Fingerprint, ShardFacts

    base = dict(shards=(ShardFacts(name="model.safetensors", size=100, header_sha256="ab"),), architecture="X",
                dtype="bfloat16", quantization=None, rope=None, revision=None, kv_cache_dtype="auto", tp_size=1,
                tp_rank=0, pp_size=1, pp_rank=0, dp_size=1, dp_rank=0, vllm_version="0")
    base.update(fields)
    return Fingerprint(**base)


def fake_model_config(path, quantization=None, architecture: str = "Sink"):
    """What the loaders and ``fingerprint.of_model`` read of vLLM's ``ModelConfig``, for the checkpoint at ``path``
    (a directory or a URI): bf16, no revision, no ``model_weights``, an empty ``hf_config``."""
    import types

    import torch

    return types.SimpleNamespace(model=str(path), model_weights=None, revision=None, dtype=torch.bfloat16,
                                 quantization=quantization, architectures=[architecture],
                                 hf_config=types.SimpleNamespace())


# --- log capture -----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def log_records(level: int = logging.INFO, logger: str = "vllm.fastload",
                keep: Callable[[logging.LogRecord], object] = lambda r: r) -> Iterator[list]:
    """``keep(record)`` of every record of ``logger`` at ``level`` or above while the block runs, straight from a
    handler of our own (vLLM's logging config may stop records from reaching pytest's caplog). The logger is let
    through down to ``level`` meanwhile; its level and handlers are restored afterwards."""
    got: list = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(keep(record))

    lg = logging.getLogger(logger)
    h, old = Keep(level), lg.level
    lg.addHandler(h)
    if lg.getEffectiveLevel() > level:
        lg.setLevel(level)
    try:
        yield got
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)


@pytest.fixture
def records():
    """Records of the ``vllm.fastload`` logger (INFO and up) while the test runs."""
    with log_records(logging.INFO) as got:
        yield got


@pytest.fixture
def warnings_logged():
    """Messages (``getMessage()``) of the ``vllm.fastload`` logger's warnings and errors while the test runs."""
    with log_records(logging.WARNING, keep=logging.LogRecord.getMessage) as got:
        yield got


# --- raw socket listeners --------------------------------------------------------------------------------------
def unix_listener(path, backlog: int = 1) -> socket.socket:
    """A Unix stream socket bound at ``path`` and listening: a stand-in daemon whose every byte the test writes."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(backlog)
    return s


@contextlib.contextmanager
def tcp_black_hole() -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a TCP listener that accepts into its backlog and never answers (an endpoint that
    hangs); closed at the end of the block."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    try:
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()


# --- a vLLM engine in its own process (tests/gpu) --------------------------------------------------------------
#: the child script of :class:`Engine`; its argument is JSON with model, fmt (load format), tp, extra
#: (model_loader_extra_config), quant (an optional quantization) and state_src (benchmarks/model_state.py's source of
#: ``state(worker)``: every tensor of the model by layout and SHA-256, one dict per rank in each RESULT)
VLLM_CHILD = r"""
import json, sys, torch
from vllm import LLM, SamplingParams
a = json.loads(sys.argv[1])
kw = dict(model=a["model"], load_format=a["fmt"], enforce_eager=True, skip_tokenizer_init=True,
          tensor_parallel_size=a["tp"], max_model_len=512, gpu_memory_utilization=0.3,
          model_loader_extra_config=a["extra"])
if a.get("quant"):
    kw["quantization"] = a["quant"]
llm = LLM(**kw)
exec(a["state_src"])
prompts = [{"prompt_token_ids": p} for p in ([1, 5, 9, 200, 31], [7, 7, 7, 1000], [42])]
def answer():
    # the two likeliest tokens' logprobs at every step: where two engines' greedy ids part, was it a near tie?
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, detokenize=False, logprobs=2))
    return {"ids": [list(o.outputs[0].token_ids) for o in outs],
            "lps": [[[[t, lp.logprob] for t, lp in step.items()] for step in o.outputs[0].logprobs] for o in outs]}
blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
print("RESULT " + json.dumps({**answer(), "blocks": blocks, "state": llm.collective_rpc(state)}), flush=True)
for line in sys.stdin:
    if line.strip() != "gen":
        break
    print("RESULT " + json.dumps({**answer(), "state": llm.collective_rpc(state)}), flush=True)
"""


def _state_src() -> str:
    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from model_state import STATE_SRC

    return STATE_SRC


class Engine:
    """A vLLM ``LLM`` in its own process (:data:`VLLM_CHILD`): greedy ids of three token prompts (12 tokens each,
    ``ids``) with the two likeliest tokens' logprobs at each step (``lps``, for :func:`greedy_differs`), the model's
    state (``state``: per rank, every tensor's layout and SHA-256, benchmarks/model_state.py) and the KV
    cache's block count as a RESULT line once loaded, ids and state again for each ``gen`` on stdin; its stdout and
    stderr go to ``log``; stopped by its PID. Greedy ids of random weights are not reproducible from one vLLM 0.26
    process to the next on an H100 (near-tied logits; docs/benchmarks.md, GPU test runs), the state is: compare
    answers with :func:`greedy_differs`."""

    def __init__(self, model, fmt, tp=1, extra=None, quant=None, log=None):
        self.log_path = Path(log)
        self.fh = open(self.log_path, "w")
        arg = json.dumps({"model": str(model), "fmt": fmt, "tp": tp, "extra": extra or {}, "quant": quant,
                          "state_src": _state_src()})
        # the state function reaches the engine pickled (cloudpickle), which vLLM does only when this is set; tests
        # only: nothing of this package crosses a socket pickled
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
        self.p = subprocess.Popen([sys.executable, "-c", VLLM_CHILD, arg], stdin=subprocess.PIPE, stdout=self.fh,
                                  stderr=subprocess.STDOUT, text=True, env=env)
        self.seen = 0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def result(self, timeout=600) -> dict:
        """The next RESULT line (``ids``, and ``blocks`` in the first); fails when the engine exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = [ln for ln in self.log().splitlines() if ln.startswith("RESULT ")]
            if len(lines) > self.seen:
                self.seen += 1
                return json.loads(lines[self.seen - 1][7:])
            if self.p.poll() is not None:
                raise AssertionError(f"engine exited {self.p.returncode}:\n{self.log()[-4000:]}")
            time.sleep(0.5)
        raise TimeoutError(self.log()[-3000:])

    def gen(self) -> dict:
        self.p.stdin.write("gen\n")
        self.p.stdin.flush()
        return self.result()

    def stop(self) -> int:
        """Ask the engine to quit (killed after 60 s); returns its exit code."""
        if self.p.poll() is None:
            try:
                self.p.stdin.write("quit\n")
                self.p.stdin.flush()
                self.p.wait(60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()
        self.fh.close()
        return self.p.returncode


#: Logprob gap (nats) under which two tokens count as tied: where two answers' greedy ids first differ, both
#: tokens must be within it of each other in one answer's top-2 at that step. On an H100 the bf16 logits of these
#: random weights tie exactly (gap 0.0) at some steps, and which of the tied tokens greedy picks changed between
#: vLLM 0.26 processes and between two generates of one engine, the weights bit-identical (docs/benchmarks.md, GPU
#: test runs). Other gaps there came in steps of bf16 at these logits' size (2**-6), so this admits an exact tie or
#: one such step and nothing the size of a typical gap (the measured gaps: docs/benchmarks.md).
NEAR_TIE = 0.02


def greedy_differs(got: dict, ref: dict, tie: float = NEAR_TIE) -> Optional[str]:
    """Why the greedy answer ``got`` is not ``ref``'s (both :class:`Engine` RESULTs: ``ids``, per prompt the token
    ids; ``lps``, per prompt and step ``[token, logprob]`` pairs of at least the two likeliest tokens), or None.
    Two answers agree when their ids are equal, or where a prompt's ids first part the two tokens were within
    ``tie`` nats of each other at that step in either answer's logprobs (a near tie, after which the texts go
    their own ways); anything else, e.g. other ids from the first token on, is a reason naming the prompt and step."""
    for k, (a, b) in enumerate(zip(got["ids"], ref["ids"])):
        step = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if step is None:
            if len(a) != len(b):
                return f"prompt {k}: {len(a)} tokens against {len(b)}"
            continue
        gaps = []
        for lps in (got["lps"][k][step], ref["lps"][k][step]):
            lp = dict((int(t), v) for t, v in lps)
            if a[step] in lp and b[step] in lp:
                gaps.append(abs(lp[a[step]] - lp[b[step]]))
        if not gaps or min(gaps) > tie:
            return (f"prompt {k}: token {a[step]} against {b[step]} at step {step} (ids {a} against {b}), "
                    f"logprob gap {min(gaps) if gaps else 'unknown (not both in the top-2)'} > {tie}: not a near tie")
    if len(got["ids"]) != len(ref["ids"]):
        return f"{len(got['ids'])} prompts answered against {len(ref['ids'])}"
    return None


def one_shot(model, fmt, log, **kw) -> tuple[dict, str]:
    """The first RESULT of an :class:`Engine` (stopped afterwards) and its log."""
    e = Engine(model, fmt, log=log, **kw)
    try:
        return e.result(), e.log()
    finally:
        e.stop()


class StallingProxy:
    """A TCP proxy on 127.0.0.1 to ``127.0.0.1:upstream_port`` that, in every response, sends the first KiB and then
    nothing for ``stall_s`` seconds before the rest: a server that stalls mid-body, as a busy moto does. ``port`` is
    where it listens; :meth:`close` stops accepting (open connections end with their peers)."""

    def __init__(self, upstream_port: int, stall_s: float):
        import threading

        self.upstream, self.stall_s = upstream_port, stall_s
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream))
            asked = threading.Event()  # a request went up since the last stall
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst, asked, src is client), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, asked, is_request: bool) -> None:
        try:
            while True:
                b = src.recv(1 << 16)
                if not b:
                    break
                if is_request:
                    asked.set()
                elif asked.is_set() and len(b) > 1024:
                    asked.clear()
                    dst.sendall(b[:1024])
                    time.sleep(self.stall_s)
                    b = b[1024:]
                dst.sendall(b)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()


def run_script(argv: list[str], env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    """``subprocess.run(argv)`` in a session of its own, except that a timeout or an interrupt stops the script
    with SIGTERM (its trap stops the servers it started), not SIGKILL as ``subprocess.run`` does, which left its
    moto and vLLM servers running; what is still alive in its process group after 30 s is killed."""
    import signal

    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
    except BaseException:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the script's group: only what it started
        except ProcessLookupError:
            pass
        p.wait()
        raise
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


STATE_FIELDS = ("kind", "dtype", "shape", "stride", "sha256", "class", "device type")


def state_differences(got: list[dict], ref: list[dict], limit: int = 12) -> list[str]:
    """How two engines' states (``benchmarks/model_state.py``: per rank, name -> ``[kind, dtype, shape, stride,
    sha256, class, device type]``) differ, one line per tensor (at most ``limit``, then a count): a name only one
    has, or the fields that differ with both values. Empty when they are equal."""
    lines = []
    if len(got) != len(ref):
        return [f"{len(got)} rank(s) against {len(ref)}"]
    for rank, (a, b) in enumerate(zip(got, ref)):
        for name in sorted(a.keys() | b.keys()):
            if name not in b:
                lines.append(f"rank {rank}: {name} only in the engine under test")
            elif name not in a:
                lines.append(f"rank {rank}: {name} missing from the engine under test")
            elif a[name] != b[name]:
                fields = [f"{f} {x!r} != {y!r}" for f, x, y in zip(STATE_FIELDS, a[name], b[name]) if x != y]
                lines.append(f"rank {rank}: {name}: " + ", ".join(fields))
    return lines[:limit] + ([f"... {len(lines) - limit} more"] if len(lines) > limit else [])


def assert_same_state(got: list[dict], ref: list[dict]) -> None:
    """Assert two engines' states are equal, naming the tensors and fields that differ (:func:`state_differences`)."""
    diff = state_differences(got, ref)
    assert not diff, "engine state differs from the reference:\n" + "\n".join(diff)
