"""Where vLLM's "Model loading took" goes: one ``LLM()`` in this process, its load split into named spans, samples,
garbage-collector pauses and imports (issue 16, item 3).

    python benchmarks/load_profile.py --model DIR --load-format ipc_cache [--extra JSON] [--daemon] [--out DIR]
                                      [--cprofile] [--dtype DTYPE]

``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's engine core (and so the model runner's ``load_model``) in this
process. The window is the model runner's ``load_model`` (vLLM times "Model loading took" inside it, from before
``get_model_loader`` to after the loader returned). In it this script records, without slowing Python down:

- spans: wall seconds of named calls (``get_model_loader``, the loader's ``load_model``, vLLM's
  ``initialize_model``, ``process_weights_after_loading``, each step of :mod:`vllm_fastload.ipc.engine.mapping`),
  each with the process CPU seconds spent meanwhile (wall >> CPU: waiting on the GPU, a lock or the disk);
- samples: every 2 ms the main thread's stack; each sample is counted for the innermost frame of this package, vLLM
  or PyTorch, and for the frames directly under the window (what cProfile cannot attribute, C calls included, lands
  on the Python frame that made the call);
- the garbage collector's pauses (``gc.callbacks``) and the modules first imported in the window.

``--cprofile`` adds cProfile around ``LLM()`` (it slows Python-heavy code: compare shares, not seconds; the raw
stats in ``profile.pstats``). Writes
``profile.json`` and a readable ``profile.txt`` to ``--out``; ``--daemon`` starts ``vllm-fastload preload`` for the
model first (ipc_cache).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import io
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SAMPLE_S = 0.002
OURS = ("vllm_fastload", "vllm/", "torch/")


class Window:
    """The model runner's ``load_model``: spans, samples, GC pauses and imports recorded while it runs."""

    def __init__(self):
        self.t0 = None
        self.t1 = None
        self.spans: list[dict] = []
        self.gc: list[tuple[int, float]] = []
        self._gc_start = None
        self.samples = 0
        self.inner = collections.Counter()
        self.top = collections.Counter()
        self.modules_before: set[str] = set()
        self.new_modules: list[str] = []
        self._stop = threading.Event()
        self._main = None
        self._depth = 0

    # -- spans -------------------------------------------------------------------------------------------------
    def wrap(self, owner, attr: str, label: str) -> None:
        """Replace ``owner.attr`` with a timed wrapper (no-op when it does not exist)."""
        fn = getattr(owner, attr, None)
        if fn is None or getattr(fn, "_timed", False):
            return

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self.t0 is None or self.t1 is not None:
                return fn(*args, **kwargs)
            t, c = time.perf_counter(), time.process_time()
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                self.spans.append({"span": label, "depth": self._depth, "start_s": round(t - self.t0, 4),
                                   "wall_s": round(time.perf_counter() - t, 4),
                                   "cpu_s": round(time.process_time() - c, 4)})

        timed._timed = True  # type: ignore[attr-defined]
        setattr(owner, attr, timed)

    def window(self, owner, attr: str) -> None:
        """Make ``owner.attr`` (the model runner's ``load_model``) the recorded window."""
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self.t0 is not None:  # a nested or later call (the other model runner's): not the window
                return fn(*args, **kwargs)
            self.modules_before = set(sys.modules)
            self._main = threading.get_ident()  # the thread that loads (the engine core's, in this process)
            gc.callbacks.append(self._on_gc)
            sampler = threading.Thread(target=self._sample, daemon=True)
            self.t0, c = time.perf_counter(), time.process_time()
            sampler.start()
            try:
                return fn(*args, **kwargs)
            finally:
                self.t1 = time.perf_counter()
                self.cpu_s = time.process_time() - c
                self._stop.set()
                sampler.join()
                gc.callbacks.remove(self._on_gc)
                self.new_modules = sorted(set(sys.modules) - self.modules_before)

        setattr(owner, attr, timed)

    # -- samples and GC ----------------------------------------------------------------------------------------
    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            frame = sys._current_frames().get(self._main)
            if frame is None:
                continue
            stack = []
            while frame is not None:
                stack.append(frame)
                frame = frame.f_back
            stack.reverse()  # outermost first
            names = [f"{_short(f.f_code.co_filename)}:{f.f_code.co_name}" for f in stack]
            try:
                i = next(k for k, n in enumerate(names) if n.endswith(":timed") and "load_profile" in n
                         and k + 1 < len(names) and names[k + 1].endswith(":load_model"))
            except StopIteration:
                continue
            self.samples += 1
            under = [n for n in names[i + 1:] if not n.endswith(":timed")]
            self.top[" > ".join(under[1:4]) or "(load_model itself)"] += 1
            inner = next((n for n in reversed(under) if any(o in n for o in OURS)), under[-1] if under else "?")
            self.inner[inner] += 1

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self.gc.append((info.get("generation", -1), time.perf_counter() - self._gc_start))
            self._gc_start = None

    # -- report ------------------------------------------------------------------------------------------------
    def result(self) -> dict:
        per = self.samples or 1
        return {
            "window_s": round(self.t1 - self.t0, 4), "window_cpu_s": round(self.cpu_s, 4),
            "spans": self.spans,
            "gc": {"pauses": len(self.gc), "total_s": round(sum(s for _, s in self.gc), 4),
                   "by_generation": {g: round(sum(s for gg, s in self.gc if gg == g), 4)
                                     for g in {g for g, _ in self.gc}}},
            "samples": self.samples, "sample_period_s": SAMPLE_S,
            "top": [(k, round(v / per, 3)) for k, v in self.top.most_common(40)],
            "inner": [(k, round(v / per, 3)) for k, v in self.inner.most_common(40)],
            "new_modules": len(self.new_modules),
            "new_modules_top": sorted({m.split(".")[0] + "." + m.split(".")[1] if "." in m else m
                                       for m in self.new_modules})[:80],
        }


