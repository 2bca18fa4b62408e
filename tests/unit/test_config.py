import os
import re

import pytest

from vllm_fastload.config import IpcCacheConfig, StreamerConfig, cgroup_memory_max, parse_bytes
from vllm_fastload.errors import ConfigError
from vllm_fastload.streaming.runai_env import config_env


def test_defaults():
    c = StreamerConfig.from_extra(None)
    assert c.fallback is True and c.report_path is None and c.concurrency is None
    assert config_env(c) == {}


def test_valid_values_and_env():
    c = StreamerConfig.from_extra({"concurrency": 8, "memory_limit": "16GiB", "chunk_bytesize": "8MiB"})
    assert c.memory_limit == 16 * 2**30
    assert config_env(c) == {
        "RUNAI_STREAMER_CONCURRENCY": "8",
        "RUNAI_STREAMER_MEMORY_LIMIT": str(16 * 2**30),
        "RUNAI_STREAMER_CHUNK_BYTESIZE": str(8 * 2**20),
    }


@pytest.mark.parametrize("v", [-1, 0, 1, "-1", "512MB"])
def test_memory_limit_valid(v):
    assert isinstance(StreamerConfig.from_extra({"memory_limit": v}).memory_limit, int)


@pytest.mark.parametrize(
    "extra, key, value_text",
    [
        ({"concurrency": "16"}, "concurrency", "'16'"),
        ({"concurrency": 0}, "concurrency", "0"),
        ({"concurrency": -1}, "concurrency", "-1"),
        ({"concurrency": True}, "concurrency", "True"),
        ({"memory_limit": -2}, "memory_limit", "-2"),
        ({"memory_limit": True}, "memory_limit", "True"),
        ({"memory_limit": "lots"}, "memory_limit", "'lots'"),
        ({"chunk_bytesize": 0}, "chunk_bytesize", "0"),
        ({"fallback": "no"}, "fallback", "'no'"),
    ],
)
def test_bad_values_name_key_value_and_form(extra, key, value_text):
    with pytest.raises(ConfigError) as e:
        StreamerConfig.from_extra(extra)
    msg = str(e.value)
    assert f"key {key!r}" in msg and value_text in msg and "Allowed:" in msg


def test_unknown_key_suggests_and_lists_allowed():
    with pytest.raises(ConfigError, match=r"unknown key 'concurency'.*did you mean 'concurrency'.*Allowed keys: "):
        StreamerConfig.from_extra({"concurency": 16})


def test_not_a_dict():
    with pytest.raises(ConfigError, match="must be a JSON object"):
        StreamerConfig.from_extra(["concurrency"])


def test_validation_does_not_touch_environment(monkeypatch):
    monkeypatch.delenv("RUNAI_STREAMER_CONCURRENCY", raising=False)
    with pytest.raises(ConfigError):
        StreamerConfig.from_extra({"concurrency": 4, "memory_limit": -5})
    StreamerConfig.from_extra({"concurrency": 4})
    assert "RUNAI_STREAMER_CONCURRENCY" not in os.environ


def test_parse_bytes():
    assert parse_bytes("1KiB", minimum=0) == 1024
    assert parse_bytes("1KB", minimum=0) == 1000
    assert parse_bytes(" 42 ", minimum=0) == 42
    with pytest.raises(ValueError):
        parse_bytes(1.5, minimum=0)


def test_cgroup_warning(tmp_path, caplog):
    (tmp_path / "memory.max").write_text(str(2 * 2**30) + "\n")
    assert cgroup_memory_max(tmp_path) == 2 * 2**30
    c = StreamerConfig.from_extra({"memory_limit": "4GiB"})
    with caplog.at_level("WARNING", logger="vllm.fastload"):
        msg = c.warn_if_above_cgroup(tmp_path)
    assert msg and "above the container's cgroup memory limit" in msg and str(2 * 2**30) in msg
    assert any("cgroup" in r.message for r in caplog.records)
    assert StreamerConfig.from_extra({"memory_limit": "1GiB"}).warn_if_above_cgroup(tmp_path) is None
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_memory_max(tmp_path) is None


