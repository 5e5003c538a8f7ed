"""GLUE: every task's file layout, the features against google-research/bert (and transformers),
the metrics against scikit-learn and scipy, the leaderboard files, and the download against a
local HTTP server (never the network).

The files are written here, in each task's exact format (header or not, column for column).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import shared_data
from file_server import FileServer, serving_files

from bertforge.data.download import download_file
from bertforge.data.errors import DataError
from bertforge.tasks.finetune import FinetuneError, glue
from bertforge.tasks.finetune import metrics as m
from bertforge.tasks.finetune.glue import GlueError

VOCAB = "vocab/bert-base-uncased-vocab.txt"
MRPC_HEADER = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String"
MNLI_TEST_HEADER = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
                    "sentence1_parse\tsentence2_parse\tsentence1\tsentence2")
MNLI_TRAIN_HEADER = MNLI_TEST_HEADER + "\tlabel1\tgold_label"
MNLI_DEV_HEADER = MNLI_TEST_HEADER + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label"
STSB_TEST_HEADER = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"

# Text that exercises the tokenizer and the reader: quotes (no quoting in GLUE's TSV), accents,
# a final capital sigma, CJK, a trailing space (as SST-2 has), and long enough to truncate.
LONG = ("The \"quick\" brown fox's tale, as told in O'Brien's café: " * 6).strip()
UNICODE = "ΟΔΟΣ naïve 東京 “curly” — dash"


def write(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(("\n".join(lines) + "\n").encode("utf-8"))
    return path


def mnli_row(index: int, a: str, b: str, labels: list[str]) -> str:
    parse = "( ( x ) )"
    return "\t".join([str(index), "31193", "31193n", "government", parse, parse, "(ROOT (S x))",
                      "(ROOT (S y))", a, b, *labels])


@pytest.fixture(scope="module")
def glue_dir(tmp_path_factory) -> Path:
    """A GLUE directory with every task's files, in the official layout and formats."""
    root = tmp_path_factory.mktemp("glue_data")
    cola = ["gj04\t1\t\tOur friends won't buy this analysis, let alone the next one we propose.",
            "gj04\t0\t*\tThey drank the pub.",
            f"cj99\t1\t\t{UNICODE}",
            f"cj99\t0\t*\t{LONG}"]
    write(root / "CoLA/train.tsv", cola)
    write(root / "CoLA/dev.tsv", cola[:2])
    write(root / "CoLA/test.tsv", ["index\tsentence", "0\tBill whistled past the house.", f"1\t{LONG}"])
    write(root / "SST-2/train.tsv", ["sentence\tlabel", "it 's a charming and often affecting journey . \t1",
                                     "unflinchingly bleak and desperate \t0"])
    write(root / "SST-2/dev.tsv", ["sentence\tlabel", f"{UNICODE} \t1"])
    write(root / "SST-2/test.tsv", ["index\tsentence", "0\tuneasy mishmash of styles and genres ."])
    mrpc = [MRPC_HEADER,
            "1\t702876\t702977\tAmrozi accused his brother , whom he called \" the witness \" , of deliberately "
            "distorting his evidence .\tReferring to him as only \" the witness \" , Amrozi accused his brother .",
            f"0\t2108705\t2108831\t{LONG}\t{LONG} {UNICODE}",
            f"1\t1330381\t1330521\t{UNICODE}\tshort"]
    write(root / "MRPC/train.tsv", mrpc)
    write(root / "MRPC/dev.tsv", mrpc[:2])
    write(root / "MRPC/test.tsv", ["index\t#1 ID\t#2 ID\t#1 String\t#2 String",
                                   f"0\t1089874\t1089925\tPCCW 's chief operating officer\t{LONG}",
                                   "1\t3019446\t3019327\tThe world 's two largest\tshort one"])
    stsb_header = STSB_TEST_HEADER + "\tscore"
    write(root / "STS-B/train.tsv", [
        stsb_header,
        "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is taking off."
        "\tAn air plane is taking off.\t5.000",
        f"1\tmain-news\theadlines\t2015\t0002\tnone\tnone\t{LONG}\t{UNICODE}\t0.800"])
    write(root / "STS-B/dev.tsv", [
        stsb_header, "0\tmain-captions\tMSRvid\t2012test\t0000\tnone\tnone\tA man with a hard hat is dancing."
        "\tA man wearing a hard hat is dancing.\t5.000"])
    write(root / "STS-B/test.tsv", [STSB_TEST_HEADER, "0\tmain-captions\tMSRvid\t2012test\t0024\tnone\tnone"
                                    "\tA girl is styling her hair.\tA girl is brushing her hair."])
    write(root / "QQP/train.tsv", [
        "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
        "133273\t213221\t213222\tHow is the life of a math student? Could you describe your own experiences?"
        "\tWhich level of prepration is enough for the exam jlpt5?\t0",
        "402555\t536040\t536041\tHow do I control my horny emotions?",  # a question broken by a newline
        "ok\t0",
        f"360472\t364011\t490273\t{LONG}\t{UNICODE}\t1"])
    write(root / "QQP/dev.tsv", ["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
                                 "201359\t303345\t303346\tWhy are African-Americans so beautiful?"
                                 "\tWhy are hispanics so beautiful?\t0"])
    write(root / "QQP/test.tsv", ["id\tquestion1\tquestion2",
                                  "0\tWould the idea of Trump and Putin in bed together scare you?\tDo you think so?"])
    write(root / "MNLI/train.tsv", [
        MNLI_TRAIN_HEADER,
        mnli_row(0, "Conceptually cream skimming has two basic dimensions - product and geography.",
                 "Product and geography are what make cream skimming work. ", ["neutral", "neutral"]),
        mnli_row(1, LONG, UNICODE, ["entailment", "entailment"]),
        mnli_row(2, UNICODE, LONG, ["contradiction", "contradiction"])])
    for name in ("dev_matched", "dev_mismatched"):
        write(root / f"MNLI/{name}.tsv", [
            MNLI_DEV_HEADER,
            mnli_row(0, "The new rights are nice enough", "Everyone really likes the newest benefits ",
                     ["neutral", "entailment", "neutral", "neutral", "neutral", "neutral"]),
            mnli_row(1, LONG, "\"Quoted\" hypothesis", ["contradiction"] * 6)])
    for name in ("test_matched", "test_mismatched"):
        write(root / f"MNLI/{name}.tsv", [MNLI_TEST_HEADER, mnli_row(0, "Hierbas, ans seco.", "A tasty dish.", []),
                                          mnli_row(1, LONG, UNICODE, [])])
    for task, labels in (("QNLI", ("entailment", "not_entailment")), ("RTE", ("entailment", "not_entailment")),
                         ("WNLI", ("1", "0"))):
        header = "index\tquestion\tsentence" if task == "QNLI" else "index\tsentence1\tsentence2"
        rows = [f"0\tWhat came into force after the new constitution was herald?\t{LONG}\t{labels[0]}",
                f"1\t{UNICODE}\tThe \"quoted\" sentence.\t{labels[1]}"]
        write(root / f"{task}/train.tsv", [header + "\tlabel", *rows])
        write(root / f"{task}/dev.tsv", [header + "\tlabel", rows[1]])
        write(root / f"{task}/test.tsv", [header, "0\tWhat organization is devoted to Jihad?\tIt is one."])
    write(root / "diagnostic/diagnostic.tsv", ["index\tsentence1\tsentence2",
                                               "0\tThe cat sat on the mat.\tThe cat did not sit on the mat.",
                                               f"1\t{UNICODE}\t{LONG}"])
    return root


