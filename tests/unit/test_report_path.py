"""report_path is written by renaming a temporary file over it: only a regular file of this user, or a new path, may
sit there. Anything else (a device such as /dev/full, a FIFO, a directory, a symbolic link, another user's file) is
refused before the load with one line naming the path (issue 27, item 2)."""

import os
import socket

import pytest

from vllm_fastload.config import StreamerConfig
from vllm_fastload.errors import ConfigError
from vllm_fastload.report import LoadReport


def cfg(path):
    return StreamerConfig.from_extra({"report_path": str(path)})


def test_a_new_path_and_an_own_regular_file_are_accepted(tmp_path):
    assert cfg(tmp_path / "new" / "r.json").report_path.endswith("r.json")
    (tmp_path / "old.json").write_text("{}")
    cfg(tmp_path / "old.json")


@pytest.mark.parametrize("make,kind", [
    (lambda p: os.mkfifo(p), "is a FIFO"),
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: p.symlink_to("/etc/hostname"), "is a symbolic link (to '/etc/hostname')"),
    (lambda p: socket.socket(socket.AF_UNIX).bind(str(p)), "is a socket"),
])
def test_what_a_rename_would_replace_is_refused_naming_the_path(tmp_path, make, kind):
    p = tmp_path / "target"
    make(p)
    with pytest.raises(ConfigError, match=r"invalid value for key 'report_path'") as e:
        cfg(p)
    assert f"report_path {str(p)!r} {kind}" in str(e.value)


def test_a_device_file_is_refused():
    with pytest.raises(ConfigError,
                       match=r"report_path '/dev/full' is a device file; the report is written by renaming"):
        cfg("/dev/full")
    assert os.path.exists("/dev/full") and not os.path.isfile("/dev/full")


def test_another_users_file_is_refused(tmp_path):
    if os.getuid() != 0:
        pytest.skip("needs root to make a file of another uid")
    p = tmp_path / "theirs.json"
    p.write_text("{}")
    os.chown(p, 65534, 65534)
    with pytest.raises(ConfigError, match=r"belongs to uid 65534, not to this process"):
        cfg(p)


def test_a_path_that_changed_after_the_check_is_not_replaced(tmp_path, warnings_logged):
    p = tmp_path / "r.json"
    cfg(p)  # fine when the config was read
    os.mkfifo(p)  # and a FIFO by the time the report is written
    LoadReport(load_format="runai_streamer", source="x").emit(str(p))
    assert os.path.exists(p) and not os.path.isfile(p)
    assert any("load report not written" in w and "is a FIFO" in w for w in warnings_logged)


def test_a_report_that_cannot_be_written_is_a_warning_and_the_load_stands(warnings_logged):
    """/proc accepts no new files (even from root): the write fails after a good load; that is a WARNING naming the
    path and the reason, not an exception that would take the engine down (adversarial pass, 2026-12-02)."""
    LoadReport(load_format="runai_streamer", source="x").emit("/proc/fastload-report-test.json")
    assert not os.path.exists("/proc/fastload-report-test.json")
    assert any("load report not written to '/proc/fastload-report-test.json'" in w and "the load itself succeeded"
               in w for w in warnings_logged)


def test_a_folder_this_user_cannot_write_is_refused_before_the_load(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    # root passes permission bits, so the folder is made unwritable for the check itself
    monkeypatch.setattr("vllm_fastload.report.os.access", lambda p, m: False if str(p) == str(ro) else real(p, m))
    with pytest.raises(ConfigError, match=r"report_path .*ro/sub/r.json.*cannot create files in .*ro'; name a path "
                                          r"in a folder you can write"):
        cfg(ro / "sub" / "r.json")
    (ro / "r.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"cannot create files in"):
        cfg(ro / "r.json")