def _short(path: str) -> str:
    for key in ("vllm_fastload/", "vllm/", "torch/", "site-packages/"):
        if key in path:
            return path[path.index(key):]
    return os.path.basename(path)


def instrument(w: Window) -> None:
    """Window = the model runner's ``load_model``; spans on what it calls (vLLM 0.26 names; missing ones skipped)."""
    from vllm.model_executor import model_loader as ml
    from vllm.model_executor.model_loader import base_loader
    from vllm.model_executor.model_loader import utils as ml_utils
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker import cpu_model_runner as runner

        w.window(runner.CPUModelRunner, "load_model")
        w.wrap(runner, "get_model", "get_model")
    else:
        # vLLM 0.26 runs its second model runner (v1/worker/gpu/model_runner.py) by default; the first one is kept
        from vllm.v1.worker import gpu_model_runner as runner

        w.window(runner.GPUModelRunner, "load_model")
        w.wrap(runner, "get_model_loader", "get_model_loader")
        w.wrap(runner, "is_mixture_of_experts", "is_mixture_of_experts")
        try:
            from vllm.v1.worker.gpu import model_runner as runner2

            w.window(runner2.GPUModelRunner, "load_model")
            w.wrap(runner2, "get_model_loader", "get_model_loader")
        except ImportError:
            pass
    from vllm.utils import mem_utils

    w.wrap(mem_utils.DeviceMemoryProfiler, "__enter__", "DeviceMemoryProfiler.__enter__")
    w.wrap(mem_utils.DeviceMemoryProfiler, "__exit__", "DeviceMemoryProfiler.__exit__")
    w.wrap(gc, "collect", "gc.collect")
    w.wrap(ml, "get_model_loader", "get_model_loader")
    w.wrap(runner.GPUModelRunner, "_setup_eagle3_aux_hidden_state_outputs", "_setup_eagle3_aux_hidden_state_outputs")
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from vllm_fastload.ipc.engine.loader import IpcCacheLoader
    from vllm_fastload.streaming.loader import RunaiStreamerLoader

    for cls in (DefaultModelLoader, IpcCacheLoader, RunaiStreamerLoader):
        w.wrap(cls, "load_model", f"{cls.__name__}.load_model")
        w.wrap(cls, "load_weights", f"{cls.__name__}.load_weights")
    for mod in (base_loader, ml_utils):
        w.wrap(mod, "initialize_model", "initialize_model")
        w.wrap(mod, "process_weights_after_loading", "process_weights_after_loading")
    try:
        from vllm.model_executor.model_loader.reload import layerwise

        w.wrap(layerwise, "record_metadata_for_reloading", "record_metadata_for_reloading")
        w.wrap(ml_utils, "record_metadata_for_reloading", "record_metadata_for_reloading")
    except ImportError:
        pass
    try:
        from vllm_fastload.ipc.engine import mapping

        for step in ("_fingerprint", "fetch", "_check_content", "_verify", "_build_model", "_view_tensors",
                     "_apply_entries", "_reprocess", "_send_release", "_keep_lease", "_report", "initialize_model",
                     "process_weights_after_loading"):
            w.wrap(mapping, step, f"mapping.{step}")
    except ImportError:
        pass


