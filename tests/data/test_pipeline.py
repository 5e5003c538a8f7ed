"""The whole data chain on the real Wikipedia dump, through the command line:
extract → preprocess → vocab → create (both modes, both formats) → index → inspect → pretrain.
"""

import json

import pytest
from conftest import shared_data

from bertforge.cli import main
from bertforge.data.record_reader import open_records

pytest.importorskip("wikiextractor")
pytest.importorskip("sentencex")


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    dump = shared_data("wiki/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
    root = tmp_path_factory.mktemp("wiki")
    assert main(["data", "wikipedia", "extract", str(dump), str(root / "articles.jsonl")]) == 0
    assert sum(1 for _ in open(root / "articles.jsonl")) == 97
    assert main(["data", "preprocess", str(root / "articles.jsonl"), str(root / "text"),
                 "--shards", "2", "--eval-articles", "5"]) == 0
    assert main(["data", "vocab", str(root / "text" / "train"), str(root / "vocab.txt"),
                 "--vocab-size", "4000"]) == 0
    return root


@pytest.mark.slow
@pytest.mark.parametrize("mode, fmt", [("reference", "tfrecord"), ("fast", "native")])
def test_wikipedia_to_records_to_training(text_dir, mode, fmt, tmp_path, capsys):
    out = tmp_path / "records"
    assert main(["data", "create", "--input", str(text_dir / "text" / "train" / "*.txt"),
                 "--vocab", str(text_dir / "vocab.txt"), "--output", str(out / f"train.{fmt}"),
                 "--seq-len", "128", "--max-predictions", "20", "--dupe-factor", "1",
                 "--mode", mode, "--format", fmt, "--num-output-files", "2"]) == 0
    files = sorted(out.glob(f"*.{fmt}"))  # (a TFRecord has its tokenizer's sidecar beside it)
    assert len(files) == 2
    counts = [len(open_records(f, vocab_size=4000)) for f in files]
    assert sum(counts) > 1000 and min(counts) > 0.4 * sum(counts) / 2
    if fmt == "tfrecord":
        assert main(["data", "index", *map(str, files)]) == 0
        index = files[0].with_suffix(".index")
        offsets = [int(line.split()[0]) for line in index.read_text().splitlines()]
        assert len(offsets) == counts[0] and offsets[0] == 0
    capsys.readouterr()
    assert main(["data", "inspect", str(files[0]), "--vocab", str(text_dir / "vocab.txt"), "--num", "1"]) == 0
    assert "[CLS]" in capsys.readouterr().out
    assert main(["data", "pick-eval", str(files[1]), str(tmp_path / f"eval.{fmt}"), "--num", "64",
                 "--format", fmt]) == 0
    assert len(open_records(tmp_path / f"eval.{fmt}")) == 64

    # Train from the records (the .index files beside them are skipped); the picked records are the eval set.
    assert main(["pretrain", "--config", "tiny", "--data.input", str(out), "--data.vocab", str(text_dir / "vocab.txt"),
                 "--data.eval_input", str(tmp_path / f"eval.{fmt}"), "--steps", "3", "--no-progress",
                 "--run-dir", str(tmp_path / "runs"), "--name", "wiki", "--train.micro_batch_size", "8",
                 "--train.global_batch_size", "8", "--log.every", "1", "--log.tensorboard", "false"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "runs" / "wiki" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("split") != "eval"] == [1, 2, 3]
    assert [r["sequences"] for r in rows if r.get("split") == "eval"] == [64, 64]
