"""FileIdentity of gs:// and az:// objects through the clients runai's GCS and Azure backends build (stand-ins for
the backends: neither is installed here, and there is no local emulator in the test environment)."""

import sys
import types

import pytest

from vllm_fastload.errors import StorageError
from vllm_fastload.storage import FileIdentity, file_identity


def _backend(monkeypatch, package, client):
    files = types.ModuleType(f"{package}.files.files")
    files._create_client = lambda: client
    for name, mod in ((package, types.ModuleType(package)), (f"{package}.files", types.ModuleType(f"{package}.files")),
                      (f"{package}.files.files", files)):
        monkeypatch.setitem(sys.modules, name, mod)


def test_gcs_identity_is_size_etag_and_generation(monkeypatch):
    asked = []

    class Bucket:
        def __init__(self, name):
            self.name = name

        def get_blob(self, key):
            asked.append((self.name, key))
            if key != "m/a.safetensors":
                return None
            return types.SimpleNamespace(size=1234, etag="CJ+2", generation=1700000000123456)

    _backend(monkeypatch, "runai_model_streamer_gcs", types.SimpleNamespace(bucket=Bucket))
    assert file_identity("gs://bk/m/a.safetensors") == FileIdentity(1234, etag="CJ+2", version_id="1700000000123456")
    assert asked == [("bk", "m/a.safetensors")]
    with pytest.raises(StorageError, match=r"^cannot stat gs://bk/m/gone.safetensors: FileNotFoundError: no such "
                                           r"object: gs://bk/m/gone.safetensors"):
        file_identity("gs://bk/m/gone.safetensors")


def test_azure_identity_is_size_etag_and_version(monkeypatch):
    class Service:
        def get_blob_client(self, container, key):
            assert (container, key) == ("ctr", "m/a.safetensors")
            props = types.SimpleNamespace(size=99, etag='"0x8DC"', version_id="2024-01-01T00:00:00.0000000Z")
            return types.SimpleNamespace(get_blob_properties=lambda: props)

    _backend(monkeypatch, "runai_model_streamer_azure", Service())
    assert file_identity("az://ctr/m/a.safetensors") == FileIdentity(
        99, etag='"0x8DC"', version_id="2024-01-01T00:00:00.0000000Z")
