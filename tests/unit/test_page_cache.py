"""page_cache_fraction: mincore over sampled windows, as fs_strategy auto uses it to pick buffered reads."""

import os

import pytest

from vllm_fastload.storage import page_cache_fraction


def _write(path, nbytes):
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())


def _fs_type(path) -> str:
    """Filesystem type of the mount holding ``path`` (from /proc/self/mounts; '' when unknown)."""
    best, kind = "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                _, mnt, fstype = line.split()[:3]
                if str(path).startswith(mnt.rstrip("/") + "/") and len(mnt) > len(best):
                    best, kind = mnt, fstype
    except OSError:
        pass
    return kind


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise (Linux)")
def test_resident_then_evicted(tmp_path):
    if _fs_type(tmp_path.resolve()) in ("tmpfs", "ramfs"):
        pytest.skip("tmp_path is in memory: its pages cannot be evicted")
    p = tmp_path / "w.bin"
    _write(p, 64 * 2**20 + 123)  # larger than 64 windows x 64 pages: the sampled path
    assert page_cache_fraction([str(p)]) == 1.0  # just written: in the page cache
    fd = os.open(p, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages are dropped
    finally:
        os.close(fd)
    assert page_cache_fraction([str(p)]) < 0.5


def test_sparse_file_is_not_resident_and_small_files_are_read_whole(tmp_path):
    sparse = tmp_path / "s.bin"
    with open(sparse, "wb") as f:
        f.truncate(8 * 2**30)  # 8 GiB of holes: nothing cached, and no 2M-page vector needed to say so
    small = tmp_path / "small.bin"
    _write(small, 10_000)
    assert page_cache_fraction([str(sparse)]) == 0.0
    assert page_cache_fraction([str(small)]) == 1.0
    f = page_cache_fraction([str(small), str(sparse)])
    assert 0.0 < f < 0.01  # 3 resident pages of 3 + 64 x 64 sampled
    assert page_cache_fraction([]) is None and page_cache_fraction(["s3://b/k"]) is None
