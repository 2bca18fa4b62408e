"""Object-storage errors against a local moto S3: one StorageError naming the URI, the cause and the env vars."""

import time

import pytest

pytest.importorskip("runai_model_streamer_s3")
pytest.importorskip("moto")

from vllm_fastload.checkpoint import read_header, select_shards  # noqa: E402
from vllm_fastload.errors import StorageError  # noqa: E402
from vllm_fastload.servers import free_port  # noqa: E402
from vllm_fastload.storage import list_safetensors, read_range  # noqa: E402


@pytest.fixture
def s3env(moto_s3, monkeypatch, tmp_path):
    for k, v in moto_s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RUNAI_STREAMER_S3_ENDPOINT", moto_s3.endpoint)
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "m"
    d.mkdir()
    save_file({"w": torch.arange(10, dtype=torch.float32)}, str(d / "model.safetensors"))
    uri = moto_s3.upload_dir(d, "bucket-ok", "models/tiny")
    return moto_s3, uri, d


def test_list_and_read_work_with_and_without_trailing_slash(s3env):
    _, uri, d = s3env
    for src in (uri, uri + "/"):
        plan = select_shards(src)
        assert [f.rsplit("/", 1)[1] for f in plan.files] == ["model.safetensors"]
    h = read_header(uri + "/model.safetensors")
    local = read_header(str(d / "model.safetensors"))
    assert h.header_sha256 == local.header_sha256 and h.declared_size == local.declared_size
    assert read_range(uri + "/model.safetensors", 0, 8) == (d / "model.safetensors").read_bytes()[:8]


def test_missing_bucket_names_uri_status_and_env(s3env):
    with pytest.raises(StorageError) as e:
        list_safetensors("s3://no-such-bucket/models/x")
    msg = str(e.value)
    assert "s3://no-such-bucket/models/x" in msg and "404" in msg and "NoSuchBucket" in msg
    assert "AWS_ENDPOINT_URL=" in msg and "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING" in msg


def test_missing_key_names_it(s3env):
    _, uri, _ = s3env
    with pytest.raises(StorageError) as e:
        read_range(uri + "/missing.safetensors", 0, 8)
    assert uri + "/missing.safetensors" in str(e.value) and "404" in str(e.value)


def test_unreachable_endpoint_fails_with_the_cause(s3env, monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    monkeypatch.setenv("RUNAI_STREAMER_S3_ENDPOINT", dead)
    t = time.monotonic()
    with pytest.raises(StorageError) as e:
        list_safetensors("s3://bucket-ok/models/tiny")
    assert "Could not connect" in str(e.value) or "EndpointConnectionError" in str(e.value)
    assert dead in str(e.value)
    assert time.monotonic() - t < 120  # no hang
