"""The manifest's tensor table (columns, issue 28 item 2): what the wire model refuses, and the column-wise
checksums, views and checks giving what the row-by-row definitions give."""

import json

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from vllm_fastload.ipc.daemon.export import pack  # noqa: E402
from vllm_fastload.ipc.memory import layout  # noqa: E402
from vllm_fastload.ipc.memory.memfd import MemfdTransport  # noqa: E402
from vllm_fastload.ipc.wire import protocol  # noqa: E402
from vllm_fastload.ipc.wire.messages import KIND_INDEX, KINDS, MessageError, TensorRow, TensorTable, parse_reply  # noqa: E402


def manifest_frame(table: dict) -> dict:
    return {"type": "manifest", "version": protocol.PROTOCOL_VERSION, "fingerprint": {},
            "segment": {"size": 4096, "transport": "memfd"}, "tensors": table,
            "constructed": {"digest": "0:", "kept": 0}}


def good() -> dict:
    return TensorTable.of({"a": TensorRow("float32", [2, 3], [3, 1], 0, 24, 7, "param"),
                           "b": TensorRow("bfloat16", [5], [1], 256, 10, 2**64 - 1, "buffer")}).model_dump()


def test_a_table_survives_json_and_gives_its_rows_back():
    t = parse_reply(json.loads(json.dumps(manifest_frame(good())))).tensors
    assert len(t) == 2 and t.names == ["a", "b"]
    assert t["a"] == TensorRow("float32", [2, 3], [3, 1], 0, 24, 7, "param")
    assert t["b"] == TensorRow("bfloat16", [5], [1], 256, 10, 2**64 - 1, "buffer")
    assert t.total_bytes() == 34


@pytest.mark.parametrize("change, names", [
    ({"offset": [0]}, "column 'offset' has 1 entries for 2 tensor names"),
    ({"names": ["a", "a"]}, "a tensor name appears twice"),
    ({"dtype": [0, 2]}, "column 'dtype' holds an index outside the 2 names of 'dtypes'"),
    ({"kind": [0, len(KINDS)]}, "column 'kind' holds an index outside"),
    ({"ndim": [2, -1]}, "column 'ndim' holds a negative number"),
    ({"shape": [2, 3]}, "columns 'shape' (2) and 'stride' (3) must hold sum(ndim) = 3 entries"),
    ({"checksum": [0, 2**64]}, "column 'checksum' holds a value outside the unsigned 64-bit range"),
    ({"offset": [0, "256"]}, "field 'tensors.offset.1'"),
])
def test_an_inconsistent_table_is_refused_naming_the_column(change, names):
    with pytest.raises(MessageError, match="invalid 'manifest' message") as e:
        parse_reply(manifest_frame({**good(), **change}))
    assert names in str(e.value)


def test_window_sums_equal_the_row_by_row_definition_for_every_length_class():
    """Spans of 1 byte to :data:`layout.SAMPLE`, around the powers of two, at odd offsets: the sums of
    windows read in power-of-two widths equal one window padded to SAMPLE with its last byte."""
    g = torch.Generator().manual_seed(11)
    buf = torch.randint(0, 256, (40000,), dtype=torch.uint8, generator=g)
    raw = buf.numpy().tobytes()
    weights = layout._word_weights()

    def ref(s, m):
        w = raw[s:s + m] + raw[s + m - 1:s + m] * (layout.SAMPLE - m)
        return sum(int.from_bytes(w[8 * j:8 * j + 8], "little") * x for j, x in enumerate(weights)) % 2**64

    lens = [m for m in [*range(1, 70), 127, 128, 129, 255, 256, 257, 600, 2047, 2048, 2049, 4095, 4096]
            if m < layout.SAMPLE] + [layout.SAMPLE - 1, layout.SAMPLE]
    starts = [(7919 * i) % (40000 - 4096) for i in range(len(lens))] + [40000 - 5]  # the last one at the end
    lens.append(5)
    got = layout._window_sums(buf, np.array(starts), np.array(lens), MemfdTransport())
    assert got.tolist() == [ref(s, m) for s, m in zip(starts, lens)]


