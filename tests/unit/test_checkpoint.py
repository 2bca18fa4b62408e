import json

import pytest
import torch

from tests.conftest import write_raw, write_safetensors
from vllm_fastload.checkpoint import SAFE_INDEX, read_header, select_shards
from vllm_fastload.errors import CheckpointError


def test_header_facts_match_file(tmp_path):
    p = write_safetensors(tmp_path / "a.safetensors", {"w": torch.ones(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)})
    h = read_header(str(p))
    assert h.declared_size == p.stat().st_size
    assert set(h.tensors) == {"w", "b"}
    assert h.tensors["w"].nbytes == 48 and h.tensors["w"].shape == (3, 4) and h.tensors["w"].dtype == "F32"
    assert h.largest.name == "w"


def test_index_selects_named_shards_only(tmp_path):
    for n in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "extra.safetensors"):
        write_safetensors(tmp_path / n, {n: torch.ones(1)})
    (tmp_path / SAFE_INDEX).write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    plan = select_shards(str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in plan.files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert [p.rsplit("/", 1)[1] for p in plan.ignored] == ["extra.safetensors"]
    assert list(plan.files) == vllm_default_choice(tmp_path)


def test_mistral_layout_picks_consolidated_only_like_vllm(tmp_path):
    for n in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "consolidated.safetensors"):
        write_safetensors(tmp_path / n, {n: torch.ones(1)})
    (tmp_path / "params.json").write_text("{}")
    (tmp_path / SAFE_INDEX).write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    plan = select_shards(str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in plan.files] == ["consolidated.safetensors"]
    assert list(plan.files) == vllm_default_choice(tmp_path)


def vllm_default_choice(path):
    """The shard files vLLM's own DefaultModelLoader (load format auto) picks for a local directory."""
    vllm = pytest.importorskip("vllm")  # noqa: F841
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    # (vLLM 0.32 returns 4 values, 0.26 three; the file list is the second in both)
    files = DefaultModelLoader(LoadConfig(load_format="auto"))._prepare_weights(str(path), None, None, True, None)[1]
    return sorted(files)


@pytest.mark.parametrize("quantized", [False, True])
def test_index_naming_missing_shard_is_an_error(tmp_path, quantized):
    if quantized:
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": torch.ones(1)})
    (tmp_path / SAFE_INDEX).write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        select_shards(str(tmp_path))


def test_no_index_takes_all_and_empty_dir_gives_no_files(tmp_path):
    assert select_shards(str(tmp_path)).files == ()
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    assert select_shards(str(tmp_path)).files == ()


def test_duplicate_name_is_an_error(tmp_path):
    raw = b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}'
    p = tmp_path / "d.safetensors"
    p.write_bytes(len(raw).to_bytes(8, "little") + raw + b"ab")
    with pytest.raises(CheckpointError, match=r"d.safetensors: duplicate tensor name 'w'"):
        read_header(str(p))


@pytest.mark.parametrize(
    "kind, expect",
    [
        ("truncated", "truncated"),
        ("junk", "trailing data"),
        ("hole", "hole of 4 bytes before the first tensor"),
        ("huge", "absurdly large"),
        ("longer", "larger than the file"),
        ("dtype", "unknown dtype 'X9'"),
        ("metadata_null", "__metadata__"),
    ],
)
def test_malformed_files_name_the_file(tmp_path, kind, expect):
    hdr = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    data, kw = b"\0" * 8, {}
    if kind == "truncated":
        data = b"\0" * 5
    elif kind == "junk":
        data = b"\0" * 12
    elif kind == "hole":
        hdr = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
        data = b"\0" * 12
    elif kind == "huge":
        kw = {"header_len": 2**40}
    elif kind == "longer":
        kw = {"header_len": 10_000}
    elif kind == "dtype":
        hdr["w"]["dtype"] = "X9"
    elif kind == "metadata_null":
        hdr["__metadata__"] = None
    p = write_raw(tmp_path / f"{kind}.safetensors", hdr, data, **kw)
    with pytest.raises(CheckpointError) as e:
        read_header(str(p))
    assert str(p) in str(e.value) and expect in str(e.value)


@pytest.mark.parametrize("meta", ["absent", {}, {"format": "pt", "note": "x"}])
def test_metadata_forms_that_load(tmp_path, meta):
    hdr = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    if meta != "absent":
        hdr["__metadata__"] = meta
    h = read_header(str(write_raw(tmp_path / "m.safetensors", hdr, b"\0" * 8)))
    assert list(h.tensors) == ["w"] and h.metadata == (None if meta == "absent" else meta)


@pytest.mark.parametrize("meta", [None, {"n": 1}, {"n": None}, ["x"]])
def test_metadata_forms_that_fail_name_the_file(tmp_path, meta):
    hdr = {"__metadata__": meta, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    p = write_raw(tmp_path / "m.safetensors", hdr, b"\0" * 8)
    with pytest.raises(CheckpointError, match=rf"{p}: '__metadata__' must be an object of string values"):
        read_header(str(p))


def test_empty_dtype_names_tensor_and_dtype(tmp_path):
    p = write_raw(tmp_path / "e.safetensors", {"w": {"dtype": "", "shape": [2], "data_offsets": [0, 2]}}, b"\0\0")
    with pytest.raises(CheckpointError, match=r"tensor 'w' has unknown dtype ''"):
        read_header(str(p))


def test_two_names_on_the_same_bytes_are_refused_like_the_default_loader(tmp_path):
    """#6 case 4: two tensor names pointing at the same bytes. vLLM's default loader reads safetensors through the
    safetensors library, which refuses such a file; so do we (before loading anything), naming file and tensor,
    instead of loading one name and leaving the other uninitialized."""
    from safetensors import SafetensorError, safe_open

    hdr = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    p = write_raw(tmp_path / "aliased.safetensors", hdr, b"\0" * 8)
    with pytest.raises(SafetensorError):
        with safe_open(str(p), "pt") as f:
            [f.get_tensor(k) for k in f.keys()]
    with pytest.raises(CheckpointError) as e:
        read_header(str(p))
    assert str(p) in str(e.value) and "overlaps the previous tensor" in str(e.value) and "'b'" in str(e.value)
