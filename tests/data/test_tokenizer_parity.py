"""Our fast WordPiece tokenizer against the reference FullTokenizer on real text, both cases."""

import bz2
import json

import pytest
from bert_reference import reference
from conftest import shared_data

from bertforge.data.tokenizer import encode_texts, load_tokenizer


def real_lines() -> list[str]:
    """Raw wikitext of the shared dump (markup, accents, CJK, symbols) and SQuAD dev contexts."""
    dump = shared_data("wiki/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
    wiki = [line for line in bz2.open(dump, "rt", encoding="utf-8").read().splitlines() if line.strip()]
    squad = json.loads(shared_data("squad/dev-v1.1.json").read_text(encoding="utf-8"))
    contexts = [p["context"] for article in squad["data"] for p in article["paragraphs"]]
    return wiki[::8] + contexts[::4] + [
        "naïve café Ünïcödé 中文字符 ＡＢＣ", "control\x00char\x07s\ttab", "x" * 250, "ΟΔΟΣ", "\ue000private use"]


@pytest.mark.slow
@pytest.mark.parametrize("lowercase", [True, False], ids=["uncased", "cased"])
def test_same_tokens_as_full_tokenizer(lowercase):
    vocab = shared_data("vocab/bert-base-uncased-vocab.txt")
    lines = real_lines()
    theirs = reference("tokenization").FullTokenizer(str(vocab), do_lower_case=lowercase)
    ours = load_tokenizer(vocab, lowercase=lowercase)
    different = [(line, ids) for line, ids in zip(lines, encode_texts(ours, lines))
                 if ids != theirs.convert_tokens_to_ids(theirs.tokenize(line))]
    assert len(lines) > 3000
    assert different == []
