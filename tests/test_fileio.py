"""Atomic writes: the final name appears only when the content is complete."""

import pytest

from bertforge.fileio import atomic_directory, atomic_file


def test_atomic_file_appears_only_on_success(tmp_path):
    final = tmp_path / "shard.bin"
    with atomic_file(final) as tmp:
        tmp.write_bytes(b"abc")
        assert not final.exists() and tmp.name.startswith(".shard.bin.tmp-")
    assert final.read_bytes() == b"abc"
    with pytest.raises(RuntimeError):
        with atomic_file(final) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("crash")
    assert final.read_bytes() == b"abc"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.bin"]


def test_atomic_directory_replaces_whole_or_not_at_all(tmp_path):
    final = tmp_path / "step"
    with atomic_directory(final) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_directory(final) as tmp:
            (tmp / "a").write_text("2")
            raise RuntimeError("crash")
    assert (final / "a").read_text() == "1"
    with atomic_directory(final) as tmp:
        (tmp / "b").write_text("3")
    assert sorted(p.name for p in final.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step"]