# ---------------------------------------------------------------- the tasks table


def test_no_torch_sklearn_or_scipy_at_run_time():
    import subprocess
    import sys

    code = ("import sys, bertforge.tasks.finetune.glue, bertforge.tasks.finetune.metrics, bertforge.data.download; "
            "print(sorted(m for m in ('torch', 'sklearn', 'scipy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def test_the_table():
    assert list(glue.TASKS) == ["CoLA", "SST-2", "MRPC", "STS-B", "QQP", "MNLI", "QNLI", "RTE", "WNLI", "AX"]
    assert {t.directory for t in glue.TASKS.values()} == {"CoLA", "SST-2", "MRPC", "STS-B", "QQP", "MNLI",
                                                          "QNLI", "RTE", "WNLI", "diagnostic"}
    assert glue.TASKS["MNLI"].dev_splits == ("dev_matched", "dev_mismatched")
    assert glue.TASKS["MNLI"].test_splits == ("test_matched", "test_mismatched")
    assert glue.TASKS["AX"].splits == ("test",) and glue.TASKS["AX"].model_task == "MNLI"
    assert glue.TASKS["AX"].labels == glue.TASKS["MNLI"].labels == ("contradiction", "entailment", "neutral")
    assert glue.TASKS["STS-B"].is_regression and glue.TASKS["STS-B"].num_labels == 1
    assert glue.TASKS["QNLI"].labels == glue.TASKS["RTE"].labels == ("entailment", "not_entailment")
    assert all(glue.TASKS[t].labels == ("0", "1") for t in ("CoLA", "SST-2", "MRPC", "QQP", "WNLI"))
    assert {name: t.metrics for name, t in glue.TASKS.items() if len(t.metrics) > 1} == {
        "MRPC": ("f1", "accuracy"), "STS-B": ("pearson", "spearman"), "QQP": ("f1", "accuracy")}
    assert {name: t.main_metric for name, t in glue.TASKS.items()} == {
        "CoLA": "mcc", "SST-2": "accuracy", "MRPC": "f1", "STS-B": "spearman", "QQP": "f1",
        "MNLI": "accuracy", "QNLI": "accuracy", "RTE": "accuracy", "WNLI": "accuracy", "AX": "mcc"}
    assert all(t.main_metric in t.metrics for t in glue.TASKS.values())
    assert glue.get_task("sts-b").name == glue.get_task("STSB").name == "STS-B"
    assert glue.get_task("sst2").name == "SST-2" and glue.get_task("diagnostic").name == "AX"
    with pytest.raises(GlueError, match="unknown GLUE task 'squad'"):
        glue.get_task("squad")
    assert issubclass(GlueError, FinetuneError)


# ---------------------------------------------------------------- reading every layout


def test_read_every_task(glue_dir):
    cola = glue.read_task(glue_dir, "CoLA", "train")
    assert cola.text_a[:2] == ["Our friends won't buy this analysis, let alone the next one we propose.",
                               "They drank the pub."]
    assert cola.labels == ["1", "0", "1", "0"] and cola.text_b is None
    assert cola.ids == ["0", "1", "2", "3"] and cola.lines == [1, 2, 3, 4]  # no header
    cola_test = glue.read_task(glue_dir, "cola", "test")
    assert cola_test.ids == ["0", "1"] and cola_test.labels is None and cola_test.lines == [2, 3]

    sst = glue.read_task(glue_dir, "SST-2", "train")
    assert sst.text_a[0] == "it 's a charming and often affecting journey . " and sst.labels == ["1", "0"]
    assert glue.read_task(glue_dir, "SST-2", "test").text_a == ["uneasy mishmash of styles and genres ."]

    mrpc = glue.read_task(glue_dir, "MRPC", "train")  # a byte-order mark before "Quality"
    assert mrpc.text_a[0].startswith('Amrozi accused his brother , whom he called " the witness "')
    assert mrpc.text_b[1] == f"{LONG} {UNICODE}" and mrpc.labels == ["1", "0", "1"]
    mrpc_test = glue.read_task(glue_dir, "MRPC", "test")
    assert mrpc_test.ids == ["0", "1"] and mrpc_test.text_b[1] == "short one"

    sts = glue.read_task(glue_dir, "STS-B", "train")
    assert sts.labels == [5.0, 0.8] and sts.ids == ["0", "1"] and sts.text_b[1] == UNICODE
    assert glue.read_task(glue_dir, "STS-B", "test").text_a == ["A girl is styling her hair."]

    qqp = glue.read_task(glue_dir, "QQP", "train")
    assert qqp.ids == ["133273", "360472"] and qqp.labels == ["0", "1"]
    assert qqp.skipped_lines == [3, 4]  # the broken row's two halves
    assert glue.read_task(glue_dir, "QQP", "test").text_b == ["Do you think so?"]

    mnli = glue.read_task(glue_dir, "MNLI", "train")
    assert mnli.labels == ["neutral", "entailment", "contradiction"] and mnli.ids == ["0", "1", "2"]
    assert mnli.text_b[0] == "Product and geography are what make cream skimming work. "
    dev = glue.read_task(glue_dir, "MNLI", "dev_mismatched")  # 16 columns, gold_label last
    assert dev.labels == ["neutral", "contradiction"] and dev.text_b[1] == '"Quoted" hypothesis'
    assert glue.read_task(glue_dir, "MNLI", "test_matched").text_a == ["Hierbas, ans seco.", LONG]

    for task, labels in (("QNLI", ["entailment", "not_entailment"]), ("RTE", ["entailment", "not_entailment"]),
                         ("WNLI", ["1", "0"])):
        examples = glue.read_task(glue_dir / task, task, "train")  # the task's own directory works too
        assert examples.labels == labels and examples.text_a[1] == UNICODE
        assert examples.text_b[1] == 'The "quoted" sentence.'
    ax = glue.read_task(glue_dir, "AX", "test")
    assert ax.source == glue_dir / "diagnostic" / "diagnostic.tsv" and ax.ids == ["0", "1"]


def test_reading_matches_run_classifier_processors(glue_dir):
    """CoLA, MRPC and MNLI against google-research/bert's own processors."""
    from bert_reference import reference

    rc = reference("run_classifier")
    for task, processor, splits in (("CoLA", rc.ColaProcessor(), ("train", "dev", "test")),
                                    ("MRPC", rc.MrpcProcessor(), ("train", "dev", "test")),
                                    ("MNLI", rc.MnliProcessor(), ("train", "dev_matched", "test_matched"))):
        for split in splits:
            kind = split.split("_")[0]
            theirs = getattr(processor, f"get_{kind}_examples")(str(glue_dir / task))
            ours = glue.read_task(glue_dir, task, split)
            assert ours.text_a == [x.text_a for x in theirs], (task, split)
            assert (ours.text_b or [None] * len(ours)) == [x.text_b for x in theirs], (task, split)
            if kind != "test":
                assert ours.labels == [x.label for x in theirs], (task, split)
            if task == "MNLI":  # its guids carry the file's index column
                assert [f"{kind if kind == 'test' else split}-{i}" for i in ours.ids] == [x.guid for x in theirs]
        assert list(glue.TASKS[task].labels) == processor.get_labels()


def test_malformed_rows_name_the_file_and_line(tmp_path):
    rte = tmp_path / "RTE"
    write(rte / "train.tsv", ["index\tsentence1\tsentence2\tlabel", "0\ta\tb\tentailment", "1\tonly two"])
    with pytest.raises(GlueError, match=r"RTE/train\.tsv:3: 2 columns, RTE train rows need at least 4$"):
        glue.read_task(tmp_path, "RTE", "train")
    write(rte / "dev.tsv", ["index\tsentence1\tsentence2\tlabel", "0\ta\tb\tentailed"])
    with pytest.raises(GlueError, match=r"RTE/dev\.tsv:2: label 'entailed' is not one of entailment, not_entailment"):
        glue.read_task(tmp_path, "RTE", "dev")
    write(rte / "test.tsv", ["index\tsentence1\tsentence2\tlabel", "0\ta\tb\tentailment"])
    glue.read_task(tmp_path, "RTE", "test")  # extra columns are ignored, as by the references
    write(rte / "test.tsv", ["index\tquestion\tsentence", "0\ta\tb"])  # QNLI's test file
    with pytest.raises(GlueError, match=r"RTE/test\.tsv:1: expected RTE test header with 'sentence1' in its "
                                        r"column 2, got 'question'"):
        glue.read_task(tmp_path, "RTE", "test")

    sts = tmp_path / "STS-B" / "train.tsv"
    write(sts, [STSB_TEST_HEADER + "\tscore", "0\tg\tf\ty\t1\tn\tn\ta\tb\t4.2", "1\tg\tf\ty\t1\tn\tn\ta\tb\tfive"])
    with pytest.raises(GlueError, match=r"STS-B/train\.tsv:3: score 'five' is not a number"):
        glue.read_task(tmp_path, "STS-B", "train")
    write(sts, [STSB_TEST_HEADER + "\tscore", "0\tg\tf\ty\t1\tn\tn\ta\tb\tnan"])
    with pytest.raises(GlueError, match=r"train\.tsv:2: score 'nan' is not a number"):
        glue.read_task(tmp_path, "STS-B", "train")
    for score in ("5.2", "-0.5"):  # STS-B's scale is 0 (unrelated) to 5 (the same meaning), both ends included
        write(sts, [STSB_TEST_HEADER + "\tscore", "0\tg\tf\ty\t1\tn\tn\ta\tb\t5.000", "1\tg\tf\ty\t1\tn\tn\ta\tb\t0",
                    f"2\tg\tf\ty\t1\tn\tn\ta\tb\t{score}"])
        with pytest.raises(GlueError, match=rf"STS-B/train\.tsv:4: score '{score}' is outside STS-B's 0-5$"):
            glue.read_task(tmp_path, "STS-B", "train")
    write(sts, [STSB_TEST_HEADER + "\tscore", "0\tg\tf\ty\t1\tn\tn\ta\t4.2"])  # 9 columns
    with pytest.raises(GlueError, match=r"train\.tsv:2: 9 columns, STS-B train rows need at least 10"):
        glue.read_task(tmp_path, "STS-B", "train")

    mnli = tmp_path / "MNLI" / "dev_matched.tsv"
    write(mnli, [MNLI_DEV_HEADER, mnli_row(0, "a", "b", ["neutral"] * 5 + ["-"])])
    with pytest.raises(GlueError, match=r"dev_matched\.tsv:2: label '-' is not one of contradiction, entailment, "
                                        r"neutral"):
        glue.read_task(tmp_path, "MNLI", "dev_matched")
    cola = tmp_path / "CoLA" / "train.tsv"
    write(cola, ["gj04\t1\t\tfine", "gj04\t1\tno sentence"])
    with pytest.raises(GlueError, match=r"CoLA/train\.tsv:2: 3 columns, CoLA train rows need at least 4"):
        glue.read_task(tmp_path, "CoLA", "train")
    write(cola, ["", "gj04\t1\t\tfine"])  # a blank line is a row of no column
    with pytest.raises(GlueError, match=r"CoLA/train\.tsv:1: 0 columns"):
        glue.read_task(tmp_path, "CoLA", "train")
    cola.write_bytes(b"gj04\t1\t\tfine\ngj04\t1\t\tna\xefve\n")
    with pytest.raises(GlueError, match=r"CoLA/train\.tsv:2: not valid UTF-8"):
        glue.read_task(tmp_path, "CoLA", "train")
    cola.write_bytes(b"")
    with pytest.raises(GlueError, match=r"CoLA/train\.tsv: no examples"):
        glue.read_task(tmp_path, "CoLA", "train")
    write(tmp_path / "SST-2" / "dev.tsv", ["sentence\tlabel"])
    with pytest.raises(GlueError, match=r"SST-2/dev\.tsv: no examples"):
        glue.read_task(tmp_path, "SST-2", "dev")
    (tmp_path / "SST-2" / "train.tsv").write_bytes(b"")
    with pytest.raises(GlueError, match=r"SST-2/train\.tsv: the file is empty \(expected a SST-2 train header\)"):
        glue.read_task(tmp_path, "SST-2", "train")
    with pytest.raises(GlueError, match=r": no dev\.tsv in it or in its QNLI/ \(QNLI.s dev split\)"):
        glue.read_task(tmp_path, "QNLI", "dev")
    with pytest.raises(GlueError, match=r"MNLI has no split 'dev'; its splits are train, dev_matched, "
                                        r"dev_mismatched, test_matched, test_mismatched"):
        glue.read_task(tmp_path, "MNLI", "dev")


def test_qqp_short_rows_are_skipped_as_the_references_skip_them(glue_dir, caplog):
    with caplog.at_level("WARNING"):
        qqp = glue.read_task(glue_dir, "QQP", "train")
    assert len(qqp) == 2 and qqp.lines == [2, 5] and qqp.skipped_lines == [3, 4]
    assert "skipped 2 rows with fewer than 6 columns (lines 3, 4)" in caplog.text


# ---------------------------------------------------------------- features


@pytest.fixture(scope="module")
def vocab() -> Path:
    return shared_data(VOCAB)


def _reference_features(rc, tokenizer, examples: glue.GlueExamples, seq_len: int, label_list):
    rows = []
    for i in range(len(examples)):
        # The reference maps every label through a list: STS-B's scores and test sets get a stand-in.
        labels = label_list or ["0"]
        label = labels[0] if examples.labels is None or label_list is None else examples.labels[i]
        example = rc.InputExample(f"x-{i}", examples.text_a[i],
                                  None if examples.text_b is None else examples.text_b[i], label)
        rows.append(rc.convert_single_example(10, example, labels, seq_len, tokenizer))
    return rows


@pytest.mark.parametrize("seq_len", [8, 13, 64])
def test_features_equal_run_classifier(glue_dir, vocab, seq_len):
    from bert_reference import reference

    from bertforge.data.tokenizer import load_tokenizer

    rc = reference("run_classifier")
    ref_tokenizer = reference("tokenization").FullTokenizer(str(vocab), do_lower_case=True)
    tokenizer = load_tokenizer(vocab, lowercase=True)
    truncated = 0
    for name, spec in glue.TASKS.items():
        for split in spec.splits:
            examples = glue.read_task(glue_dir, name, split)
            ours = glue.convert_examples(examples, tokenizer, seq_len)
            theirs = _reference_features(rc, ref_tokenizer, examples, seq_len, spec.labels)
            where = f"{name} {split} seq_len={seq_len}"
            for field_name in ("input_ids", "input_mask", "segment_ids"):
                array = getattr(ours, field_name)
                assert array.dtype == np.int32 and array.shape == (len(examples), seq_len), where
                assert array.tolist() == [getattr(f, field_name) for f in theirs], (where, field_name)
            assert ours.ids == examples.ids
            if examples.labels is None:
                assert ours.labels is None
            elif spec.labels is None:
                assert ours.labels.dtype == np.float32 and ours.labels.tolist() == pytest.approx(examples.labels)
            else:
                assert ours.labels.dtype == np.int64 and ours.labels.tolist() == [f.label_id for f in theirs]
            truncated += ours.truncated
    assert truncated > 0  # the long pairs were cut


@pytest.mark.smoke
def test_features_equal_transformers_on_ascii(vocab):
    """transformers' glue_convert_examples_to_features is ``tokenizer(pairs, padding="max_length",
    truncation=True)`` (its "longest_first"); transformers 5 dropped the function, its tokenizer stays."""
    transformers = pytest.importorskip("transformers")
    from bertforge.data.tokenizer import load_tokenizer

    hf = transformers.BertTokenizer(vocab=str(vocab), do_lower_case=True)
    a = ["The quick brown fox jumps over the lazy dog " * k for k in (1, 3, 5)] + ['He said "no" twice.']
    b = ["A short one.", "Another, longer second sentence " * 4, "x", "Quotes: 'single' and \"double\"."]
    examples = glue.GlueExamples("RTE", "dev", Path("x"), [str(i) for i in range(4)], a, b,
                                 ["entailment"] * 4, [1, 2, 3, 4])
    for seq_len in (9, 24, 128):
        ours = glue.convert_examples(examples, load_tokenizer(vocab), seq_len)
        theirs = hf(list(zip(a, b, strict=True)), max_length=seq_len, padding="max_length", truncation=True)
        assert ours.input_ids.tolist() == theirs["input_ids"]
        assert ours.segment_ids.tolist() == theirs["token_type_ids"]
        assert ours.input_mask.tolist() == theirs["attention_mask"]
    single = glue.GlueExamples("SST-2", "dev", Path("x"), ["0", "1"], a[:2], None, ["0", "1"], [2, 3])
    ours = glue.convert_examples(single, load_tokenizer(vocab), 12)
    theirs = hf(a[:2], max_length=12, padding="max_length", truncation=True)
    assert ours.input_ids.tolist() == theirs["input_ids"]


def test_truncate_pair_equals_the_reference_loop():
    from bert_reference import reference

    rc = reference("run_classifier")
    for a in range(9):
        for b in range(9):
            for max_length in range(0, 14):
                ours_a, ours_b = list(range(a)), list(range(100, 100 + b))
                theirs_a, theirs_b = list(ours_a), list(ours_b)
                glue.truncate_pair(ours_a, ours_b, max_length)
                rc._truncate_seq_pair(theirs_a, theirs_b, max_length)
                assert (ours_a, ours_b) == (theirs_a, theirs_b), (a, b, max_length)


def test_feature_arguments(glue_dir, vocab):
    from bertforge.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(vocab)
    mnli = glue.read_task(glue_dir, "MNLI", "train")
    reordered = glue.convert_examples(mnli, tokenizer, 32, label_list=["entailment", "neutral", "contradiction"])
    assert reordered.labels.tolist() == [1, 0, 2]
    with pytest.raises(GlueError, match=r"labels \['neutral'\] are not in the label list \['entailment', 'contr"):
        glue.convert_examples(mnli, tokenizer, 32, label_list=["entailment", "contradiction"])
    sts = glue.read_task(glue_dir, "STS-B", "train")
    with pytest.raises(GlueError, match="STS-B is a regression task"):
        glue.convert_examples(sts, tokenizer, 32, label_list=["0", "1"])
    with pytest.raises(GlueError, match="seq_len=2 leaves no room"):
        glue.convert_examples(sts, tokenizer, 2)
    assert "truncated=" in repr(glue.convert_examples(sts, tokenizer, 16))


# ---------------------------------------------------------------- metrics


def _oracles():
    scipy_stats = pytest.importorskip("scipy.stats")
    sk = pytest.importorskip("sklearn.metrics")
    return sk, scipy_stats


def test_classification_metrics_equal_sklearn():
    sk, _ = _oracles()
    rng = np.random.default_rng(0)
    cases = []
    for n in (1, 2, 3, 7, 50, 1000):
        for k in (2, 3):
            cases.append((rng.integers(0, k, n), rng.integers(0, k, n)))
    y = rng.integers(0, 2, 40)
    cases += [(y, y), (1 - y, y), (np.zeros(10, int), y[:10]), (y[:10], np.zeros(10, int)),
              (np.ones(5, int), np.ones(5, int)), (np.zeros(5, int), np.zeros(5, int)),
              (np.array([0, 1, 1]), np.array([0, 0, 0])), (np.array([2, 2, 0]), np.array([2, 2, 2]))]
    for p, y in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sklearn warns about 0/0 and single classes
            assert m.accuracy(p, y) == pytest.approx(sk.accuracy_score(y, p), abs=1e-12)
            assert m.matthews_corrcoef(p, y) == pytest.approx(sk.matthews_corrcoef(y, p), abs=1e-12)
            if max(p.max(), y.max()) <= 1:
                assert m.f1_binary(p, y) == pytest.approx(sk.f1_score(y, p), abs=1e-12)
    # All one class: MCC 0, as sklearn; no positive anywhere: F1 0, as sklearn's default.
    assert m.matthews_corrcoef([1, 1, 1], [1, 1, 1]) == 0.0
    assert m.f1_binary([0, 0], [0, 0]) == 0.0
    with pytest.raises(FinetuneError, match="binary F1 needs classes 0 and 1; the predictions hold \\[2\\]"):
        m.f1_binary([0, 2], [0, 1])
    with pytest.raises(FinetuneError, match="no predictions to score"):
        m.accuracy([], [])
    with pytest.raises(FinetuneError, match=r"predictions \(2,\) and labels \(3,\)"):
        m.accuracy([0, 1], [0, 1, 1])


def test_correlations_equal_scipy():
    _, stats = _oracles()
    rng = np.random.default_rng(1)
    cases = [(rng.normal(size=n), rng.normal(size=n)) for n in (2, 3, 10, 500)]
    labels = rng.integers(0, 26, 300) / 5.0  # STS-B-like scores with many ties
    cases += [(labels + rng.normal(0, 1, 300), labels), (np.round(labels), labels),
              (np.array([1.0, 2.0, 2.0, 3.0, 3.0, 3.0]), np.array([3.0, 1.0, 2.0, 2.0, 5.0, 5.0])),
              (np.array([1e12, 1e12 + 1, 1e12 + 3]), np.array([1e-8, 3e-8, 2e-8])),
              (-labels, labels), (labels * 3 + 1, labels)]
    for p, y in cases:
        assert m.pearson(p, y) == pytest.approx(stats.pearsonr(p, y)[0], abs=1e-12)
        assert m.spearman(p, y) == pytest.approx(stats.spearmanr(p, y)[0], abs=1e-12)
        assert m.rank_average(p).tolist() == stats.rankdata(p).tolist()
    # A constant input: NaN, as scipy (and GLUE's scorer, which calls it).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert np.isnan(stats.pearsonr([0.1] * 4, [1.0, 2.0, 3.0, 4.0])[0])
        assert np.isnan(stats.spearmanr([2.0] * 4, [1.0, 2.0, 3.0, 4.0])[0])
    assert np.isnan(m.pearson([0.1] * 4, [1.0, 2.0, 3.0, 4.0]))
    assert np.isnan(m.spearman([2.0] * 4, [1.0, 2.0, 3.0, 4.0]))
    with pytest.raises(FinetuneError, match="at least 2 pairs"):
        m.pearson([1.0], [2.0])


def test_glue_metrics_per_task():
    sk, stats = _oracles()
    p, y = np.array([1, 0, 1, 1, 0, 1]), np.array([1, 0, 0, 1, 1, 1])
    mrpc = m.glue_metrics("MRPC", p, y)
    assert list(mrpc) == ["f1", "accuracy", "score"]
    assert mrpc["f1"] == pytest.approx(sk.f1_score(y, p), abs=1e-12)
    assert mrpc["score"] == pytest.approx((sk.f1_score(y, p) + sk.accuracy_score(y, p)) / 2, abs=1e-12)
    assert m.glue_metrics("cola", p, y) == {"mcc": pytest.approx(sk.matthews_corrcoef(y, p)),
                                            "score": pytest.approx(sk.matthews_corrcoef(y, p))}
    assert list(m.glue_metrics("mnli-mm", p, y)) == ["accuracy", "score"]
    scores, gold = np.array([0.5, 2.0, 4.5, 3.0]), np.array([1.0, 2.2, 4.0, 3.5])
    sts = m.glue_metrics("STS-B", scores, gold)
    assert sts["pearson"] == pytest.approx(stats.pearsonr(scores, gold)[0], abs=1e-12)
    assert sts["spearman"] == pytest.approx(stats.spearmanr(scores, gold)[0], abs=1e-12)
    with pytest.raises(FinetuneError, match="unknown GLUE task 'squad'"):
        m.glue_metrics("squad", p, y)


# ---------------------------------------------------------------- leaderboard files


def test_leaderboard_files(tmp_path, glue_dir):
    expected_names = {"CoLA": "CoLA.tsv", "SST-2": "SST-2.tsv", "MRPC": "MRPC.tsv", "STS-B": "STS-B.tsv",
                      "QQP": "QQP.tsv", "QNLI": "QNLI.tsv", "RTE": "RTE.tsv", "WNLI": "WNLI.tsv", "AX": "AX.tsv"}
    for name, file_name in expected_names.items():
        assert glue.leaderboard_file(name) == file_name
    assert glue.leaderboard_file("MNLI", "test_matched") == "MNLI-m.tsv"
    assert glue.leaderboard_file("MNLI", "test_mismatched") == "MNLI-mm.tsv"

    rte = glue.read_task(glue_dir, "RTE", "test")
    path = glue.write_test_predictions(tmp_path, "RTE", rte.ids, np.array([1]))
    assert path == tmp_path / "RTE.tsv"
    assert path.read_bytes() == b"index\tprediction\n0\tnot_entailment\n"
    ax = glue.read_task(glue_dir, "AX", "test")
    glue.write_test_predictions(tmp_path, "AX", ax.ids, np.array([0, 2]))
    assert (tmp_path / "AX.tsv").read_text() == "index\tprediction\n0\tcontradiction\n1\tneutral\n"
    glue.write_test_predictions(tmp_path, "CoLA", ["0", "1", "7"], np.array([1, 0, 1]))
    assert (tmp_path / "CoLA.tsv").read_text() == "index\tprediction\n0\t1\n1\t0\n7\t1\n"
    mnli = glue.read_task(glue_dir, "MNLI", "test_mismatched")
    glue.write_test_predictions(tmp_path, "MNLI", mnli.ids, np.array([1, 1]), split="test_mismatched")
    assert (tmp_path / "MNLI-mm.tsv").read_text() == "index\tprediction\n0\tentailment\n1\tentailment\n"
    glue.write_test_predictions(tmp_path, "STS-B", ["0", "1", "2", "3"], np.array([-0.2, 2.34567, 5.7, 3.0]))
    assert (tmp_path / "STS-B.tsv").read_text() == "index\tprediction\n0\t0.000\n1\t2.346\n2\t5.000\n3\t3.000\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left

    with pytest.raises(GlueError, match=r"MNLI has no test split 'test' for the leaderboard"):
        glue.write_test_predictions(tmp_path, "MNLI", mnli.ids, np.array([1, 1]))
    with pytest.raises(GlueError, match=r"RTE\.tsv: predictions must be class ids 0\.\.1"):
        glue.write_test_predictions(tmp_path, "RTE", ["0"], np.array([2]))
    with pytest.raises(GlueError, match=r"RTE\.tsv: predictions must be class ids"):
        glue.write_test_predictions(tmp_path, "RTE", ["0"], np.array([0.7]))
    with pytest.raises(GlueError, match=r"RTE\.tsv: 2 ids but predictions of shape \(1,\)"):
        glue.write_test_predictions(tmp_path, "RTE", ["0", "1"], np.array([0]))
    with pytest.raises(GlueError, match=r"RTE\.tsv: the ids are not unique"):
        glue.write_test_predictions(tmp_path, "RTE", ["0", "0"], np.array([0, 1]))
    with pytest.raises(GlueError, match=r"STS-B\.tsv: a score is not finite"):
        glue.write_test_predictions(tmp_path, "STS-B", ["0"], np.array([np.nan]))
    assert (tmp_path / "RTE.tsv").read_bytes() == b"index\tprediction\n0\tnot_entailment\n"  # untouched


# ---------------------------------------------------------------- download


@pytest.fixture
def server(monkeypatch):
    with serving_files(monkeypatch) as srv:
        yield srv


def _zip(members: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, text in members.items():
            zf.writestr(name, text)
    return buffer.getvalue()


def _serve(server: FileServer, name: str, data: bytes) -> glue.Source:
    server.files[name] = data
    return glue.Source(server.url(name), len(data),
                       hashlib.sha256(data).hexdigest())


def _local_sources(server: FileServer, glue_dir: Path) -> dict[str, tuple[glue.Source, ...]]:
    """CoLA and RTE as zips (with the junk real ones carry), MRPC's corpus files, AX's tsv."""
    def task_zip(task: str, archive: str) -> glue.Source:
        members = {f"{task}/{p.name}": p.read_text(encoding="utf-8") for p in sorted((glue_dir / task).iterdir())}
        members["__MACOSX/._junk"] = "x"
        members[f"{task}/original/raw.txt"] = "raw"
        return _serve(server, archive, _zip(members))

    corpus_header = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    train = corpus_header + "1\t702876\t702977\tAmrozi accused his brother .\tReferring to him .\n" \
                            "0\t2108705\t2108831\tYucaipa owned Dominick 's .\tYucaipa bought Dominick 's .\n" \
                            "1\t1330381\t1330521\tThey had published .\tOn June 10 .\n"
    test = corpus_header + "1\t1089874\t1089925\tPCCW 's chief .\tCurrent Chief .\n"
    return {
        "CoLA": (task_zip("CoLA", "CoLA.zip"),),
        "RTE": (task_zip("RTE", "RTE.zip"),),
        "MRPC": (_serve(server, "msr_paraphrase_train.txt", train.encode()),
                 _serve(server, "msr_paraphrase_test.txt", test.encode()),
                 _serve(server, "mrpc_dev_ids.tsv", b"2108705\t2108831\n")),
        "AX": (_serve(server, "AX.tsv", (glue_dir / "diagnostic" / "diagnostic.tsv").read_bytes()),),
    }


def test_sources_are_the_published_ones():
    assert set(glue.SOURCES) == set(glue.TASKS)
    assert glue.SOURCES["CoLA"][0] == glue.Source(
        "https://dl.fbaipublicfiles.com/glue/data/CoLA.zip", 376971,
        "f212fcd832b8f7b435fb991f101abf89f96b933ab400603bf198960dfc32cbff")
    assert glue.SOURCES["QNLI"][0].url.endswith("/QNLIv2.zip") and glue.SOURCES["QQP"][0].url.endswith("QQP-clean.zip")
    assert all(re.fullmatch(r"[0-9a-f]{64}", s.sha256) and s.size > 0 for ss in glue.SOURCES.values() for s in ss)


def test_download_glue_into_the_official_layout(server, glue_dir, tmp_path):
    sources = _local_sources(server, glue_dir)
    out = tmp_path / "glue_data"
    done = glue.download_glue(out, ["cola", "RTE", "MRPC", "diagnostic"], sources=sources, retry_wait=0)
    assert done == {"CoLA": out / "CoLA", "RTE": out / "RTE", "MRPC": out / "MRPC", "AX": out / "diagnostic"}
    for task in ("CoLA", "RTE"):
        for split in ("train", "dev", "test"):
            assert (out / task / f"{split}.tsv").read_bytes() == (glue_dir / task / f"{split}.tsv").read_bytes()
    assert (out / "CoLA" / "original" / "raw.txt").exists() and not (out / "__MACOSX").exists()
    assert glue.read_task(out, "AX", "test").ids == ["0", "1"]
    # MRPC as download_glue_data.py builds it: the corpus header (BOM and all) on train/dev.
    assert (out / "MRPC" / "dev.tsv").read_text(encoding="utf-8") == (
        "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
        "0\t2108705\t2108831\tYucaipa owned Dominick 's .\tYucaipa bought Dominick 's .\n")
    assert glue.read_task(out, "MRPC", "train").labels == ["1", "1"]
    assert (out / "MRPC" / "test.tsv").read_text(encoding="utf-8") == (
        "index\t#1 ID\t#2 ID\t#1 String\t#2 String\n0\t1089874\t1089925\tPCCW 's chief .\tCurrent Chief .\n")
    marker = json.loads((out / "CoLA" / glue.COMPLETE_MARKER).read_text())
    assert marker["task"] == "CoLA" and "train.tsv" in marker["files"]
    assert sorted(p.name for p in out.iterdir()) == ["CoLA", "MRPC", "RTE", "diagnostic"]  # archives deleted

    # Complete: nothing is fetched again.
    count = len(server.requests)
    assert glue.download_glue(out, ["CoLA", "MRPC", "AX", "RTE"], sources=sources) == done
    assert len(server.requests) == count
    assert glue.download_glue(out, "CoLA", sources=sources) == {"CoLA": out / "CoLA"}  # one name
    # Half unpacked (a file lost, or no marker): fetched again and replaced whole.
    (out / "CoLA" / "dev.tsv").unlink()
    (out / "RTE" / glue.COMPLETE_MARKER).unlink()
    glue.download_glue(out, ["CoLA", "RTE"], sources=sources)
    assert [name for name, _ in server.requests[count:]] == ["CoLA.zip", "RTE.zip"]
    assert (out / "CoLA" / "dev.tsv").exists() and glue.is_complete(out / "RTE", glue.TASKS["RTE"])


def test_download_glue_resumes_and_refuses_a_bad_archive(server, glue_dir, tmp_path):
    sources = _local_sources(server, glue_dir)
    size = sources["CoLA"][0].size
    out = tmp_path / "glue_data"
    server.drops = [500, 0, 0]  # a broken connection, then two attempts that add nothing
    with pytest.raises(DataError, match=r"download failed .*CoLA\.zip\.part keeps 500 bytes, run again to resume"):
        glue.download_glue(out, ["CoLA"], sources=sources, retries=1, retry_wait=0)
    assert not (out / "CoLA").exists()
    glue.download_glue(out, ["CoLA"], sources=sources, retry_wait=0)  # a later call resumes
    assert [r for r in server.requests if r[0] == "CoLA.zip"] == [
        ("CoLA.zip", None), ("CoLA.zip", "bytes=500-"), ("CoLA.zip", "bytes=500-"), ("CoLA.zip", "bytes=500-")]
    assert glue.is_complete(out / "CoLA", glue.TASKS["CoLA"]) and size > 500

    wrong = {"RTE": (glue.Source(sources["RTE"][0].url, sources["RTE"][0].size, "0" * 64),)}
    with pytest.raises(DataError, match=r"RTE\.zip: sha256 mismatch: expected 0{64}, got [0-9a-f]{64}; "
                                        r"the downloaded bytes are kept in .*RTE\.zip\.bad"):
        glue.download_glue(out, ["RTE"], sources=wrong)
    assert not (out / "RTE").exists() and (out / glue.DOWNLOADS / "RTE.zip.bad").exists()
    short = {"RTE": (glue.Source(sources["RTE"][0].url, 10, sources["RTE"][0].sha256),)}
    with pytest.raises(DataError, match=r"RTE\.zip: size mismatch: expected 10 bytes, got \d+"):
        glue.download_glue(out, ["RTE"], sources=short)
    not_a_zip = {"RTE": (_serve(server, "RTE2.zip", b"not a zip"),)}
    with pytest.raises(GlueError, match=r"RTE2\.zip: not a readable zip archive"):
        glue.download_glue(out, ["RTE"], sources=not_a_zip)
    wrong_task = {"RTE": (_serve(server, "WNLI.zip", _zip({"WNLI/train.tsv": "x"})),)}
    with pytest.raises(GlueError, match=r"WNLI\.zip: has no RTE/train\.tsv"):
        glue.download_glue(out, ["RTE"], sources=wrong_task)
    assert not (out / "RTE").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".RTE")]  # no temporary directory left


