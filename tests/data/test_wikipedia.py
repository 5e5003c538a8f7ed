"""From a Wikipedia dump to pre-training text, on the real shortened dump in ../shared/data.

download (against a local HTTP server on 127.0.0.1, never the network) ->
extract (wikiextractor + cleaning) -> preprocess (sentences, shards, eval) -> vocab.
"""

from __future__ import annotations

import argparse
import bz2
import hashlib
import json
import re
from pathlib import Path

import pytest
from conftest import shared_data
from file_server import FileServer, serving_files

from bertforge.data import preprocess as prep
from bertforge.data import wikipedia as wiki
from bertforge.data.errors import DataError
from bertforge.data.tokenizer import load_tokenizer, read_vocab

DUMP_NAME = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
DUMP_SHA1 = "7b5fb82629787518600dfdb27b84703f2abad6ee"
DUMP_MD5 = "55899abfb7caa0e50d2665787fa4afca"


@pytest.fixture(scope="module")
def dump() -> Path:
    return shared_data(f"wiki/{DUMP_NAME}")


@pytest.fixture(scope="module")
def dump_xml(dump: Path) -> str:
    return bz2.decompress(dump.read_bytes()).decode("utf-8")


def need_wikiextractor() -> None:
    pytest.importorskip("wikiextractor", reason=f"needs wikiextractor=={wiki.WIKIEXTRACTOR_VERSION}")


def need_sentencex() -> None:
    pytest.importorskip("sentencex", reason=f"needs sentencex=={prep.SENTENCEX_VERSION}")


@pytest.fixture(scope="module")
def extracted(dump: Path, tmp_path_factory) -> tuple[Path, wiki.ExtractStats]:
    need_wikiextractor()
    out = tmp_path_factory.mktemp("extract") / "articles.jsonl"
    return out, wiki.extract(dump, out)