def test_windows_at_the_buffers_end_are_read_without_running_past_it():
    a = torch.arange(100, dtype=torch.uint8)
    rows = MemfdTransport().read_windows(a, [0, 90, 96], [8, 10, 4], 16)
    assert rows[0, :8].tolist() == list(range(8))
    assert rows[1, :10].tolist() == list(range(90, 100))
    assert rows[2, :4].tolist() == [96, 97, 98, 99]


def test_gathered_windows_are_the_buffers_bytes_and_a_window_past_its_end_is_refused():
    """The one-gather read a GPU engine uses for many checksum windows (``transport.gather_windows``), here on a
    host buffer: each row is the bytes at its start, also the last window that fits exactly."""
    from vllm_fastload.ipc.memory.transport import gather_windows

    g = torch.Generator().manual_seed(4)
    a = torch.randint(0, 256, (10000,), dtype=torch.uint8, generator=g)
    starts = [0, 1, 17, 4096, 9999 - 255, 10000 - 256, 5]
    rows = gather_windows(a, starts, 256)
    assert rows.shape == (7, 256) and rows.dtype == np.uint8
    raw = a.numpy().tobytes()
    assert [r.tobytes() for r in rows] == [raw[s:s + 256] for s in starts]
    assert gather_windows(a, [], 256).shape == (0, 256)
    with pytest.raises(IndexError, match="10000-byte buffer"):
        gather_windows(a, [0, 10000 - 255], 256)
    with pytest.raises(IndexError):
        gather_windows(a, [-1], 256)


def test_the_cuda_transport_gathers_many_windows_and_copies_those_at_the_end_giving_the_host_checksums():
    """``CudaVmmTransport.read_windows``'s split, on a host buffer (its driver copies replaced by the default
    copies): past GATHER_MIN_WINDOWS the windows inside the buffer are gathered, the one that would run past its
    end is copied alone, and the checksums are the memfd transport's."""
    from vllm_fastload.ipc.memory import cuda_vmm
    from vllm_fastload.ipc.memory.transport import Transport

    copied: list[int] = []

    class HostVmm(cuda_vmm.CudaVmmTransport):
        def _copied(self, buf, starts, lens, width):
            copied.extend(starts)
            return Transport.read_windows(self, buf, starts, lens, width)

    g = torch.Generator().manual_seed(8)
    n = cuda_vmm.GATHER_MIN_WINDOWS + 10
    ts = {f"s{i}": torch.randn(3, generator=g) for i in range(n)}  # 12 bytes each: 16-byte windows
    seg, table = pack(ts)
    buf = seg.buf[:table.offset[-1] + table.nbytes[-1]]  # the last window would run past this end
    assert layout.sample_checksums(buf, table, HostVmm()).tolist() == layout.sample_checksums(
        buf, table, MemfdTransport()).tolist() == table.checksum
    assert copied == [table.offset[-1]]


def test_a_big_table_checks_views_and_checksums_like_row_by_row():
    """Mixed dtypes, strides, empty and scalar tensors, spans under and over SAMPLE: the table's views are the
    tensors, each checksum the one of a table holding that row alone."""
    g = torch.Generator().manual_seed(2)
    ts = {}
    for i in range(300):
        n = int(torch.randint(0, 3000, (1,), generator=g))
        t = torch.randn(n, generator=g)
        ts[f"t{i}"] = [t, t.to(torch.bfloat16), t.reshape(1, -1).t(), torch.tensor(float(i))][i % 4]
    seg, table = pack(ts)
    got = layout.views(seg.buf, table)
    for k, t in ts.items():
        assert torch.equal(got[k], t) and got[k].stride() == t.stride(), k
    crcs = layout.sample_checksums(seg.buf, table).tolist()
    alone = [layout.sample_checksums(seg.buf, TensorTable.of({k: row})).tolist()[0] for k, row in table.rows()]
    assert crcs == alone == table.checksum
    seg.close()