def test_direct_construction_raises_config_error_naming_the_key():
    """Built in Python (not through --model-loader-extra-config) the models raise ConfigError too, as documented."""
    from vllm_fastload.config import IpcCacheConfig, StreamerConfig
    from vllm_fastload.errors import ConfigError

    with pytest.raises(ConfigError, match=r"invalid value for key 'concurrency'.*'16' \(str\)"):
        StreamerConfig(concurrency="16")
    with pytest.raises(ConfigError, match=r"unknown key 'concurency'.*did you mean 'concurrency'"):
        StreamerConfig(concurency=16)
    with pytest.raises(ConfigError, match=r"invalid value for key 'mode' of load format 'ipc_cache'"):
        IpcCacheConfig(mode="mmap")


def test_help_lists_every_key_with_its_description():
    from vllm_fastload.config import IpcCacheConfig, StreamerConfig

    for cls in (StreamerConfig, IpcCacheConfig):
        for name, field in cls.model_fields.items():
            assert f"{name} (default {field.default!r}): {field.description}" in cls.__doc__


@pytest.mark.parametrize("value, expect", [("auto", "auto"), (True, True), (False, False)])
def test_distributed_accepts_auto_and_bools(value, expect):
    from vllm_fastload.config import StreamerConfig

    assert StreamerConfig.from_extra({"distributed": value}).distributed == expect
    assert StreamerConfig.from_extra({}).distributed == "auto"


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_distributed_refuses_other_values(value):
    from vllm_fastload.config import StreamerConfig
    from vllm_fastload.errors import ConfigError

    with pytest.raises(ConfigError, match="key 'distributed'.*Allowed: \"auto\""):
        StreamerConfig.from_extra({"distributed": value})


@pytest.mark.parametrize("value", [float("inf"), 1e300, 2**70, 1e-9, 0.05, 0, -1, float("nan")])
def test_distributed_timeout_out_of_range_is_refused_at_validation(value):
    """Huge values overflowed timedelta inside the fan-out and tiny ones made gloo time out at once: refused
    when the extra-config is read, naming the key."""
    with pytest.raises(ConfigError, match="key 'distributed_timeout_s'.*from 0.1 to 86400"):
        StreamerConfig.from_extra({"distributed_timeout_s": value})


@pytest.mark.parametrize("key,value", [("connect_timeout_s", float("inf")), ("connect_timeout_s", 1e10),
                                       ("state_timeout_s", 86400.5)])
def test_a_timeout_past_a_day_is_refused_naming_the_key(key, value):
    """Unbounded, 1e10 s passed validation and the engine died in the socket call ("timestamp out of range for
    platform time_t") instead of falling back (adversarial pass, 2026-12-02)."""
    with pytest.raises(ConfigError, match=rf"key '{key}' of load format 'ipc_cache'.*at most 86400"):
        IpcCacheConfig.from_extra({key: value})
    assert IpcCacheConfig.from_extra({key: 86400}).model_dump()[key] == 86400.0


def test_an_absurd_concurrency_is_refused_naming_the_key():
    """10**20 passed validation and failed inside libstreamer with "Invalid request parameters"."""
    with pytest.raises(ConfigError, match=r"key 'concurrency'.*from 1 to 4096"):
        StreamerConfig.from_extra({"concurrency": 10**20})


@pytest.mark.parametrize("cls,key", [(StreamerConfig, "report_path"), (IpcCacheConfig, "report_path"),
                                     (IpcCacheConfig, "socket_dir"), (IpcCacheConfig, "socket_path")])
def test_an_empty_path_is_refused_not_silently_ignored(cls, key):
    """``""`` was accepted and meant "no report" / "the default socket dir" (adversarial pass, 2026-12-02)."""
    with pytest.raises(ConfigError, match=rf"key '{key}'.*an empty string names no"):
        cls.from_extra({key: ""})