@pytest.fixture(scope="module")
def articles(extracted) -> list[dict]:
    return [json.loads(line) for line in extracted[0].read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def preprocessed(extracted, tmp_path_factory) -> tuple[Path, prep.PreprocessStats]:
    need_sentencex()
    out = tmp_path_factory.mktemp("pre") / "corpus"
    return out, prep.preprocess(extracted[0], out, shards=2, eval_articles=5, seed=12345)


def _documents(path: Path) -> list[list[str]]:
    """Documents of a pre-training text file, read independently of the code under test."""
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n\n") and "\n\n\n" not in text
    return [block.split("\n") for block in text[:-2].split("\n\n")]


# ---------------------------------------------------------------- extract

def test_extract_counts(extracted, articles, dump_xml):
    _, stats = extracted
    # 206 pages: 100 redirects and 106 articles, of which 8 are disambiguation
    # pages and one ("List of anthropologists") has under 200 characters of prose.
    assert (stats.pages, stats.redirects, stats.other_namespaces) == (206, 100, 0)
    assert (stats.extracted, stats.disambiguation, stats.too_short, stats.articles) == (106, 8, 1, 97)
    assert (stats.paragraphs, stats.headings, stats.characters) == (5246, 1671, 2570659)
    assert len(articles) == 97
    assert sum(len(a["text"]) - a["text"].count("\n") for a in articles) == stats.characters
    assert [a["title"] for a in articles[:3]] == ["Anarchism", "Autism", "Albedo"]
    ids = [int(a["id"]) for a in articles]
    assert ids == sorted(ids)  # the dump's order

    redirect_titles = set(re.findall(r"<title>([^<]*)</title>\s*<ns>\d+</ns>\s*<id>\d+</id>\s*<redirect",
                                     dump_xml))
    assert len(redirect_titles) == 100
    assert not redirect_titles & {a["title"] for a in articles}
    titles = {a["title"] for a in articles}
    assert not {"Austin (disambiguation)", "Ada", "Aa River", "List of anthropologists"} & titles


def test_extract_leaves_no_markup(articles, dump_xml):
    text = "\n".join(a["text"] for a in articles)
    for leftover in ("[[", "]]", "{{", "}}", "<ref", "</", "&amp;", "&nbsp;", "''", "()", "\xa0", "  ", "\t"):
        assert text.count(leftover) == 0, leftover
    assert all(line == line.strip() and line for a in articles for line in a["text"].split("\n"))
    # The dump's "AT&amp;T" comes out as "AT&T".
    assert "AT&T" in text
    # Section headings are gone: "==Characteristics==" of Autism is no paragraph.
    autism = next(a for a in articles if a["title"] == "Autism")
    assert "==Characteristics==" in dump_xml
    assert "Characteristics." not in autism["text"].split("\n")
    assert autism["text"].startswith("Autism is a neurodevelopmental disorder characterized by")


def test_extract_is_deterministic_across_process_counts(dump, extracted, tmp_path):
    out = tmp_path / "again.jsonl"
    stats = wiki.extract(dump, out, processes=2)
    assert out.read_bytes() == extracted[0].read_bytes()
    assert stats.articles == 97
    assert [p.name for p in tmp_path.iterdir()] == ["again.jsonl"]  # no temporaries left


def test_extract_refuses_what_is_not_a_dump(dump, dump_xml, tmp_path):
    need_wikiextractor()
    text = tmp_path / "notes.xml"
    text.write_text("These are notes, not a dump.\n")
    with pytest.raises(DataError, match=r"notes\.xml: not a MediaWiki XML dump \(it starts with 'These"):
        wiki.extract(text, tmp_path / "out.jsonl")

    fake_bz2 = tmp_path / "plain.xml.bz2"
    fake_bz2.write_text(dump_xml[:5000])
    with pytest.raises(DataError, match=r"plain\.xml\.bz2: not a readable \.bz2 file"):
        wiki.extract(fake_bz2, tmp_path / "out.jsonl")

    truncated = tmp_path / "truncated.xml.bz2"
    truncated.write_bytes(dump.read_bytes()[:800_000])
    with pytest.raises(DataError, match=r"truncated\.xml\.bz2: .*end-of-stream marker"):
        wiki.extract(truncated, tmp_path / "out.jsonl")

    broken = tmp_path / "broken.xml"  # a real dump's beginning, cut in the middle of a page
    broken.write_text(dump_xml[:100_000], encoding="utf-8")
    with pytest.raises(DataError, match=r"broken\.xml: not valid XML \(.*line \d+"):
        wiki.extract(broken, tmp_path / "out.jsonl")

    with pytest.raises(DataError, match=r"missing\.xml\.bz2"):
        wiki.extract(tmp_path / "missing.xml.bz2", tmp_path / "out.jsonl")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.xml", "notes.xml", "plain.xml.bz2",
                                                          "truncated.xml.bz2"]


def test_clean_paragraph_on_leftovers():
    # The shapes removed templates leave in real articles (Achilles, Abraham Lincoln, Albedo).
    assert (wiki.clean_paragraph('In Greek mythology, Achilles (;, "Akhilleus",) was a Greek hero')
            == 'In Greek mythology, Achilles ("Akhilleus") was a Greek hero')
    assert (wiki.clean_paragraph("Abraham Lincoln (; February 12, 1809 – April 15, 1865) was")
            == "Abraham Lincoln (February 12, 1809 – April 15, 1865) was")
    assert wiki.clean_paragraph("Albedo () or reflection coefficient") == "Albedo or reflection coefficient"
    assert (wiki.clean_paragraph("the [[Free Territory|free]] {{citation needed}}territory<ref>x</ref> of "
                                 "'''Ukraine'''&nbsp;in 1919")
            == "the free territory of Ukraine in 1919")
    # Agricultural science: escaped markup goes, an escaped "<" in prose stays.
    assert (wiki.clean_paragraph("&lt;onlyinclude&gt;Agricultural science is a broad field&lt;/onlyinclude&gt;")
            == "Agricultural science is a broad field")
    assert wiki.clean_paragraph("found in the &lt;10 ppm level") == "found in the <10 ppm level"


# ---------------------------------------------------------------- sentences

