"""Read once per host, fan out: the ranks of one tensor-parallel group that share a host split the checkpoint's
bytes, each streams only its share (:func:`.direct.stream_tensors`), and every tensor goes from the rank that read
it to the others by a broadcast over the device process group (NCCL on GPUs, gloo on CPU). Each rank's
``weight_loader`` then sees every tensor of the checkpoint, whole, exactly as with per-rank reads.

Who reads what (:func:`assign_owners`): tensors are dealt out largest first to the rank with the fewest bytes so
far (longest-processing-time scheduling), so the shares differ by at most one tensor's bytes; ties go to the lower
rank, so every rank computes the same assignment from the same headers. Zero-byte tensors are read by nobody.

Which ranks form a group (:func:`fanout_groups`): the ranks of vLLM's TP group (``get_tp_group().ranks``, global
ranks) that report the same host identity (:func:`host_identity`); a TP group spanning hosts makes one group per
host, each reading the whole checkpoint once. With pipeline parallelism every stage has its own TP group, hence
its own fan-out. A rank alone on its host reads per rank, as without fan-out.

One round (:meth:`Fanout.run`): every rank takes the next tensor its own stream finished (blocking), then the
group exchanges one int64 per rank over a gloo group of its own (the tensor's index, -1 when the rank has read its
whole share, -2 when its read failed); then each announced tensor is broadcast from its reader, in rank order,
as raw bytes (``uint8``: every dtype, FP8 and bool included, crosses bit for bit); then the round's tensors are
yielded. The broadcasts are asynchronous on the GPU (PyTorch's NCCL process group orders them after the current
stream and the current stream after them), so reads, H2D copies, NVLink traffic and ``weight_loader`` overlap;
only the 8-byte exchange synchronizes the CPUs once per round. Rounds end when every rank announced -1.

Failure: a rank whose stream raises announces -2; the group then exchanges the error texts and every rank
raises (:class:`FanoutError` on the others, naming the failed rank and its message). A rank that dies or stops
answering makes the others' exchange fail within ``distributed_timeout_s`` (the gloo group's timeout). The round's
tensors are yielded only after all of its broadcasts were issued, so a consumer that stops iterating (its own error)
stops between rounds and tells the others with -2 as well.

Extra device memory: the tensors of one round (at most one per rank) beyond what per-rank reads hold; the
largest round is reported (``peak_round_bytes``).

PyTorch facts used (docs "Distributed communication package"): ``broadcast``'s ``src`` is a global rank;
``new_group(..., use_local_synchronization=True)`` is called by the group's members only; a gloo group's
``timeout`` bounds each of its collectives; NCCL collectives run on an internal stream ordered after the caller's
current stream, and a synchronous call makes the current stream wait for it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

from ..checkpoint import TensorInfo, torch_dtypes
from ..errors import FastloadError

#: One tensor of the fan-out: ``(file index, the tensor's header entry)``; ``(file index, name)`` is its key.
Entry = tuple[int, TensorInfo]

#: Descriptor codes exchanged each round (besides a tensor's index >= 0).
DONE, FAILED = -1, -2


class FanoutError(FastloadError):
    """Another rank of the fan-out group failed while reading its share; the message names it and its error."""


def host_identity() -> str:
    """This host's identity for grouping ranks: hostname plus the kernel's boot id (two containers on one machine
    with different hostnames count as two hosts, which is safe: each then reads once; the boot id tells apart
    machines that share a hostname)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def fanout_groups(ranks: Sequence[int], hosts: Sequence[str]) -> list[tuple[int, ...]]:
    """Split one TP group's global ``ranks`` (in group order) into fan-out groups by host: ``hosts[i]`` is the
    host identity of ``ranks[i]``. Returns one tuple of global ranks per host, in order of first appearance;
    a tuple of one rank means that rank reads alone. Raises ``ValueError`` when the lengths differ."""
    if len(ranks) != len(hosts):
        raise ValueError(f"{len(ranks)} ranks but {len(hosts)} host identities")
    groups: dict[str, list[int]] = {}
    for r, h in zip(ranks, hosts):
        groups.setdefault(h, []).append(r)
    return [tuple(g) for g in groups.values()]