def test_the_first_bad_row_of_a_big_table_is_named():
    seg, table = pack({f"w{i}": torch.ones(4) for i in range(1000)})
    cols = table.model_dump()
    cols["nbytes"][777] = 12
    with pytest.raises(ValueError, match="'w777': 12 bytes do not hold float32"):
        layout.views(seg.buf, TensorTable(**cols))
    seg.close()


def test_views_of_a_buffer_no_whole_dtype_view_fits_are_the_tensors():
    """A buffer whose length is no multiple of float32's size has no float32 view of the whole: those rows are
    viewed slice by slice, the others through their dtype's whole view, empty rows made empty; each is the tensor
    it was packed from."""
    ts = {"f": torch.arange(6.0).reshape(2, 3).t(), "e": torch.empty(0, 3), "h": torch.arange(3.0).to(torch.bfloat16),
          "g": torch.arange(4.0) + 10}
    seg, table = pack(ts)
    end = max(o + n for o, n in zip(table.offset, table.nbytes))
    buf = seg.buf[:end + 2]  # 2 bytes past the last tensor: no multiple of 4
    assert buf.numel() % 4 and not buf.numel() % 2
    got = layout.views(buf, table)
    assert list(got) == table.names
    for k, t in ts.items():
        assert torch.equal(got[k], t) and got[k].stride() == t.stride() and got[k].dtype == t.dtype, k
    seg.close()


def test_host_rows_come_back_as_host_copies_with_their_geometry():
    """Tensors a GPU daemon's model keeps on the host (``host_`` kinds): the engine copies them there in one
    gather, each with its dtype, shape and stride, and installs them under the plain kind."""
    import types

    import torch

    from vllm_fastload.ipc.daemon.export import _kinds
    from vllm_fastload.ipc.engine.mapping import _view_tensors
    from vllm_fastload.ipc.memory.layout import fill, place, to_host

    ts = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(),  # a transposed (strided) view
          "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16), "c": torch.tensor(7, dtype=torch.int64),
          "e": torch.tensor([]), "w": torch.ones(3)}
    table, size = place(ts)
    buf = torch.zeros(size, dtype=torch.uint8)
    fill(buf, ts, table)
    got = to_host(buf, table, [table.index[k] for k in ("a", "b", "c", "e")])
    for k, t in zip(("a", "b", "c", "e"), got):
        assert (t.dtype, t.shape, t.stride()) == (ts[k].dtype, ts[k].shape, ts[k].stride()) and torch.equal(t, ts[k])
        assert t.numel() == 0 or t.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    kinds = _kinds({k: ("attr" if k != "w" else "param", t) for k, t in ts.items()}, torch.device("cuda"))
    assert kinds == {"a": "host_attr", "b": "host_attr", "c": "host_attr", "e": "host_attr", "w": "host_param"}
    assert _kinds({"w": ("param", ts["w"])}, torch.device("cpu")) == {"w": "param"}
    table = table.model_copy(update={"kind": [KIND_INDEX[k] for k in ("host_attr", "buffer", "attr", "attr",
                                                                        "param")]})
    lease = types.SimpleNamespace(manifest=types.SimpleNamespace(tensors=table), segment=types.SimpleNamespace(buf=buf))
    for mode in ("zero_copy", "copy"):
        out = _view_tensors(lease, mode)
        assert out["a"][0] == "attr" and torch.equal(out["a"][1], ts["a"]) and out["a"][1].stride() == (1, 3)
        assert out["w"][0] == "param" and torch.equal(out["w"][1], ts["w"])
        buf_ptr = buf.untyped_storage().data_ptr()
        assert out["a"][1].untyped_storage().data_ptr() != buf_ptr
        assert (out["w"][1].untyped_storage().data_ptr() == buf_ptr) == (mode == "zero_copy")