@pytest.mark.parametrize("key,value", [("chunk_bytesize", "16EiB"), ("chunk_bytesize", 10**23),
                                       ("memory_limit", "100000000000000000000000EiB"), ("pinned_slot_bytes", "2TiB")])
def test_a_size_past_a_tebibyte_is_refused_naming_the_key(key, value):
    """16EiB passed validation and the load died in libstreamer with "Invalid request parameters", past the
    fallback (adversarial pass, 2026-12-05)."""
    with pytest.raises(ConfigError, match=rf"key '{key}' of load format 'runai_streamer'.*at most 1099511627776 bytes"):
        StreamerConfig.from_extra({key: value})
    assert StreamerConfig.from_extra({key: "1TiB"}).model_dump()[key] == 2**40


@pytest.mark.parametrize("value", ["--1", "²", "-"])
def test_a_size_that_only_looks_like_digits_is_a_parse_error(value):
    """``"--1"`` and ``"²"`` passed a digits test and reached int(), whose message named Python internals."""
    with pytest.raises(ConfigError, match=rf"key 'memory_limit'.*cannot parse {value!r} as a size"):
        StreamerConfig.from_extra({"memory_limit": value})


@pytest.mark.parametrize("key", ["socket_dir", "socket_path"])
def test_a_socket_path_with_a_nul_byte_is_refused_naming_the_key(key):
    """Accepted before, it crashed the engine in os.open with "embedded null byte", past the fallback."""
    with pytest.raises(ConfigError, match=rf"key '{key}' of load format 'ipc_cache'.*contains a NUL byte"):
        IpcCacheConfig.from_extra({key: "a\x00b"})


@pytest.mark.parametrize("cls", [StreamerConfig, IpcCacheConfig])
def test_a_key_named_self_is_an_unknown_key(cls):
    """``{"self": 1}`` gave a TypeError ("got multiple values for argument 'self'")."""
    with pytest.raises(ConfigError, match="unknown key 'self'"):
        cls.from_extra({"self": 1})


@pytest.mark.parametrize("value", ["1.5B", "0.1KiB", "1.0000001KB"])
def test_a_size_of_a_fraction_of_a_byte_is_refused(value):
    """pydantic's ByteSize truncates: "1.5B" became 1 byte without a word (adversarial pass, 2026-12-05)."""
    with pytest.raises(ConfigError, match=rf"key 'memory_limit'.*{re.escape(repr(value))} is not a whole number of "
                                          rf"bytes"):
        StreamerConfig.from_extra({"memory_limit": value})
    assert StreamerConfig.from_extra({"memory_limit": "1.5KiB"}).memory_limit == 1536


@pytest.mark.parametrize("cls,key", [(StreamerConfig, "distributed_timeout_s"), (IpcCacheConfig, "connect_timeout_s"),
                                     (IpcCacheConfig, "state_timeout_s")])
def test_a_nan_timeout_is_named_as_nan(cls, key):
    """vLLM's json.loads takes NaN; the range check then said "less than or equal to 86400"."""
    with pytest.raises(ConfigError, match=rf"key '{key}'.*NaN is not a number of seconds"):
        cls.from_extra({key: float("nan")})


@pytest.mark.parametrize("cls,key", [(StreamerConfig, "distributed_timeout_s"), (IpcCacheConfig, "connect_timeout_s"),
                                     (IpcCacheConfig, "state_timeout_s")])
def test_a_timeout_past_floats_range_is_named(cls, key):
    """A JSON integer of 310 digits raised a bare OverflowError from float() (adversarial pass, 2026-12-07)."""
    import json

    with pytest.raises(ConfigError, match=rf"key '{key}'.*too large a number of seconds"):
        cls.from_extra(json.loads(f'{{"{key}": 1{"0" * 309}}}'))