# Real paragraphs of the dump (as extracted) and their expected sentences.
TRICKY = [
    # Decimals at a sentence's end.
    (("Enceladus, a moon of Saturn, has one of the highest known albedos of any body in the Solar "
     "System, with 99% of EM radiation reflected. Another notable high-albedo body is Eris, with an "
     "albedo of 0.96. Many small objects in the outer Solar System and asteroid belt have low albedos "
     "down to about 0.05. A typical comet nucleus has an albedo of 0.04."),
     [("Enceladus, a moon of Saturn, has one of the highest known albedos of any body in the Solar "
      "System, with 99% of EM radiation reflected."),
      "Another notable high-albedo body is Eris, with an albedo of 0.96.",
      "Many small objects in the outer Solar System and asteroid belt have low albedos down to about 0.05.",
      "A typical comet nucleus has an albedo of 0.04."]),
    # "v.", a missing space after a period, and "U.S." before the end.
    (('In 1954, the US Supreme Court ruled in "Brown v. Board of Education" that public schools had to '
     "be desegregated, but Alabama was slow to comply. During the 1960s, under Governor George Wallace, "
     "Alabama resisted compliance with federal demands for desegregation.The civil rights movement had "
     "notable events in Alabama, including the Montgomery Bus Boycott (1955–56), Freedom Rides in 1961, "
     "and 1965 Selma to Montgomery marches. These contributed to Congressional passage and enactment of "
     "the Civil Rights Act of 1964 and Voting Rights Act of 1965 by the U.S. Congress."),
     [('In 1954, the US Supreme Court ruled in "Brown v. Board of Education" that public schools had to '
      "be desegregated, but Alabama was slow to comply."),
      ("During the 1960s, under Governor George Wallace, Alabama resisted compliance with federal demands "
      "for desegregation."),
      ("The civil rights movement had notable events in Alabama, including the Montgomery Bus Boycott "
      "(1955–56), Freedom Rides in 1961, and 1965 Selma to Montgomery marches."),
      ("These contributed to Congressional passage and enactment of the Civil Rights Act of 1964 and "
      "Voting Rights Act of 1965 by the U.S. Congress.")]),
    # An initial ("Frank M. Johnson") and case names.
    (('In 1962 "White v. Crook", Judge Frank M. Johnson ordered the state to redistrict. United States '
     'Supreme Court cases of "Baker v. Carr" (1962) and "Reynolds v. Sims" (1964) ruled that the '
     'principle of "one man, one vote" needed to be the basis of both houses of state legislatures as well'),
     ['In 1962 "White v. Crook", Judge Frank M. Johnson ordered the state to redistrict.',
      ('United States Supreme Court cases of "Baker v. Carr" (1962) and "Reynolds v. Sims" (1964) ruled '
      'that the principle of "one man, one vote" needed to be the basis of both houses of state '
      "legislatures as well")]),
    # A quotation of two sentences stays whole; "St." does not end a sentence.
    (("Zhuangzi's philosophy has been described by various sources as anarchist. Zhuangzi wrote, "
     '"A petty thief is put in jail. A great brigand becomes a ruler of a Nation." Diogenes of Sinope '
     "and the Cynics, their contemporary Zeno of Citium, the founder of Stoicism, also introduced "
     "similar topics."),
     ["Zhuangzi's philosophy has been described by various sources as anarchist.",
      'Zhuangzi wrote, "A petty thief is put in jail. A great brigand becomes a ruler of a Nation."',
      ("Diogenes of Sinope and the Cynics, their contemporary Zeno of Citium, the founder of Stoicism, "
      "also introduced similar topics.")]),
    (("In 1872, the conflict climaxed with a final split between the two groups at the Hague Congress, "
     "where Bakunin and James Guillaume were expelled from the International and its headquarters were "
     "transferred to New York. In response, the federalist sections formed their own International at "
     "the St. Imier Congress, adopting a revolutionary anarchist program."),
     [("In 1872, the conflict climaxed with a final split between the two groups at the Hague Congress, "
      "where Bakunin and James Guillaume were expelled from the International and its headquarters were "
      "transferred to New York."),
      ("In response, the federalist sections formed their own International at the St. Imier Congress, "
      "adopting a revolutionary anarchist program.")]),
    # Decimals and percentages inside sentences.
    (("Globally, autism is estimated to affect 21.7 million people as of 2013. As of 2010, the number of "
     "people affected is estimated at about 1–2 per 1,000 worldwide. It occurs four to five times more "
     "often in boys than girls. About 1.5% of children in the United States (one in 68) are diagnosed "
     "with ASD, a 30% increase from one in 88 in 2012. The rate of autism among adults aged 18 years and "
     "over in the United Kingdom is 1.1%."),
     ["Globally, autism is estimated to affect 21.7 million people as of 2013.",
      "As of 2010, the number of people affected is estimated at about 1–2 per 1,000 worldwide.",
      "It occurs four to five times more often in boys than girls.",
      ("About 1.5% of children in the United States (one in 68) are diagnosed with ASD, a 30% increase "
      "from one in 88 in 2012."),
      "The rate of autism among adults aged 18 years and over in the United Kingdom is 1.1%."]),
]


