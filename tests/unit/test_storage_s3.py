"""Object-storage errors against a local moto S3: one StorageError naming the URI, the cause and the env vars."""

import json
import os
import time

import pytest

pytest.importorskip("runai_model_streamer_s3")
pytest.importorskip("moto")

import requests  # noqa: E402
import torch  # noqa: E402

from tests.conftest import tcp_black_hole  # noqa: E402
from vllm_fastload.checkpoint import read_header, select_shards  # noqa: E402
from vllm_fastload.errors import StorageError  # noqa: E402
from vllm_fastload.servers import free_port  # noqa: E402
from vllm_fastload.storage import list_safetensors, read_range  # noqa: E402


def point_s3_at(monkeypatch, url: str) -> str:
    """Point both S3 clients (boto3's ``AWS_ENDPOINT_URL``, runai's ``RUNAI_STREAMER_S3_ENDPOINT``) at ``url``."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", url)
    monkeypatch.setenv("RUNAI_STREAMER_S3_ENDPOINT", url)
    return url


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
    dead = point_s3_at(monkeypatch, f"http://127.0.0.1:{free_port()}")
    t = time.monotonic()
    with pytest.raises(StorageError) as e:
        list_safetensors("s3://bucket-ok/models/tiny")
    assert "Could not connect" in str(e.value) or "EndpointConnectionError" in str(e.value)
    assert dead in str(e.value)
    assert time.monotonic() - t < 120  # no hang


# --- credentials: public vs private buckets, no / wrong keys, the metadata-service wait --------------------------
#: credential variables a test clears so only what it sets is in effect
CRED_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
             "AWS_EC2_METADATA_DISABLED", "AWS_METADATA_SERVICE_TIMEOUT", "AWS_METADATA_SERVICE_NUM_ATTEMPTS",
             "RUNAI_STREAMER_S3_UNSIGNED", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
             "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN")


@pytest.fixture(scope="module")
def buckets(moto_s3, tmp_path_factory):
    """``pub`` (bucket policy: anyone may list and get) and ``priv`` (no policy), the same one-shard model in each;
    IAM users ``reader`` (s3:* on everything) and ``pub-only`` (s3:* on ``pub`` only) with their keys."""
    import boto3
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("cred-model")
    save_file({"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.bfloat16)},
              str(d / "model.safetensors"))
    pub, priv = moto_s3.upload_dir(d, "pub", "m"), moto_s3.upload_dir(d, "priv", "m")
    admin = dict(endpoint_url=moto_s3.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing")
    boto3.client("s3", **admin).put_bucket_policy(Bucket="pub", Policy=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": "*",
                                                "Action": ["s3:GetObject", "s3:ListBucket"],
                                                "Resource": ["arn:aws:s3:::pub", "arn:aws:s3:::pub/*"]}]}))
    iam = boto3.client("iam", **admin)
    keys = {}
    for user, resources in (("reader", ["*"]), ("pub-only", ["arn:aws:s3:::pub", "arn:aws:s3:::pub/*"])):
        iam.create_user(UserName=user)
        iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": resources}]}))
        k = iam.create_access_key(UserName=user)["AccessKey"]
        keys[user] = (k["AccessKeyId"], k["SecretAccessKey"])
    return {"pub": pub, "priv": priv, "keys": keys, "local": d / "model.safetensors"}


@pytest.fixture
def imds_black_hole():
    """A TCP listener on 127.0.0.1 that never answers: stands in for an instance metadata service that does not
    reply (outside EC2), so no request leaves the host."""
    with tcp_black_hole() as url:
        yield url


@pytest.fixture
def no_creds(moto_s3, monkeypatch, tmp_path, imds_black_hole):
    """Endpoint of the moto server and nothing else: no keys, no profile files, the metadata service NOT disabled
    (its endpoint is the black hole above)."""
    for k in CRED_VARS:
        monkeypatch.delenv(k, raising=False)
    point_s3_at(monkeypatch, moto_s3.endpoint)
    monkeypatch.setenv("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "0")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds_black_hole)
    return monkeypatch


@pytest.fixture
def auth_on(moto_s3, buckets, no_creds):
    """moto checks signatures and IAM policies for every request while the test runs (anonymous requests get a
    500 from moto in this mode, so the no-credential tests run without it)."""
    assert requests.post(moto_s3.endpoint + "/moto-api/reset-auth", data=b"0", timeout=10).status_code == 200
    no_creds.setenv("AWS_EC2_METADATA_DISABLED", "true")
    try:
        yield no_creds
    finally:
        requests.post(moto_s3.endpoint + "/moto-api/reset-auth", data=b"inf", timeout=10)


def load_with_streamer(uri, extra=None, timing=None):
    """RunaiStreamerLoader.load_weights of ``uri`` into the test Sink; returns the tensors it received. ``timing``
    (a list) gets the seconds load_weights took (imports excluded)."""
    pytest.importorskip("vllm")
    from vllm.config.load import LoadConfig

    from tests.conftest import fake_model_config
    from tests.unit.test_loader_inprocess import Sink
    from vllm_fastload.streaming.loader import RunaiStreamerLoader

    loader = RunaiStreamerLoader(LoadConfig(load_format="runai_streamer", model_loader_extra_config=extra or {}))
    sink = Sink({"w": ((64,), torch.float32), "b": ((3, 5), torch.bfloat16)})
    t = time.monotonic()
    try:
        loader.load_weights(sink, fake_model_config(uri))
    finally:
        if timing is not None:
            timing.append(time.monotonic() - t)
    return sink.seen


def test_public_bucket_without_credentials_says_to_set_unsigned(buckets, no_creds):
    t = time.monotonic()
    with pytest.raises(StorageError) as e:
        list_safetensors(buckets["pub"])
    msg = str(e.value)
    assert f"cannot list {buckets['pub']}: no AWS credentials found" in msg
    assert "an anonymous request can read it (a public bucket): set RUNAI_STREAMER_S3_UNSIGNED=1" in msg
    assert "AWS_EC2_METADATA_DISABLED unset" in msg
    assert time.monotonic() - t < 8  # boto3's metadata-service wait is bounded (1 s, 1 attempt)


def test_an_empty_prefix_of_a_public_bucket_is_not_called_readable(buckets, no_creds):
    """Listing a prefix with nothing under it, without credentials: the probe's anonymous listing answers empty. It
    said "the object is readable now" (nothing was read) and asked for credentials (a helper's attack, 2026-12-05)."""
    uri = "s3://pub/nothing-here/"  # the bucket of buckets["pub"]
    with pytest.raises(StorageError) as e:
        list_safetensors(uri)
    msg = str(e.value)
    assert (f"cannot list {uri}: no AWS credentials found (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
            f"~/.aws/credentials, instance metadata); an anonymous request lists the bucket, but no object is under "
            f"nothing-here/: check the URI.") in msg, msg
    assert "readable now" not in msg and "can read it" not in msg


def test_public_bucket_unsigned_loads_the_same_bytes_without_waiting_on_the_metadata_service(buckets, no_creds):
    from safetensors.torch import load_file

    no_creds.setenv("RUNAI_STREAMER_S3_UNSIGNED", "1")
    timing = []
    seen = load_with_streamer(buckets["pub"], timing=timing)
    took = timing[0]
    want = load_file(str(buckets["local"]))
    assert sorted(seen) == ["b", "w"]
    for k, v in want.items():
        assert seen[k].dtype == v.dtype and torch.equal(seen[k].view(torch.uint8), v.view(torch.uint8))
    # The C++ SDK waits 8-10 s per stream on an unanswering metadata service unless AWS_EC2_METADATA_DISABLED is
    # set; the scoped environment sets it for anonymous reads (two streams here: header, then tensors).
    assert took < 5, took
    assert "AWS_EC2_METADATA_DISABLED" not in os.environ  # restored after the load


def test_private_bucket_without_credentials_fails_within_seconds_and_never_falls_back(buckets, no_creds):
    timing = []
    with pytest.raises(StorageError) as e:
        # "fallback" is true by default: object storage has nothing to fall back to
        load_with_streamer(buckets["priv"], timing=timing)
    took = timing[0]
    msg = str(e.value)
    assert f"cannot list {buckets['priv']}: no AWS credentials found" in msg
    assert "an anonymous request got HTTP 403" in msg and "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in msg
    assert "Listing said: NoCredentialsError" in msg
    assert took < 8, took


def test_private_bucket_unsigned_names_the_403_and_the_variable(buckets, no_creds):
    no_creds.setenv("RUNAI_STREAMER_S3_UNSIGNED", "1")
    with pytest.raises(StorageError) as e:
        read_range(buckets["priv"] + "/model.safetensors", 0, 8)
    msg = str(e.value)
    assert f"cannot read {buckets['priv']}/model.safetensors: an anonymous request (RUNAI_STREAMER_S3_UNSIGNED=1) " \
           f"got HTTP 403" in msg
    assert "the bucket is not public; unset RUNAI_STREAMER_S3_UNSIGNED" in msg


def test_valid_keys_read_when_moto_enforces_auth(buckets, auth_on):
    auth_on.setenv("AWS_ACCESS_KEY_ID", buckets["keys"]["reader"][0])
    auth_on.setenv("AWS_SECRET_ACCESS_KEY", buckets["keys"]["reader"][1])
    assert list_safetensors(buckets["priv"]) == [buckets["priv"] + "/model.safetensors"]
    assert read_range(buckets["priv"] + "/model.safetensors", 0, 40) == buckets["local"].read_bytes()[:40]


@pytest.mark.parametrize("case", ["unknown-key-id", "wrong-secret", "no-permission"])
def test_wrong_keys_name_the_status_and_the_variable(buckets, auth_on, case):
    key_id, secret = buckets["keys"]["reader"]
    if case == "unknown-key-id":
        key_id = "AKIAUNKNOWNUNKNOWN00"
        want = "HTTP 403 InvalidAccessKeyId (unknown access key: check AWS_ACCESS_KEY_ID)"
    elif case == "wrong-secret":
        secret = "not-the-secret"
        want = "HTTP 403 SignatureDoesNotMatch (wrong secret key: check AWS_SECRET_ACCESS_KEY)"
    else:
        key_id, secret = buckets["keys"]["pub-only"]
        want = "HTTP 403 AccessDenied (access denied: check credentials and bucket policy)"
    auth_on.setenv("AWS_ACCESS_KEY_ID", key_id)
    auth_on.setenv("AWS_SECRET_ACCESS_KEY", secret)
    uri = buckets["priv"]
    with pytest.raises(StorageError) as e:
        list_safetensors(uri)
    assert f"cannot list {uri}: {want}" in str(e.value) and "AWS_ACCESS_KEY_ID=<set>" in str(e.value)
    with pytest.raises(StorageError) as e:
        read_range(uri + "/model.safetensors", 0, 8)
    assert f"cannot read {uri}/model.safetensors: {want}" in str(e.value)
    assert "File access error" in str(e.value)  # what the streamer itself said, kept as context


def test_refused_endpoint_fails_within_seconds_for_list_read_and_load(s3env, monkeypatch):
    dead = point_s3_at(monkeypatch, f"http://127.0.0.1:{free_port()}")
    for what, call in (("list", lambda: list_safetensors("s3://bucket-ok/models/tiny")),
                       ("read", lambda: read_range("s3://bucket-ok/models/tiny/model.safetensors", 0, 8)),
                       ("list", lambda: load_with_streamer("s3://bucket-ok/models/tiny"))):
        t = time.monotonic()
        with pytest.raises(StorageError) as e:
            call()
        assert time.monotonic() - t < 15
        msg = str(e.value)
        assert f"cannot {what} s3://bucket-ok/models/tiny" in msg and "EndpointConnectionError" in msg and dead in msg
        assert f"AWS_ENDPOINT_URL={dead}" in msg


def test_an_endpoint_that_never_answers_is_bounded_by_the_listing_timeouts(s3env, monkeypatch):
    from vllm_fastload import storage

    with tcp_black_hole() as url:
        point_s3_at(monkeypatch, url)
        # the defaults bound a hung listing to ~20 s (runai's own listing: 60 s read timeout with retries, ~3 min);
        # the test shortens them to keep it quick
        d = storage.LIST_TIMEOUTS
        assert d["read_timeout"] * d["attempts"] <= 30
        monkeypatch.setattr(storage, "LIST_TIMEOUTS", {"connect_timeout": 1, "read_timeout": 1, "attempts": 2})
        t = time.monotonic()
        with pytest.raises(StorageError) as e:
            list_safetensors("s3://bucket-ok/models/tiny")
        assert time.monotonic() - t < 10
        msg = str(e.value)
        assert "cannot list s3://bucket-ok/models/tiny: ReadTimeoutError: Read timeout on endpoint URL" in msg
        assert url in msg


def test_endpoint_only_in_aws_endpoint_url_loads_the_same_bytes(s3env, monkeypatch):
    """#6 case 12: the endpoint given only as AWS_ENDPOINT_URL (path-style, prefix with and without '/') is used
    for listing and for the streamer's reads: a full load returns the file's bytes."""
    from vllm.config.load import LoadConfig

    from tests.conftest import fake_model_config
    from vllm_fastload.streaming.loader import RunaiStreamerLoader

    moto, uri, d = s3env
    monkeypatch.delenv("RUNAI_STREAMER_S3_ENDPOINT", raising=False)
    assert os.environ["AWS_ENDPOINT_URL"] == moto.endpoint
    for src in (uri, uri + "/"):
        got = {}

        class Collect(torch.nn.Module):
            def load_weights(self, weights):
                got.update({k: t.clone() for k, t in weights})  # noqa: B023 - used within this iteration

        cfg = fake_model_config(d)
        cfg.model_weights = src
        RunaiStreamerLoader(LoadConfig(load_format="runai_streamer")).load_weights(Collect(), cfg)
        assert torch.equal(got["w"], torch.arange(10, dtype=torch.float32))
        assert "RUNAI_STREAMER_S3_ENDPOINT" not in os.environ  # set for the load only


def test_listing_and_reading_endpoints_that_differ_are_refused(s3env, monkeypatch):
    _, uri, _ = s3env
    monkeypatch.setenv("RUNAI_STREAMER_S3_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(StorageError, match="AWS_ENDPOINT_URL=.*RUNAI_STREAMER_S3_ENDPOINT=http://127.0.0.1:9.*different"):
        list_safetensors(uri)


# --- issue 15, items 2 and 7: object sizes checked as local sizes are; shard identity from the store -------------
def _put(moto, bucket, key, body, versioned=False):
    s3 = moto.bucket(bucket)
    if versioned:
        s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    return s3.put_object(Bucket=bucket, Key=key, Body=body)


@pytest.mark.parametrize("damage, expect", [
    ("truncated", "file is truncated: {size} bytes, but its header declares {declared}: tensor 'w' (F32, shape [10], "
                  "data_offsets [0, 40]) ends at byte {declared}, past the end of the file (7 bytes missing in all); "
                  "an interrupted download or copy: download or upload the shard again"),
    ("trailing", "4 bytes of trailing data after the last tensor (file {size} bytes, header declares {declared})"),
    ("header_past_end", "header length 10000 bytes is larger than the file ({size} bytes)"),
    ("tiny", "file is 3 bytes, too short for a safetensors header length"),
])
def test_damaged_object_gets_the_local_message_before_any_data_is_read(s3env, tmp_path, damage, expect, capsys):
    """Issue 15, item 2: a truncated shard on s3:// (and every other size check) fails in inspect and in the loader
    with the message a local file gets, naming the URI; no 'transient (timeout, throttling)' diagnosis."""
    from vllm.config.load import LoadConfig

    from tests.conftest import fake_model_config
    from vllm_fastload.cli import main
    from vllm_fastload.errors import CheckpointError
    from vllm_fastload.streaming.loader import RunaiStreamerLoader

    moto, _, d = s3env
    good = (d / "model.safetensors").read_bytes()
    body = {"truncated": good[:-7], "trailing": good + b"junk", "tiny": good[:3],
            "header_past_end": (10_000).to_bytes(8, "little") + good[8:]}[damage]
    local = tmp_path / "local" / "model.safetensors"
    local.parent.mkdir()
    local.write_bytes(body)
    prefix = f"damaged/{damage}"
    _put(moto, "bucket-ok", f"{prefix}/model.safetensors", body)
    uri = f"s3://bucket-ok/{prefix}"
    declared = len(good)
    text = expect.format(size=len(body), declared=declared)
    for src, shard in ((str(local.parent), str(local)), (uri, f"{uri}/model.safetensors")):
        assert main(["inspect", src, "--no-fingerprint", "--json"]) == 1
        assert json.loads(capsys.readouterr().out)["problems"] == [f"{shard}: {text}"]
    cfg = fake_model_config(d)
    cfg.model_weights = uri
    with pytest.raises(CheckpointError) as e:
        RunaiStreamerLoader(LoadConfig(load_format="runai_streamer")).load_weights(torch.nn.Module(), cfg)
    assert str(e.value) == f"{uri}/model.safetensors: {text}"


def test_object_identity_is_size_etag_and_version(s3env):
    """Issue 15, item 7 on object storage: the fingerprint's shard facts carry the object's ETag (and version id on
    a versioned bucket); other values under the same header change it, the same bytes rewritten do not (unversioned)."""
    from vllm_fastload.fingerprint import ShardFacts
    from vllm_fastload.storage import file_identity

    moto, _, d = s3env
    good = (d / "model.safetensors").read_bytes()
    put = _put(moto, "bucket-ok", "ident/model.safetensors", good)
    uri = "s3://bucket-ok/ident/model.safetensors"
    ident = file_identity(uri)
    assert (ident.size, ident.etag, ident.version_id, ident.mtime_ns) == (len(good), put["ETag"], None, None)
    before = ShardFacts.of(read_header(uri))
    assert (before.size, before.etag) == (len(good), put["ETag"])
    changed = good[:-4] + b"\x7f\x7f\x7f\x7f"  # the last value changed, header identical
    _put(moto, "bucket-ok", "ident/model.safetensors", changed)
    after = ShardFacts.of(read_header(uri))
    assert after.header_sha256 == before.header_sha256 and after.etag != before.etag and after != before
    _put(moto, "bucket-ok", "ident/model.safetensors", changed)
    assert ShardFacts.of(read_header(uri)) == after  # same bytes: same ETag, same facts
    v1 = _put(moto, "versioned", "m/model.safetensors", good, versioned=True)
    assert file_identity("s3://versioned/m/model.safetensors").version_id == v1["VersionId"]
    v2 = _put(moto, "versioned", "m/model.safetensors", good)
    assert v2["VersionId"] != v1["VersionId"]
    assert file_identity("s3://versioned/m/model.safetensors").version_id == v2["VersionId"]


def test_empty_object_is_too_short_not_a_storage_error(s3env):
    moto, _, _ = s3env
    _put(moto, "bucket-ok", "empty/model.safetensors", b"")
    from vllm_fastload.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"^s3://bucket-ok/empty/model.safetensors: file is 0 bytes, too short"):
        read_header("s3://bucket-ok/empty/model.safetensors")


def test_the_moto_settings_survive_a_server_that_stalls_mid_response(s3env, monkeypatch):
    """Why the demo's and the e2e tests' S3 rows failed on busy machines ("File access error" about 30-60 s in):
    runai's S3 client drops a request whose body stops for a few seconds (measured: a 5 s stall fails every request,
    after its retries, in about 40 s; a 3 s stall passes). MotoS3.env() (servers.MOTO_CLIENT_ENV) gives it 30 s, so
    the same stalls only slow the load; without those settings this test fails."""
    from runai_model_streamer import SafetensorsStreamer

    from tests.conftest import StallingProxy

    moto, _, _ = s3env
    d = s3env[2]
    from safetensors.torch import save_file

    save_file({f"w{i}": torch.full((1 << 20,), float(i)) for i in range(6)}, str(d / "stall.safetensors"))
    uri = moto.upload_dir(d, "bucket-stall", "m")
    proxy = StallingProxy(moto.port, stall_s=5)
    try:
        point_s3_at(monkeypatch, f"http://127.0.0.1:{proxy.port}")
        with SafetensorsStreamer() as st:
            st.stream_file(uri + "/stall.safetensors")
            got = {name: t.clone() for name, t in st.get_tensors()}
    finally:
        proxy.close()
    assert sorted(got) == [f"w{i}" for i in range(6)] and all(float(got[f"w{i}"][7]) == i for i in range(6))


def test_a_transient_read_failure_names_the_s3_client_settings(s3env):
    """A read that failed while the object is readable now: the message says what to raise and lower."""
    from vllm_fastload.storage import storage_error

    _, uri, _ = s3env
    e = storage_error(uri + "/model.safetensors",
                      ValueError("Could not receive response from libstreamer due to: b'File access error'"))
    msg = str(e)
    assert "the failure was transient" in msg and "RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS" in msg
    assert "RUNAI_STREAMER_S3_MAX_INFLIGHT_MIB" in msg and uri in msg
