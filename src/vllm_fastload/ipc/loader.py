"""``IpcCacheLoader``: the ``ipc_cache`` load format (engine side).

``load_model``: fingerprint of what this engine would load (same module as ``runai_streamer``) -> connect to
the daemon of this rank's device -> hello/manifest -> build the model skeleton on the meta device (no weight
memory) -> install the mapped tensors (``zero_copy``) or clones (``copy``, then ``release``) after verifying each
tensor's checksum sample -> re-run post-processing of the modules the daemon marked -> done, with no disk read.
Any miss (no daemon, timeout, fingerprint mismatch, checksum or layout mismatch) goes through the one fallback
policy: a WARNING naming the reason and a full load with vLLM's default loader, or an error with
``"fallback": false``.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any, Iterator

from ..checkpoint import weights_source
from ..config import IpcCacheConfig
from ..errors import CheckpointError, FastloadError
from ..fallback import default_loader, fall_back
from ..log import logger
from ..report import LoadReport

try:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
except ImportError:  # pragma: no cover
    BaseModelLoader = object  # type: ignore[assignment,misc]

LOAD_FORMAT = "ipc_cache"
#: Leases (connection + mapping) of zero_copy loads: they must live as long as the process serves.
_LEASES: list = []


class ChecksumMismatch(FastloadError):
    """A mapped tensor's bytes differ from the manifest's checksum sample (the daemon's memory is not what it
    says); the message names the tensor."""


def _process_registries(vllm_config: Any) -> list[dict]:
    """The process-wide dicts building a model registers into: attention layers in ``static_forward_context``
    and cached rotary embeddings (``rotary_embedding._ROPE_DICT``); those missing in this vLLM are left out."""
    found = [getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None)]
    try:
        from vllm.model_executor.layers import rotary_embedding as rope

        found.append(getattr(rope, "_ROPE_DICT", None))
    except ImportError:
        pass
    return [d for d in found if d is not None]


def _skeleton_registrations(vllm_config: Any) -> list[tuple[dict, set]]:
    """The keys of :func:`_process_registries` now, so a failed mapping can undo what its skeleton added."""
    return [(d, set(d)) for d in _process_registries(vllm_config)]


def _forget_skeleton(before: list[tuple[dict, set]]) -> None:
    """Remove what a skeleton built after :func:`_skeleton_registrations` registered, so the fallback loader can
    build the model again (otherwise vLLM raises "Duplicate layer name" or reuses meta-device RoPE caches)."""
    for d, keys in before:
        for k in set(d) - keys:
            d.pop(k, None)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (restored after, also on errors): mapping creates a
    few thousand objects, enough to trigger collections, and a full collection of an engine process's heap
    (~640k objects after importing vLLM) took 0.27 s on this project's CPU machine - more than the whole mapping."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class IpcCacheLoader(BaseModelLoader):
    """Maps post-processed weights from a ``vllm-fastload preload`` daemon (CPU: memfd shared memory; CUDA: one
    VMM allocation per rank, see :mod:`.cuda_vmm`)."""

    def __init__(self, load_config: Any):
        self.config = IpcCacheConfig.from_extra(load_config.model_loader_extra_config)
        super().__init__(load_config)

    def download_model(self, model_config: Any) -> None:
        """Nothing to download."""

    def load_weights(self, model: Any, model_config: Any) -> None:
        """In-place (re)load of an existing model: done from disk by vLLM's default loader."""
        default_loader(self.load_config).load_weights(model, model_config)

    def get_external_weight_memory(self, vllm_config: Any) -> int:
        """vLLM >= 0.33 hook (``BaseModelLoader.get_external_weight_memory``): bytes of daemon memory this process
        serves weights from (zero_copy on CUDA), so the KV cache is sized as if the weights were the engine's own.
        0 in copy mode, on CPU, and after a fallback."""
        from .accounting import mapped_bytes

        try:
            import torch

            return mapped_bytes(torch.cuda.current_device()) if torch.cuda.is_available() else 0
        except (ImportError, RuntimeError):
            return 0

    def socket_for_this_rank(self) -> str:
        """The daemon socket of the device this worker uses (``socket_path`` wins over ``socket_dir``). Sets
        :attr:`socket_origin` (where the directory came from, for messages). Raises
        :class:`~vllm_fastload.errors.SocketDirError` when the socket directory cannot be used."""
        from vllm.platforms import current_platform

        from .paths import ENGINE_KEY, device_identity, ensure_socket_dir, socket_dir_spec, socket_path

        if self.config.socket_path:
            self.socket_origin = 'from "socket_path" in --model-loader-extra-config'
            return self.config.socket_path
        local_rank = 0
        try:
            from vllm.distributed.parallel_state import get_world_group

            local_rank = get_world_group().local_rank
        except (ImportError, AssertionError, AttributeError):
            pass
        d = ensure_socket_dir(self.config.socket_dir, create=False, override=ENGINE_KEY)
        self.socket_origin = socket_dir_spec(self.config.socket_dir, ENGINE_KEY).origin
        # Drafts of speculative decoding have no daemon of their own yet: their socket never exists, so they fall
        # back to disk with a warning.
        role = "draft" if self.config.is_draft else "target"
        return str(socket_path(d, device_identity(current_platform.device_type, local_rank), role))

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
        """Map the model from the daemon, or fall back (see module docstring)."""
        t0 = time.perf_counter()
        from .client import CacheUnavailable, FingerprintMismatch
        from .state import InstallError

        path = "?"
        try:
            path = self.socket_for_this_rank()
            logger.info("Loading weights via ipc_cache (mode=%s) from %s", self.config.mode, path)
            with _gc_paused():
                model, report = self._map(vllm_config, model_config, prefix, path, t0)
            report.emit(self.config.report_path)
            return model
        except CheckpointError:
            # the checkpoint itself is unusable (a malformed shard, a duplicate name without an index): vLLM's
            # default loader would read the same files, and for a duplicate silently serve the last copy read
            raise
        except FingerprintMismatch as e:
            fields = ", ".join(f"{n} (daemon {a!r}, engine {b!r})" for n, a, b in e.mismatched)
            reason = (f"fingerprint mismatch with the daemon at {path}: {fields}; restart `vllm-fastload preload` "
                      f"with this engine's args, or start the engine with the daemon's")
        except (CacheUnavailable, ChecksumMismatch, InstallError, FastloadError) as e:
            reason = str(e)
        except (ValueError, KeyError, TypeError, OSError) as e:  # malformed manifest or mapping failure
            reason = f"the daemon's manifest or memory is unusable ({type(e).__name__}: {e})"
        loader = fall_back(LOAD_FORMAT, reason, self.config.fallback, self.load_config,
                           expected_content_digest=self.config.expected_content_digest,
                           source=weights_source(model_config) if self.config.expected_content_digest else "")
        model = loader.load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        # the weights of a fallback come from the model's files, not from the daemon
        report = LoadReport(load_format=LOAD_FORMAT, source=str(model_config.model),
                            format_used=loader.load_config.load_format,
                            fallback_reason=reason, wall_s=time.perf_counter() - t0)
        report.emit(self.config.report_path)
        return model

    def _check_content(self, manifest: dict, path: str) -> None:
        """With ``expected_content_digest``: the daemon must have hashed its load to that digest (raises
        :class:`~.client.CacheUnavailable` with the reason, which the fallback policy logs)."""
        from .client import CacheUnavailable

        expected = self.config.expected_content_digest
        if expected is None:
            return
        got = manifest.get("content_digest")
        if got is None:
            raise CacheUnavailable(f"expected_content_digest is set but the daemon at {path} did not hash its "
                                   f"weights: start `vllm-fastload preload` with --model-loader-extra-config "
                                   f"'{{\"content_hash\": true}}' (or the same expected_content_digest)")
        if got != expected:
            raise CacheUnavailable(f"the daemon at {path} holds weights with content digest {got}, but "
                                   f"expected_content_digest is {expected}: restart `vllm-fastload preload` on the "
                                   f"pinned checkpoint")

    def _map(self, vllm_config: Any, model_config: Any, prefix: str, path: str, t0: float) -> tuple[Any, LoadReport]:
        import torch
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        from ..fingerprint import of_model
        from .client import CacheUnavailable, fetch
        from .layout import sample_checksums, views
        from .state import install, reprocess_modules

        device = torch.device(vllm_config.device_config.device if self.load_config.device is None
                              else self.load_config.device)
        if device.type == "cuda":
            if torch.version.hip is not None:
                raise CacheUnavailable("ipc_cache on ROCm is not supported yet (the CUDA VMM transport is bound to "
                                       "libcuda); loading from disk")
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.type != "cpu":
            raise CacheUnavailable(f"ipc_cache has no transport for {device.type} devices (CPU and CUDA only)")
        phases: dict[str, float] = {}
        tick = time.perf_counter()
        cpu0 = time.thread_time()

        def lap(name: str) -> None:
            nonlocal tick
            now = time.perf_counter()
            phases[name] = round(now - tick, 4)
            tick = now

        plan, fp = of_model(model_config, vllm_config)
        lap("fingerprint_s")
        mode = self.config.mode
        lease = fetch(path, fp.to_dict(), mode, self.config.connect_timeout_s, self.config.state_timeout_s, device,
                      getattr(self, "socket_origin", None))
        lap("connect_manifest_s")
        registered: list = []
        try:
            man = lease.manifest
            self._check_content(man, path)
            entries = man["tensors"]
            buf = lease.segment.buf
            # Verify before building anything: a corrupt daemon must not leave a half-built model behind.
            tv = time.perf_counter()
            crcs = sample_checksums(buf, entries)
            phases["verify_s"] = round(time.perf_counter() - tv, 4)
            bad = [name for name, e in entries.items() if crcs[name] != e["checksum"]]
            if bad:
                raise ChecksumMismatch(f"tensor {bad[0]!r} in the daemon's memory does not match its checksum sample "
                                       f"({len(bad)} tensor(s) differ); the daemon at {path} serves corrupt memory: "
                                       f"restart it")
            tv = time.perf_counter()
            # part of the skeleton: its first call may import vLLM's rotary-embedding module (suspected cause of
            # 0.02 s of weights-phase time no phase explained in TP=2 workers on the H200)
            registered = _skeleton_registrations(vllm_config)
            with set_default_torch_dtype(model_config.dtype):
                with torch.device("meta"):
                    model = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
            phases["skeleton_s"] = round(time.perf_counter() - tv, 4)
            tick += phases["skeleton_s"]  # the skeleton is not part of the weights phase
            tv = time.perf_counter()
            mapped = views(buf, entries)
            tensors = {name: (entry["kind"], mapped[name].clone() if mode == "copy" else mapped[name])
                       for name, entry in entries.items()}
            nbytes = sum(int(entry["nbytes"]) for entry in entries.values())
            mapped = buf = None
            phases["views_s"] = round(time.perf_counter() - tv, 4)
            tv = time.perf_counter()
            install(model, tensors, man.get("aliases", {}), man.get("reprocess", []), man.get("attrs", {}),
                    man.get("object_attrs", {}))
            phases["install_s"] = round(time.perf_counter() - tv, 4)
            lap("map_verify_install_s")
            reprocess_modules(model, man.get("reprocess", []), model_config)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            lap("reprocess_s")
            lease.attach(mode)
        except BaseException:
            _forget_skeleton(registered)
            lease.close()
            raise
        if mode == "copy":  # the clones are complete (synchronized above) before the daemon may free the source
            freed = lease.release()
            lease.close()
            del tensors
            lease.segment.close()  # every tensor is a clone: nothing views the mapping any more
            logger.info("fastload: copy mode: daemon %s its memory", "freed" if freed else "kept (zero_copy clients)")
            if freed and device.type == "cuda":
                # vLLM's profiler took its free-memory baseline while the daemon held these bytes; freeing them
                # during the load would read as negative non-torch memory and grow the KV cache beyond
                # gpu_memory_utilization. Count them once more as weights to cancel that (vLLM < 0.33).
                from .accounting import count_as_weights, has_external_weight_hook

                if not has_external_weight_hook():
                    count_as_weights(device.index, lease.segment.size)
        else:
            _LEASES.append(lease)
            if device.type == "cuda":
                from .accounting import count_as_weights

                count_as_weights(device.index, lease.segment.size)
        logger.info("Mapped %d tensors from the weight cache daemon (%s mode)", len(man["tensors"]), mode)
        lap("release_s")
        # CPU seconds of this thread from the fingerprint on, skeleton included: far below the wall time means
        # the load waited (GPU copies, the daemon, or other threads holding the GIL).
        phases["thread_cpu_s"] = round(time.thread_time() - cpu0, 4)
        # The span comparable to a disk loader's weight loading: fetch + map + verify + install (+ copy).
        phases["weights_phase_s"] = round(phases["connect_manifest_s"] + phases["map_verify_install_s"]
                                          + phases["release_s"], 4)
        n_re = len(man.get("reprocess", []))
        report = LoadReport(load_format=LOAD_FORMAT, source=path, verb="mapped", tensors=len(man["tensors"]),
                            bytes=nbytes, wall_s=time.perf_counter() - t0, fingerprint=fp.short(),
                            weights_phase_s=phases["weights_phase_s"],
                            note=f"no disk read (re-processing {n_re} module(s) {phases['reprocess_s']:.3f} s)",
                            shards=len(plan.files))
        report.extra.update(mode=mode, reprocessed_modules=n_re, **phases)
        return model.eval(), report