@pytest.mark.parametrize("paragraph, sentences", TRICKY, ids=["decimals", "v.-U.S.", "initial",
                                                              "quote", "St.", "percent"])
def test_sentence_splitting_on_real_sentences(paragraph, sentences, articles):
    need_sentencex()
    assert any(paragraph in a["text"] for a in articles)  # taken from the extracted dump
    assert prep.split_sentences(paragraph) == sentences
    assert prep.split_sentences("  \xa0 ") == []


# ---------------------------------------------------------------- preprocess

def test_preprocess_shards_and_eval(preprocessed, articles):
    out, stats = preprocessed
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "eval", "eval/eval.txt", "train", "train/train_00000.txt", "train/train_00001.txt"]
    assert (stats.documents, stats.train_documents, stats.eval_documents) == (97, 92, 5)
    assert (stats.sentences, stats.characters) == (18287, 2557654)
    assert (stats.empty_documents, stats.single_sentence_documents) == (0, 0)

    shards = [_documents(out / "train" / f"train_{i:05d}.txt") for i in range(2)]
    held_out = _documents(out / "eval" / "eval.txt")
    assert [len(s) for s in shards] == [47, 45] and len(held_out) == 5
    assert sum(len(d) for docs in shards + [held_out] for d in docs) == 18287
    chars = [sum(len(s) for d in docs for s in d) for docs in shards]
    assert chars == stats.shard_characters == [1235609, 1211570]
    # Balanced: the shards differ by less than the longest document, and by 1%.
    longest = max(sum(map(len, d)) for docs in shards for d in docs)
    assert abs(chars[0] - chars[1]) < longest
    assert abs(chars[0] - chars[1]) / sum(chars) < 0.01
    assert sum(chars) + stats.eval_characters == stats.characters

    # Every article is in exactly one place, in the dump's order, sentence texts intact.
    firsts = [d[0] for docs in shards + [held_out] for d in docs]
    assert len(set(firsts)) == 97
    for document in held_out:
        assert not any(document[0] in d[0] for docs in shards for d in docs)
    article_text = {a["title"]: a["text"] for a in articles}
    anarchism = shards[0][0]
    assert anarchism[0] == ("Anarchism is a political philosophy that advocates self-governed "
                            "societies based on voluntary institutions.")
    # Splitting loses no character (sentencex may move a space next to a quote mark).
    assert "".join("".join(anarchism).split()) == "".join(article_text["Anarchism"].split())


def test_preprocess_is_deterministic_and_seeded(extracted, preprocessed, tmp_path):
    out, _ = preprocessed
    again = tmp_path / "again"
    prep.preprocess(extracted[0], again, shards=2, eval_articles=5, seed=12345)
    for name in ("train/train_00000.txt", "train/train_00001.txt", "eval/eval.txt"):
        assert (again / name).read_bytes() == (out / name).read_bytes()

    other = tmp_path / "other"
    stats = prep.preprocess(extracted[0], other, shards=3, eval_articles=0.1, seed=7)
    assert (stats.train_documents, stats.eval_documents) == (87, 10)
    assert stats.shard_characters == [769934, 760764, 771760]
    assert (other / "eval" / "eval.txt").read_bytes() != (out / "eval" / "eval.txt").read_bytes()
    assert max(stats.shard_characters) - min(stats.shard_characters) < 0.1 * sum(stats.shard_characters)
    # Re-running into an earlier output replaces it as a whole.
    prep.preprocess(extracted[0], other, shards=1, eval_articles=0, seed=7)
    assert sorted(str(p.relative_to(other)) for p in other.rglob("*")) == ["train", "train/train_00000.txt"]