def text_report(r: dict) -> str:
    buf = io.StringIO()
    p = functools.partial(print, file=buf)
    p(f"load format {r['load_format']}: LLM() {r['llm_s']:.2f} s, first token {r['first_token_s']:.3f} s")
    p(f"window (model runner load_model) {r['window_s']:.3f} s wall, {r['window_cpu_s']:.3f} s process CPU")
    p(f"garbage collector: {r['gc']['pauses']} pauses, {r['gc']['total_s']:.3f} s {r['gc']['by_generation']}")
    p(f"modules first imported in the window: {r['new_modules']}")
    p("\nspans (start s from the window's start, wall s, CPU s):")
    for s in sorted(r["spans"], key=lambda s: s["start_s"]):
        p(f"  {'  ' * s['depth']}{s['span']:<45} {s['start_s']:8.3f} {s['wall_s']:8.3f} {s['cpu_s']:8.3f}")
    p(f"\nsamples ({r['samples']} at {r['sample_period_s'] * 1000:.0f} ms), share by the frames under load_model:")
    for k, v in r["top"][:25]:
        p(f"  {v:6.3f}  {k}")
    p("\nshare by innermost frame of this package, vLLM or PyTorch:")
    for k, v in r["inner"][:30]:
        p(f"  {v:6.3f}  {k}")
    p("\npackages first imported in the window: " + ", ".join(r["new_modules_top"]))
    return buf.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--load-format", required=True)
    ap.add_argument("--extra", default="{}", help="--model-loader-extra-config JSON")
    ap.add_argument("--daemon", action="store_true", help="start vllm-fastload preload first (ipc_cache)")
    ap.add_argument("--cprofile", action="store_true", help="also run cProfile around LLM() (profile-cprofile.txt)")
    ap.add_argument("--device", default=None, help="vLLM device (default: vLLM's choice)")
    ap.add_argument("--dtype", default=None, help="vLLM --dtype for the engine and the daemon (default: vLLM's "
                    "choice, which a CPU host may make differently for the two: a fingerprint mismatch)")
    ap.add_argument("--freeze-first", action="store_true",
                    help="gc.freeze() just before LLM(): what a heap freeze when vLLM loads its plugins (inside "
                         "LLM()) would reach at most; measured, not a setting of the package")
    ap.add_argument("--out", type=Path, default=Path("profile-out"))
    a = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    a.out.mkdir(parents=True, exist_ok=True)
    extra = json.loads(a.extra)
    daemon = None
    if a.daemon:
        sys.path.insert(0, str(HERE.parent / "src"))
        from vllm_fastload.servers import PreloadDaemon

        sock = Path(tempfile.mkdtemp(prefix="flprof", dir="/tmp"))
        args = ["--max-model-len", "1024", *(["--dtype", a.dtype] if a.dtype else [])]
        daemon = PreloadDaemon(str(a.model), sock, args, log_path=a.out / "preload.log").ready_or_raise()
        extra.setdefault("socket_dir", str(sock))
        extra.setdefault("fallback", False)
    try:
        from vllm import LLM, SamplingParams

        w = Window()
        instrument(w)
        prof = None
        if a.cprofile:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        if a.freeze_first:
            gc.freeze()
        t = time.perf_counter()
        kw = {"device": a.device} if a.device else {}
        if a.dtype:
            kw["dtype"] = a.dtype
        llm = LLM(model=str(a.model), load_format=a.load_format, enforce_eager=True, skip_tokenizer_init=True,
                  max_model_len=1024, gpu_memory_utilization=0.5, model_loader_extra_config=extra, **kw)
        llm_s = time.perf_counter() - t
        if prof is not None:
            prof.disable()
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": [1, 450, 783]}], SamplingParams(temperature=0, max_tokens=1,
                                                                            detokenize=False))
        first_token_s = time.perf_counter() - t
    finally:
        if daemon is not None:
            daemon.stop()
    r = {"load_format": a.load_format, "extra": extra, "freeze_first": a.freeze_first, "llm_s": round(llm_s, 3),
         "first_token_s": round(first_token_s, 4), **w.result()}
    (a.out / "profile.json").write_text(json.dumps(r, indent=1))
    text = text_report(r)
    (a.out / "profile.txt").write_text(text)
    if prof is not None:
        import pstats

        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats("cumulative").print_stats(r"model_loader|vllm_fastload|model_runner", 45)
        (a.out / "profile-cprofile.txt").write_text(buf.getvalue())
        prof.dump_stats(str(a.out / "profile.pstats"))  # the whole profile, for pstats / snakeviz
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
