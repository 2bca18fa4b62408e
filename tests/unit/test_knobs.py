"""streaming.knobs: the read path's environment switches take their documented values and warn, naming the
variable, on any other (adversarial pass, 2026-12-07: FASTLOAD_H2D_DRIVER=true turned the candidate off without a
word)."""

import pytest

from tests.conftest import log_records
from vllm_fastload.streaming.knobs import env_int, env_switch


@pytest.mark.parametrize("raw, want", [("1", True), ("0", False), (" 1 ", True), ("", None)])
def test_a_switch_takes_1_and_0(monkeypatch, raw, want):
    monkeypatch.setenv("FASTLOAD_TEST_SWITCH", raw)
    with log_records() as logs:
        assert env_switch("FASTLOAD_TEST_SWITCH") is want
    assert not logs


def test_an_unset_switch_is_none(monkeypatch):
    monkeypatch.delenv("FASTLOAD_TEST_SWITCH", raising=False)
    assert env_switch("FASTLOAD_TEST_SWITCH") is None


@pytest.mark.parametrize("raw", ["true", "yes", "on", "2", "TRUE"])
def test_any_other_switch_value_is_ignored_with_a_warning_naming_it(monkeypatch, raw):
    monkeypatch.setenv("FASTLOAD_H2D_DRIVER", raw)
    with log_records() as logs:
        assert env_switch("FASTLOAD_H2D_DRIVER") is None
    msgs = [r.getMessage() for r in logs if r.levelname == "WARNING"]
    assert msgs == [f"fastload: FASTLOAD_H2D_DRIVER={raw!r} is not 1 or 0; ignored (the default applies)"]


@pytest.mark.parametrize("raw, want, warns", [("14", 14, False), (" 3", 3, False), ("", 7, False), ("x", 7, True),
                                              ("0", 7, True), ("-2", 7, True), ("1.5", 7, True)])
def test_an_int_knob_takes_a_positive_whole_number(monkeypatch, raw, want, warns):
    monkeypatch.setenv("FASTLOAD_URING_IOWQ_WORKERS", raw)
    with log_records() as logs:
        assert env_int("FASTLOAD_URING_IOWQ_WORKERS", 7) == want
    msgs = [r.getMessage() for r in logs if r.levelname == "WARNING"]
    assert msgs == ([f"fastload: FASTLOAD_URING_IOWQ_WORKERS={raw.strip()!r} is not a whole number > 0; using the "
                     f"default, 7"] if warns else [])


def test_an_int_knob_may_name_its_default(monkeypatch):
    """FASTLOAD_URING_IOWQ_WORKERS=0 means the kernel's default, which is the knob's default: no warning."""
    monkeypatch.setenv("FASTLOAD_URING_IOWQ_WORKERS", "0")
    with log_records() as logs:
        assert env_int("FASTLOAD_URING_IOWQ_WORKERS", 0) == 0
    assert not logs