def test_preprocess_bad_input(tmp_path):
    need_sentencex()
    def jsonl(name: str, texts: list[str]) -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps({"title": "t", "text": t}) + "\n" for t in texts))
        return path

    empty = jsonl("empty.jsonl", ["", " \n \xa0"])
    with pytest.raises(DataError, match=r"empty\.jsonl: the corpus is empty"):
        prep.preprocess(empty, tmp_path / "out")

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "Caf\xe9 au lait."}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl: not valid UTF-8 at byte offset 13$"):
        prep.preprocess(bad, tmp_path / "out")
    second_line = tmp_path / "second.txt"
    second_line.write_bytes(b"One line.\nTwo \xff.\n")
    with pytest.raises(DataError, match=r"second\.txt: not valid UTF-8 at byte offset 14$"):
        prep.preprocess(second_line, tmp_path / "out")

    not_json = tmp_path / "broken.jsonl"
    not_json.write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(DataError, match=r"broken\.jsonl: line 2: not JSON"):
        prep.preprocess(not_json, tmp_path / "out")
    no_text = tmp_path / "notext.jsonl"
    no_text.write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=r"notext\.jsonl: line 1: no column 'text' \(columns present: body\)$"):
        prep.preprocess(no_text, tmp_path / "out")

    with pytest.raises(DataError, match=r"missing\.jsonl"):
        prep.preprocess(tmp_path / "missing.jsonl", tmp_path / "out")

    # Single-sentence documents are kept and counted; empty ones skipped and counted.
    small = jsonl("small.jsonl", ["Only one sentence here.", "", "First one. Second one.\nThird one."])
    stats = prep.preprocess(small, tmp_path / "small", eval_articles=0)
    assert (stats.documents, stats.empty_documents, stats.single_sentence_documents) == (2, 1, 1)
    assert ((tmp_path / "small" / "train" / "train_00000.txt").read_text()
            == "Only one sentence here.\n\nFirst one.\nSecond one.\nThird one.\n\n")

    with pytest.raises(DataError, match="2 documents, 1 of them held out, cannot fill 2 training shards"):
        prep.preprocess(small, tmp_path / "x", shards=2, eval_articles=1)
    with pytest.raises(DataError, match=r"a fraction must be in \[0, 1\)"):
        prep.preprocess(small, tmp_path / "x", eval_articles=1.5)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.md").write_text("keep me")
    with pytest.raises(DataError, match=r"mine: holds other files \(notes\.md\)"):
        prep.preprocess(small, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.md").read_text() == "keep me"


# ---------------------------------------------------------------- vocab

def test_vocab_from_the_shards(preprocessed, tmp_path):
    out, _ = preprocessed
    vocab = prep.train_vocab(out / "train", tmp_path / "vocab.txt", vocab_size=8192)
    tokens = read_vocab(vocab)
    assert len(tokens) == 8192
    assert tokens[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert "the" in tokens and "anarchism" in tokens and "The" not in tokens
    # The held-out articles tokenize with almost no unknown pieces.
    tokenizer = load_tokenizer(vocab)
    ids = [i for doc in _documents(out / "eval" / "eval.txt") for s in doc
           for i in tokenizer.encode(s, add_special_tokens=False).ids]
    assert len(ids) > 25_000
    assert ids.count(tokenizer.token_to_id("[UNK]")) / len(ids) < 0.005

    (tmp_path / "blank.txt").write_text("\n \n\n")
    with pytest.raises(DataError, match=r"blank\.txt: the corpus is empty"):
        prep.train_vocab(tmp_path / "blank.txt", tmp_path / "v2.txt", vocab_size=100)
    assert not (tmp_path / "v2.txt").exists()


# ---------------------------------------------------------------- command line

def test_command_line_helpers(extracted, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    for name, add, run in (("download", wiki.add_download_arguments, wiki.cmd_download),
                           ("extract", wiki.add_extract_arguments, wiki.cmd_extract),
                           ("preprocess", prep.add_preprocess_arguments, prep.cmd_preprocess),
                           ("vocab", prep.add_vocab_arguments, prep.cmd_vocab)):
        add(sub.add_parser(name))
        sub.choices[name].set_defaults(func=run)

    args = parser.parse_args(["preprocess", str(extracted[0]), str(tmp_path / "corpus"), "--shards", "2",
                              "--eval-articles", "0.05"])
    assert (args.shards, args.eval_articles, args.seed) == (2, 0.05, 12345)
    assert args.func(args, []) == 0
    assert "97 documents (92 train in 2 shards, 5 eval), 18287 sentences" in capsys.readouterr().out

    args = parser.parse_args(["vocab", str(tmp_path / "corpus" / "train"), str(tmp_path / "v.txt"),
                              "--vocab-size", "1000", "--cased"])
    assert args.func(args, []) == 0 and len(read_vocab(tmp_path / "v.txt")) == 1000
    # The count and the time, as its sibling commands print theirs; fewer tokens than asked are said.
    written = re.escape(str(tmp_path / "v.txt"))
    assert re.fullmatch(rf"1000 tokens -> {written} \(\d+\.\d s\)\n", capsys.readouterr().out)
    (tmp_path / "few.txt").write_text("one two three\n", encoding="utf-8")
    args = parser.parse_args(["vocab", str(tmp_path / "few.txt"), str(tmp_path / "few-vocab.txt"),
                              "--vocab-size", "1000"])
    assert args.func(args, []) == 0
    size = len(read_vocab(tmp_path / "few-vocab.txt"))
    assert size < 1000 and capsys.readouterr().out.startswith(
        f"{size} tokens (of --vocab-size 1000: the corpus gave no more) -> {tmp_path / 'few-vocab.txt'} (")

    args = parser.parse_args(["extract", str(tmp_path / "nope.xml"), str(tmp_path / "o.jsonl")])
    with pytest.raises(DataError, match=r"dump not found: .*nope\.xml"):
        args.func(args, [])
    args = parser.parse_args(["download", str(tmp_path), "--url", "http://127.0.0.1:9/x.bz2"])
    with pytest.raises(DataError, match=r"no checksum to verify it against"):
        args.func(args, [])
    from bertforge.cli import main  # leftover flags are rejected in one place, the command's parser

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["data", "wikipedia", "download", str(tmp_path), "--bogus"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


# ---------------------------------------------------------------- download

class _DumpServer(FileServer):
    """Serves the dump (and a checksum list, ``files["sha1sums.txt"]``); ``requests`` holds the
    Range header of each request for the dump."""

    def record(self, name: str, range_header: str | None) -> None:
        if name == DUMP_NAME:
            self.requests.append(range_header)


@pytest.fixture
def server(dump, monkeypatch):
    with serving_files(monkeypatch, _DumpServer) as srv:
        srv.files[DUMP_NAME] = dump.read_bytes()
        yield srv


def _url(server: FileServer, path: str = DUMP_NAME) -> str:
    return server.url(path)


def test_download_resumes_an_interrupted_transfer(server, dump, tmp_path):
    server.drops = [300_000, 500_000]  # two broken connections, then the rest
    path = wiki.download(_url(server), tmp_path, sha1=DUMP_SHA1, chunk_size=65536, retry_wait=0)
    assert path == tmp_path / DUMP_NAME
    assert path.read_bytes() == dump.read_bytes()
    assert server.requests == [None, "bytes=300000-", "bytes=800000-"]
    assert [p.name for p in tmp_path.iterdir()] == [DUMP_NAME]

    # Already there and verified: nothing is fetched again.
    assert wiki.download(_url(server), tmp_path, md5=DUMP_MD5) == path
    assert len(server.requests) == 3


def test_download_resumes_in_a_later_call(server, dump, tmp_path):
    server.drops = [250_000, 0, 0]
    with pytest.raises(DataError, match=r"download failed .*\.part keeps 250000 bytes, run again to resume"):
        wiki.download(_url(server), tmp_path, sha1=DUMP_SHA1, retries=1, retry_wait=0)
    assert (tmp_path / f"{DUMP_NAME}.part").stat().st_size == 250_000
    assert not (tmp_path / DUMP_NAME).exists()
    path = wiki.download(_url(server), tmp_path, sha1=DUMP_SHA1, retry_wait=0)
    assert path.read_bytes() == dump.read_bytes()
    assert server.requests == [None, "bytes=250000-", "bytes=250000-", "bytes=250000-"]

    # A .part that already holds every byte: the server answers 416 and we only verify.
    (tmp_path / DUMP_NAME).rename(tmp_path / f"{DUMP_NAME}.part")
    assert wiki.download(_url(server), tmp_path, sha1=DUMP_SHA1).read_bytes() == dump.read_bytes()
    assert server.requests[-1] == f"bytes={len(dump.read_bytes())}-"


def test_download_from_a_server_without_range(server, dump, tmp_path):
    server.ranges = False
    (tmp_path / f"{DUMP_NAME}.part").write_bytes(b"stale bytes of another try")
    path = wiki.download(_url(server), tmp_path, sha1=DUMP_SHA1, retry_wait=0)
    assert path.read_bytes() == dump.read_bytes()
    assert server.requests == ["bytes=26-"]  # asked to resume, got the whole file, started over


def test_download_checksum_from_the_published_list(server, dump, tmp_path):
    # Wikimedia's latest/ list names the dated file: "enwiki-20160820-..." for "enwiki-latest-...".
    dated = DUMP_NAME.replace("latest", "20160820")
    server.files["sha1sums.txt"] = (f"0123456789abcdef0123456789abcdef01234567  enwiki-20160820-pages-meta.xml.bz2\n"
                                    f"{DUMP_SHA1}  {dated}\n").encode()
    path = wiki.download(_url(server), tmp_path, checksums_url=_url(server, "sha1sums.txt"))
    assert hashlib.sha1(path.read_bytes()).hexdigest() == DUMP_SHA1

    server.files["sha1sums.txt"] = b"0123456789abcdef0123456789abcdef01234567  something-else.bz2\n"
    with pytest.raises(DataError, match=rf"sha1sums\.txt: no line for {re.escape(DUMP_NAME)}"):
        wiki.download(_url(server), tmp_path / "x", checksums_url=_url(server, "sha1sums.txt"))
    with pytest.raises(DataError, match=r"HTTP error 404"):
        wiki.download(_url(server, "other.xml.bz2"), tmp_path, sha1=DUMP_SHA1)


def test_download_checksum_mismatch_keeps_the_bytes(server, dump, tmp_path):
    wrong = "0" * 40
    with pytest.raises(DataError, match=rf"sha1 mismatch: expected {wrong}, got {DUMP_SHA1}; "
                                        rf"the downloaded bytes are kept in .*{re.escape(DUMP_NAME)}\.bad"):
        wiki.download(_url(server), tmp_path, sha1=wrong)
    assert not (tmp_path / DUMP_NAME).exists() and not (tmp_path / f"{DUMP_NAME}.part").exists()
    assert (tmp_path / f"{DUMP_NAME}.bad").read_bytes() == dump.read_bytes()
    # A second mismatch overwrites nothing; a right checksum then downloads afresh.
    with pytest.raises(DataError, match=r"\.bad2"):
        wiki.download(_url(server), tmp_path, sha1=wrong)
    assert wiki.download(_url(server), tmp_path, sha1=DUMP_SHA1).read_bytes() == dump.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [DUMP_NAME, f"{DUMP_NAME}.bad",
                                                          f"{DUMP_NAME}.bad2"]
    with pytest.raises(DataError, match=r"--sha1 'abc' is not a sha1 hex digest"):
        wiki.download(_url(server), tmp_path, sha1="abc")