def test_host_rows_placed_last_are_copied_as_one_span_and_spread_ones_are_gathered(monkeypatch):
    """The daemon places host rows back to back after the others (``place``'s ``last``, as ``pack`` does for the
    ``host_`` kinds): ``to_host`` copies their one span, without the per-row gather; rows spread over the buffer
    (every other tensor) are gathered. Both give each row's bytes, dtype, shape and stride."""
    from vllm_fastload.ipc.daemon.export import pack
    from vllm_fastload.ipc.memory import layout

    g = torch.Generator().manual_seed(5)
    ts = {}
    for i in range(40):
        ts[f"l{i}.w"] = torch.randn(33, 70, generator=g).to(torch.bfloat16).t()  # strided, odd sizes
        ts[f"l{i}.k_scale_cpu"] = torch.randn((), generator=g)
        ts[f"l{i}.idx"] = torch.randint(0, 9, (3,), generator=g)
        ts[f"l{i}.odd"] = torch.randn(3, generator=g).to(torch.bfloat16)  # 6 bytes: a span ending here has no fp32 view
    ts["empty"] = torch.empty(0)
    host = [k for k in ts if not k.endswith(".w")]
    gathered: list[int] = []
    real_gathered = layout._gathered

    def spy(buf, offset, nbytes, rows, size):
        gathered.append(len(rows))
        return real_gathered(buf, offset, nbytes, rows, size)

    monkeypatch.setattr(layout, "_gathered", spy)
    for last, expect_gather in (((), [len(host)]), (set(host), [])):
        table, size = layout.place(ts, last=last)
        assert table.names == list(ts)  # rows keep the tensors' order whatever the offsets
        buf = torch.zeros(size, dtype=torch.uint8)
        layout.fill(buf, ts, table)
        gathered.clear()
        got = layout.to_host(buf, table, [table.index[k] for k in host])
        assert gathered == expect_gather
        for k, t in zip(host, got):
            assert (t.dtype, t.shape, t.stride()) == (ts[k].dtype, ts[k].shape, ts[k].stride()) and torch.equal(t,
                                                                                                                  ts[k])
            assert t.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    # the buffer ends right after the last row's bytes (not at a multiple of the grain): the span is padded
    cut = max(table.offset[i] + table.nbytes[i] for i in range(len(table)) if table.nbytes[i])
    assert cut % 16
    got = layout.to_host(buf[:cut], table, [table.index[k] for k in host])
    assert all(torch.equal(t, ts[k]) for k, t in zip(host, got))
    # pack with host kinds puts those rows after every other one
    seg, table = pack(ts, kinds={k: "host_buffer" for k in host})
    first_host = min(table.offset[table.index[k]] for k in host)
    assert all(table.offset[table.index[k]] < first_host for k in ts if k not in host)
    skipping = layout.views(seg.buf, table, host_rows=False)
    assert [k for k, t in skipping.items() if t is None] == host
    assert all(torch.equal(t, ts[k]) for k, t in skipping.items() if t is not None)


def test_an_unknown_dtype_name_is_a_manifest_error_even_when_no_row_uses_it():
    """``views`` makes a view of the buffer per dtype name of the table: a name no row uses is checked too (it
    was a bare KeyError), and one a row uses names that row."""
    from vllm_fastload.errors import ManifestError
    from vllm_fastload.ipc.memory import layout

    buf = torch.zeros(1024, dtype=torch.uint8)
    cols = dict(names=["a"], dtype=[0], kind=[0], offset=[0], nbytes=[16], ndim=[1], shape=[4], stride=[1],
                checksum=[0])
    with pytest.raises(ManifestError, match="unknown dtype 'float128', which no tensor uses"):
        layout.views(buf, TensorTable(dtypes=["float32", "float128"], **cols))
    with pytest.raises(ManifestError, match="'a' has unknown dtype 'float128'"):
        layout.views(buf, TensorTable(dtypes=["float128"], **cols))
    with pytest.raises(ManifestError, match="unknown dtype 'nope'"):  # no rows at all
        layout.views(buf, TensorTable(names=[], dtypes=["nope"], dtype=[], kind=[], offset=[], nbytes=[], ndim=[],
                                      shape=[], stride=[], checksum=[]))