def assign_owners(sizes: Sequence[int], n: int) -> list[int]:
    """Reader (0..n-1) of each tensor, balanced by bytes: largest first to the least loaded, ties to the lower
    index. ``sizes`` are bytes per tensor; a zero-byte tensor gets -1 (nobody reads it). Deterministic."""
    if n < 1:
        raise ValueError(f"a fan-out group needs >= 1 rank, got {n}")
    load = [0] * n
    owner = [-1] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        if sizes[i] <= 0:
            continue
        r = min(range(n), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


@dataclass
class FanoutStats:
    """What one fan-out load did (bytes, seconds): ``read_bytes`` read by this rank, ``received_bytes`` broadcast
    to it by the others, ``sync_s`` spent in the per-round exchange (waiting for the slowest rank's next tensor
    included), ``peak_round_bytes`` the largest round (the extra device memory of the fan-out)."""

    ranks: tuple[int, ...] = ()
    rounds: int = 0
    read_bytes: int = 0
    received_bytes: int = 0
    sync_s: float = 0.0
    peak_round_bytes: int = 0
    tensors_read: int = 0
    tensors_received: int = 0

    def to_dict(self) -> dict:
        """The fields as a JSON-ready dict (``ranks`` a list, ``sync_s`` rounded to 0.1 ms): the load report's
        ``extra["fanout"]``."""
        return {"ranks": list(self.ranks), "rounds": self.rounds, "read_bytes": self.read_bytes,
                "received_bytes": self.received_bytes, "sync_s": round(self.sync_s, 4),
                "peak_round_bytes": self.peak_round_bytes, "tensors_read": self.tensors_read,
                "tensors_received": self.tensors_received}


class Fanout:
    """The fan-out of one group: ``ranks`` (global ranks, group order), ``me`` (this process's index in it),
    ``sync_group`` (gloo, for the per-round exchange; its timeout bounds every wait), ``data_group`` (the group
    the tensors are broadcast over: NCCL for CUDA tensors, gloo for CPU ones). ``own_groups``: process groups this
    object created and destroys in :meth:`close`."""

    def __init__(self, ranks: Sequence[int], me: int, sync_group: Any, data_group: Any, own_groups: Sequence = (),
                 distributed_timeout_s: Optional[float] = None):
        self.ranks, self.me, self.distributed_timeout_s = tuple(ranks), me, distributed_timeout_s
        self.sync_group, self.data_group = sync_group, data_group
        self._own = list(own_groups)
        self.stats = FanoutStats(ranks=self.ranks)

    def owners(self, entries: Sequence[Entry]) -> list[int]:
        """Reader of each entry (index into :attr:`ranks`, -1 for zero-byte tensors), see :func:`assign_owners`."""
        return assign_owners([t.nbytes for _, t in entries], len(self.ranks))

    def run(self, entries: Sequence[Entry], owner: Sequence[int], own_stream: Iterator[tuple[tuple[int, str], Any]],
            device: Any) -> Iterator[tuple[str, Any]]:
        """Yield ``(name, tensor on device)`` for every entry: zero-byte tensors first (made here), then the
        rounds (module docstring). ``own_stream`` yields ``(key, tensor)`` for exactly the entries this rank owns,
        in any order. Raises what ``own_stream`` raised (this rank) or :class:`FanoutError` (another rank failed),
        ``RuntimeError`` from torch.distributed when a rank stops answering within the sync group's timeout."""
        import torch

        device, dtypes = torch.device(device), torch_dtypes()
        index = {(f, t.name): i for i, (f, t) in enumerate(entries)}
        n = len(self.ranks)
        slots = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        mine = torch.zeros(1, dtype=torch.int64)
        own_iter = iter(own_stream)
        exhausted = False
        error: Optional[BaseException] = None
        try:
            self._same_plan(entries, owner)
            for (_, t), o in zip(entries, owner):
                if o < 0:
                    yield t.name, torch.empty(t.shape, dtype=dtypes[t.dtype], device=device)
            while True:
                tensor = None
                code = DONE
                if not exhausted:
                    try:
                        key, tensor = next(own_iter)
                        code = index[key]
                    except StopIteration:
                        exhausted = True
                    except Exception as e:  # noqa: BLE001 - told to the group, then re-raised
                        error, code = e, FAILED
                codes = self._exchange(code, slots, mine)
                if FAILED in codes:
                    self._raise_failed(codes, error)
                if all(c == DONE for c in codes):
                    break
                out = self._broadcast_round(codes, entries, tensor, device, dtypes)
                del tensor
                while out:
                    yield out.pop(0)
        except GeneratorExit:
            # the consumer stopped between rounds: the others are about to exchange the next round's codes
            try:
                self._exchange(FAILED, slots, mine)
                self._gather("the model's weight_loader stopped consuming tensors on this rank")
            except Exception:  # noqa: BLE001 - the others are told as well as can be; this rank is unwinding
                pass
            raise
        finally:
            close = getattr(own_iter, "close", None)
            if close is not None:
                close()

    def _broadcast_round(self, codes: Sequence[int], entries: Sequence[Entry], tensor: Any, device: Any,
                         dtypes: dict) -> list[tuple[str, Any]]:
        """One round: every rank's tensor of this round (``codes[r]``: its entry index, < 0 = none) broadcast from
        its reader to the others of the host, in rank order; ``tensor`` is this rank's, ``dtypes`` maps safetensors
        dtype strings to torch's. Returns ``(name, tensor)`` of each, counted in :attr:`stats`."""
        import torch
        import torch.distributed as dist

        from .devmem import transient_empty

        self.stats.rounds += 1
        out, round_bytes = [], 0
        for src, c in enumerate(codes):
            if c < 0:
                continue
            info = entries[c][1]
            if src == self.me:
                t = tensor
                self.stats.read_bytes += info.nbytes
                self.stats.tensors_read += 1
            else:
                t = transient_empty(info.shape, dtypes[info.dtype], device)  # outside vLLM's sleep pool (devmem)
                self.stats.received_bytes += info.nbytes
                self.stats.tensors_received += 1
            dist.broadcast(t.reshape(-1).view(torch.uint8), src=self.ranks[src], group=self.data_group)
            out.append((info.name, t))
            round_bytes += info.nbytes
        self.stats.peak_round_bytes = max(self.stats.peak_round_bytes, round_bytes)
        return out

    def _same_plan(self, entries: Sequence[Entry], owner: Sequence[int]) -> None:
        """Every rank must plan the same tensors (names, dtypes, shapes, readers): a broadcast of a size the
        receiver did not expect is undefined behaviour in NCCL. Compares a digest of the plan across the group
        (one exchange); raises :class:`FanoutError` on every rank naming the ranks that differ."""
        import hashlib

        plan = repr([(f, t.name, t.dtype, tuple(t.shape), t.nbytes, o) for (f, t), o in zip(entries, owner)])
        digests = self._gather(hashlib.sha256(plan.encode()).hexdigest())
        if len(set(digests)) > 1:
            groups: dict = {}
            for r, d in zip(self.ranks, digests):
                groups.setdefault(d, []).append(r)
            raise FanoutError(
                f"fastload: runai_streamer fan-out over ranks {list(self.ranks)}: the ranks read different "
                f"checkpoints (rank groups {sorted(groups.values())} saw different safetensors headers); were the "
                f"files rewritten during the load, or do the ranks see different paths? Make every rank of a host "
                f"see the same files, or set \"distributed\": false.")

    def _exchange(self, code: int, slots: list, mine: Any) -> list[int]:
        import torch.distributed as dist

        mine.fill_(code)
        t = time.perf_counter()
        try:
            dist.all_gather(slots, mine, group=self.sync_group)
        except RuntimeError as e:
            raise self._silent(e) from e
        self.stats.sync_s += time.perf_counter() - t
        return [int(s.item()) for s in slots]

    def _silent(self, e: BaseException) -> FanoutError:
        """A collective of the group failed: a rank died, or did not answer within the sync group's timeout."""
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        return FanoutError(
            f"fastload: runai_streamer fan-out over ranks {list(self.ranks)}: another rank stopped answering "
            f"(it died, or its next tensor took longer than distributed_timeout_s={self.distributed_timeout_s} s); "
            f"torch.distributed said: {first[:300]}. The failed rank's own log has the cause; raise "
            f"distributed_timeout_s for slow storage, or set \"distributed\": false.")

    def _gather(self, text: Optional[str]) -> list:
        """Every rank's ``text`` (an error message, a digest, None), in group order."""
        import torch.distributed as dist

        texts: list = [None] * len(self.ranks)
        try:
            dist.all_gather_object(texts, text, group=self.sync_group)
        except RuntimeError as e:
            raise self._silent(e) from e
        return texts

    def _raise_failed(self, codes: list[int], error: Optional[BaseException]) -> None:
        texts = self._gather(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        failed = [i for i, c in enumerate(codes) if c == FAILED]
        what = "; ".join(f"rank {self.ranks[i]}: {texts[i] or 'failed'}" for i in failed)
        raise FanoutError(
            f"fastload: runai_streamer fan-out over ranks {list(self.ranks)} stopped: another rank failed while "
            f"reading its share of the checkpoint ({what}). Fix that rank's error; \"distributed\": false in "
            f"--model-loader-extra-config makes every rank read the whole checkpoint itself.")

    def close(self) -> None:
        """Destroy the process groups this fan-out created (not vLLM's)."""
        import torch.distributed as dist

        for g in self._own:
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        self._own = []


def entries_of(headers: Sequence[Any]) -> list[Entry]:
    """Every tensor of ``headers`` (parsed safetensors headers) as ``(file index, TensorInfo)``, in file then
    offset order (the same on every rank)."""
    return [(i, t) for i, h in enumerate(headers) for t in sorted(h.tensors.values(), key=lambda t: (t.begin, t.name))]


def checkpoint_digest(headers: Sequence[Any]) -> str:
    """What must be equal on every rank of a fan-out group for the same bytes to be meant: each shard's path,
    header hash and file identity (size, mtime, device, inode or ETag), as sha256 hex. Two copies of one model in
    different files differ here (safe: those ranks read per rank)."""
    import hashlib

    facts = [(h.path, h.header_sha256, repr(h.identity)) for h in headers]
    return hashlib.sha256(repr(facts).encode()).hexdigest()


def negotiate(distributed: Any, device: Any, distributed_timeout_s: float, reader_off: Optional[str] = None,
         tp: Any = None, headers: Sequence[Any] = ()) -> tuple[Optional[Fanout], Optional[str]]:
    """Decide, together with the other ranks of vLLM's TP group, whether this load fans out.

    ``distributed``: the extra-config value (``"auto"``, True, False); ``device``: the model's device;
    ``reader_off``: why this load cannot read a share through :func:`.direct.stream_tensors` (None: it can);
    ``tp``: the TP group (``ranks``, ``world_size``, ``rank_in_group``, ``cpu_group``, ``device_group`` as vLLM's
    ``GroupCoordinator`` has them), default vLLM's ``get_tp_group()``.
    ``auto`` fans out on CUDA when this rank shares its host with another rank of its TP group and every pair of
    their GPUs has peer access (P2P); True also on CPU and without P2P; False never. Returns ``(Fanout, None)``
    or ``(None, why not)`` (None when there is nothing to say: a single rank, or ``false``). Every rank of the TP
    group must call it (it exchanges host identities and device indices over the group's CPU group); the answer
    is the same on all of them.
    """
    if distributed is False:
        return None, None
    if tp is None:
        try:
            from vllm.distributed.parallel_state import get_tp_group

            tp = get_tp_group()
        except (ImportError, AssertionError, AttributeError):
            return None, None
    if tp.world_size <= 1:
        return None, None
    why = _not_here(distributed, device, reader_off)
    if why:
        return None, why
    import torch.distributed as dist

    # from here on every rank makes the same collective calls in the same order
    me = (host_identity(), device.index if device.type == "cuda" else -1, checkpoint_digest(headers))
    everyone: list = [None] * tp.world_size
    dist.all_gather_object(everyone, me, group=tp.cpu_group)
    groups = fanout_groups(list(tp.ranks), [h for h, _, _ in everyone])
    rank = tp.ranks[tp.rank_in_group]
    mine = next(g for g in groups if rank in g)
    if len(mine) == 1:
        # the other hosts' groups still fan out; this rank reads alone
        return None, f"no other rank of the TP group {list(tp.ranks)} on this host"
    at = {r: everyone[list(tp.ranks).index(r)] for r in mine}
    if len({at[r][2] for r in mine}) > 1:
        # e.g. one model copy per container on a shared hostname, a symlink flipped during start-up: the bytes
        # one rank reads are not the ones another rank would load, so each rank reads its own files
        return None, (f"the ranks {list(mine)} of this host see different checkpoint files (paths, header hashes "
                      f"or file identities differ)")
    if device.type == "cuda":
        no_p2p = _pairs_without_p2p(tp, mine, [at[r][1] for r in mine], device)
        if no_p2p and distributed == "auto":
            pairs = ", ".join(f"cuda:{a}->cuda:{b}" for a, b in no_p2p)
            return None, f"no peer access (P2P) between the GPUs of this host's ranks ({pairs})"
    sync, data, own = _host_groups(tp, mine, distributed_timeout_s)
    return Fanout(mine, mine.index(rank), sync, data, own, distributed_timeout_s=distributed_timeout_s), None


def _not_here(distributed: Any, device: Any, reader_off: Optional[str]) -> Optional[str]:
    """Why this load does not fan out, decided from what every rank of the group has alike (the config, the
    device type, the read path), before any collective call; None: ask the others."""
    if reader_off is not None:
        return f"the fan-out reads through the pinned direct path, which this load does not use ({reader_off})"
    if distributed == "auto" and device.type != "cuda":
        return ("a CPU load: the ranks of a CPU host share its page cache and memory bandwidth "
                "(\"distributed\": true fans out anyway)")
    return None


def _pairs_without_p2p(tp: Any, mine: Sequence[int], members: Sequence[int], device: Any) -> list[tuple[int, int]]:
    """``(from GPU, to GPU)`` pairs among this host's ranks ``mine`` (their GPUs ``members``) without peer access,
    as every rank of the TP group sees it (one all-gather over its CPU group, which every rank must join)."""
    import torch
    import torch.distributed as dist

    def sees(d: int) -> bool:
        return 0 <= d < torch.cuda.device_count() and torch.cuda.can_device_access_peer(device.index, d)

    blind = [d for d in members if d != device.index and not sees(d)]
    verdicts: list = [None] * tp.world_size
    dist.all_gather_object(verdicts, blind, group=tp.cpu_group)
    return sorted({(members[mine.index(r)], d) for r in mine for d in verdicts[list(tp.ranks).index(r)]})


def _host_groups(tp: Any, mine: Sequence[int], timeout_s: float) -> tuple[Any, Any, list]:
    """``(sync, data, own)``: a gloo group of this host's ranks (waits up to ``timeout_s``), the group that carries
    tensors (the TP group's device group when the host holds the whole TP group, else a new one of the same
    backend) and the groups made here, which the fan-out destroys when it closes."""
    import torch.distributed as dist

    sync = dist.new_group(list(mine), backend="gloo", timeout=timedelta(seconds=timeout_s),
                          use_local_synchronization=True)
    own = [sync]
    if tuple(mine) == tuple(tp.ranks):
        data = tp.device_group
    else:
        data = dist.new_group(list(mine), backend=dist.get_backend(tp.device_group), use_local_synchronization=True)
        own.append(data)
    return sync, data, own
