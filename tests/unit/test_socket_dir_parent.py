"""A socket directory whose parent is a file (issue 27, item 7): the message names the file in the way and, when the
path came from XDG_RUNTIME_DIR, says to fix XDG_RUNTIME_DIR (the socket dir itself does not exist to be removed)."""

import pytest

from vllm_fastload.errors import SocketDirError
from vllm_fastload.ipc.wire.paths import SocketDir, socket_dir_spec


@pytest.mark.parametrize("create", [True, False])  # the daemon creates it, the engine only opens it
def test_xdg_runtime_dir_that_is_a_file_names_the_variable(tmp_path, monkeypatch, create):
    runtime = tmp_path / "runtime"
    runtime.write_text("not a directory")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    with pytest.raises(SocketDirError) as e:
        SocketDir.open(socket_dir_spec(None), create=create)
    msg = str(e.value)
    assert f"cannot exist: {runtime} is a regular file, not a directory" in msg
    assert "point XDG_RUNTIME_DIR at this user's runtime directory" in msg and "remove it" not in msg


def test_a_file_in_the_way_of_a_given_directory_is_named(tmp_path):
    """Named, and not to be removed: it may be any file of the user's (a path typed with a file's name in it)."""
    (tmp_path / "f").write_text("x")
    with pytest.raises(SocketDirError, match=rf"cannot exist: {tmp_path / 'f'} is a regular file, not a directory; "
                                             rf"choose another directory") as e:
        SocketDir.open(socket_dir_spec(str(tmp_path / "f" / "socks")), create=True)
    assert "remove" not in str(e.value)
    assert (tmp_path / "f").read_text() == "x"
