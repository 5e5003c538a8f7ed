"""``bertforge data checksum``: a manifest of md5 sums and sizes, verified later, every difference named."""

import hashlib
import shutil
import subprocess

import pytest
from conftest import shared_data

from bertforge.cli import main
from bertforge.data.checksum import parse_manifest


@pytest.fixture
def shards(tmp_path):
    directory = tmp_path / "records"
    (directory / "eval").mkdir(parents=True)
    for i in range(3):
        (directory / f"part-{i:05d}-of-00003").write_bytes(bytes(range(256)) * (i + 1) + b"part %d" % i)
    (directory / "eval" / "eval_10k").write_bytes(b"eval records")
    (directory / ".part-00003-of-00003.tmp-42").write_bytes(b"a writer's temporary")
    return directory


@pytest.mark.smoke
def test_manifest_holds_md5_and_size_of_every_file(shards, capsys):
    manifest = shards.parent / "records.md5"  # beside the directory: a run reads every file in it
    assert main(["data", "checksum", str(shards), "--workers", "2"]) == 0
    assert capsys.readouterr().out == f"{manifest}: md5 and size of 4 files, 1,566 bytes\n"
    entries = parse_manifest(manifest)
    assert [e.name for e in entries] == ["eval/eval_10k", "part-00000-of-00003", "part-00001-of-00003",
                                         "part-00002-of-00003"]
    for e in entries:
        data = (shards / e.name).read_bytes()
        assert (e.size, e.md5) == (len(data), hashlib.md5(data).hexdigest())
    # md5sum reads the same file
    if shutil.which("md5sum"):
        checked = subprocess.run(["md5sum", "-c", str(manifest)], cwd=shards, capture_output=True, text=True)
        assert checked.returncode == 0 and checked.stdout.count(": OK") == 4


def test_verify_names_every_changed_missing_or_extra_file(shards, capsys):
    manifest = shards.parent / "records.md5"
    assert main(["data", "checksum", str(shards)]) == 0
    assert main(["data", "checksum", str(shards), "--verify"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{shards}: all 4 files match {manifest}"
    part0 = shards / "part-00000-of-00003"
    data = bytearray(part0.read_bytes())
    data[100] ^= 1  # same size, other content
    part0.write_bytes(bytes(data))
    (shards / "part-00001-of-00003").unlink()
    (shards / "part-00002-of-00003").write_bytes(b"short")
    (shards / "part-00003-of-00003").write_bytes(b"new")
    assert main(["data", "checksum", str(shards), "--verify"]) == 1
    expected_md5 = parse_manifest(manifest)[1].md5
    assert capsys.readouterr().out.splitlines() == [
        f"part-00000-of-00003: md5 {hashlib.md5(data).hexdigest()}, the manifest says {expected_md5}",
        "part-00001-of-00003: missing",
        "part-00002-of-00003: 5 bytes, the manifest says 774",
        "part-00003-of-00003: not in the manifest",
        f"{shards}: 4 difference(s) from {manifest}",
    ]


def test_an_existing_manifest_is_kept_and_a_damaged_one_named(shards, capsys):
    manifest = shards.parent / "records.md5"
    assert main(["data", "checksum", str(shards)]) == 0
    before = manifest.read_text()
    assert main(["data", "checksum", str(shards)]) == 2
    assert "records.md5 exists: --verify checks the directory against it, --overwrite replaces it" \
        in capsys.readouterr().err
    assert manifest.read_text() == before
    manifest.write_text(before.replace("  part-00001", " part-00001"))
    assert main(["data", "checksum", str(shards), "--verify"]) == 2
    assert f"{manifest}:7: not a manifest line" in capsys.readouterr().err
    assert main(["data", "checksum", str(shards / "none"), "--verify"]) == 2
    assert capsys.readouterr().err == f"error: {shards / 'none'}: not a directory\n"


@pytest.mark.shared_data
def test_real_records_verify(tmp_path, capsys):
    record = shared_data("tfrecord/graphcore_sample_text.tfrecord")
    (tmp_path / "records").mkdir()
    shutil.copy(record, tmp_path / "records" / record.name)
    assert main(["data", "checksum", str(tmp_path / "records")]) == 0
    (entry,) = parse_manifest(tmp_path / "records.md5")
    assert (entry.size, entry.md5) == (record.stat().st_size, hashlib.md5(record.read_bytes()).hexdigest())
    assert main(["data", "checksum", str(tmp_path / "records"), "--verify"]) == 0


def test_verify_against_a_plain_md5sum_list_checks_the_files_it_names(shards, capsys):
    """MLPerf publishes its 500 text parts' md5 as an md5sum list (bert_reference_results_text_md5.txt,
    checked with ``md5sum --check`` in results4/): --manifest LIST verifies a directory against such a
    list, ``MD5  NAME`` and binary-mode ``MD5 *NAME`` lines alike; a file it does not name is not a
    difference (as with md5sum -c); a changed or missing one is."""
    parts = sorted(p.name for p in shards.glob("part-*"))
    lines = [f"{hashlib.md5((shards / name).read_bytes()).hexdigest()}{'  ' if i else ' *'}{name}"
             for i, name in enumerate(parts)]
    if shutil.which("md5sum"):  # the same lines as md5sum writes
        made = subprocess.run(["md5sum", *parts[1:]], cwd=shards, capture_output=True, text=True, check=True)
        assert made.stdout.splitlines() == lines[1:]
    listing = shards.parent / "bert_reference_results_text_md5.txt"
    listing.write_text("\n".join(lines) + "\n")
    assert main(["data", "checksum", str(shards), "--verify", "--manifest", str(listing)]) == 0
    assert capsys.readouterr().out == f"{shards}: all 3 files match {listing}\n"  # eval/ is not listed
    (shards / "part-00001-of-00003").write_bytes(b"changed")
    (shards / "part-00002-of-00003").unlink()
    assert main(["data", "checksum", str(shards), "--verify", "--manifest", str(listing)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"part-00001-of-00003: md5 {hashlib.md5(b'changed').hexdigest()}, the manifest says {lines[1][:32]}",
        "part-00002-of-00003: missing",
        f"{shards}: 2 difference(s) from {listing}"]
    listing.write_text("not a checksum line\n")
    assert main(["data", "checksum", str(shards), "--verify", "--manifest", str(listing)]) == 2
    assert capsys.readouterr().err == (f"error: {listing}:1: not a manifest line (MD5  NAME, after # SIZE bytes "
                                       "in ours): 'not a checksum line'\n")