def test_download_file(server, tmp_path):
    source = _serve(server, "data.bin", bytes(range(256)) * 40)
    dest = tmp_path / "sub" / "data.bin"
    server.drops = [1000]
    assert download_file(source.url, dest, sha256=source.sha256, size=source.size, retry_wait=0) == dest
    assert dest.read_bytes() == server.files["data.bin"]
    assert server.requests[-1] == ("data.bin", "bytes=1000-")
    md5 = hashlib.md5(dest.read_bytes()).hexdigest()
    assert download_file(source.url, dest, md5=md5) == dest  # there and verified: not fetched
    assert len(server.requests) == 2
    with pytest.raises(DataError, match=r"data\.bin: md5 mismatch: .*; .*data\.bin is left as it is"):
        download_file(source.url, dest, md5="0" * 32)
    with pytest.raises(DataError, match="no checksum to verify it against"):
        download_file(source.url, tmp_path / "other.bin")
    assert download_file(source.url, tmp_path / "other.bin", verify=False).stat().st_size == source.size
    with pytest.raises(DataError, match="give one checksum, not sha256 and md5"):
        download_file(source.url, dest, sha256=source.sha256, md5=md5)
    with pytest.raises(DataError, match="sha256='abc' is not a sha256 hex digest"):
        download_file(source.url, dest, sha256="abc")
