"""bm25s retriever: ranking, save/load, edge cases, corpus formats, the index script."""

import json
import subprocess
import sys

import pytest

from sem_jax.protocol.sem import format_results
from sem_jax.retrieval import Retriever, read_corpus

DOCS = [
    {"id": "d1", "title": "Paris", "text": "Paris is the capital and largest city of France."},
    {"id": "d2", "title": "Mount Everest", "text": "Everest is the highest mountain above sea level, in the Himalayas."},
    {"id": "d3", "title": "Python (language)", "text": "Python is a programming language created by Guido van Rossum."},
    {"id": "d4", "title": "Nile", "text": "The Nile is a major river flowing north through Africa into the Mediterranean."},
    {"id": "d5", "title": "Mozart", "text": "Wolfgang Amadeus Mozart was a composer born in Salzburg in 1756."},
]
QUERIES = {"capital of France": "d1", "highest mountain": "d2", "who created the Python programming language": "d3",
           "river flowing through Africa": "d4", "composer born in Salzburg": "d5"}


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    rows = [json.dumps(d) for d in DOCS[:4]]
    rows.append(json.dumps({"id": "d5", "contents": '"Mozart"\n' + DOCS[4]["text"]}))
    rows += ['{"id": "bad1"}', "not json", json.dumps({"id": "e", "title": "", "text": " "})]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_read_corpus_formats_and_broken_rows(corpus_file, caplog):
    docs = read_corpus(str(corpus_file), show_progress=False)
    assert [d["id"] for d in docs] == ["d1", "d2", "d3", "d4", "d5"]
    assert docs[4] == {"id": "d5", "title": "Mozart", "text": DOCS[4]["text"]}
    assert "skipped 3 broken row(s)" in caplog.text and "corpus.jsonl:6" in caplog.text


def test_empty_corpus_is_an_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: no usable passage.*missing field 'id'"):
        read_corpus(str(bad), show_progress=False)


def test_ranking_save_load_and_edge_cases(corpus_file, tmp_path):
    r = Retriever.from_jsonl(str(corpus_file), show_progress=False)
    queries = list(QUERIES)
    hits = r.search(queries, k=3)
    assert [h[0].id for h in hits] == [QUERIES[q] for q in queries]
    assert all(h[0].score > 0 for h in hits)
    r.save(str(tmp_path / "idx"))
    loaded = Retriever.load(str(tmp_path / "idx"))
    assert loaded.settings == r.settings
    assert loaded.search(queries, k=3) == hits
    # k above the corpus size is clipped; a blank query or one with no known term gets nothing
    # (the protocol tells a blank query how to ask: test_rollout).
    big, empty, unknown = loaded.search(["France capital", "   ", "zzzqqq"], k=50)
    assert 1 <= len(big) <= 5 and big[0].id == "d1"
    assert empty == []
    assert unknown == []
    assert loaded.calls == 2


def test_format_results_budget(qwen25_tokenizer):
    from sem_jax.retrieval import Passage
    long = Passage("x", "Long", " ".join(["word"] * 500), 1.0)
    text = format_results([long, Passage("y", "Short", "tiny text", 0.5)], qwen25_tokenizer, 20)
    assert text.startswith("\n<result>\n(1) Long: ") and text.endswith("\n(2) Short: tiny text\n</result>\n")
    first = text.split("\n")[2]
    assert len(qwen25_tokenizer.encode(first)) <= 20 + 8
    assert format_results([], qwen25_tokenizer, 20) == "\n<result>\nNo results found.\n</result>\n"


def test_build_index_script(corpus_file, tmp_path):
    out = tmp_path / "index"
    proc = subprocess.run([sys.executable, "scripts/build_index.py", "--corpus", str(corpus_file),
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "indexed 5 passages" in proc.stdout
    assert Retriever.load(str(out)).search(["highest mountain"], 1)[0][0].id == "d2"


@pytest.mark.parametrize("damage,message", [
    (lambda d: (d / "corpus.jsonl").unlink(), r"incomplete index, missing corpus\.jsonl"),
    (lambda d: (d / "vocab.index.json").unlink(), r"incomplete index, missing vocab\.index\.json"),
    (lambda d: _cut(d / "indices.csc.index.npy", 40), r"indices\.csc\.index\.npy: unreadable or truncated"),
    (lambda d: _cut(d / "vocab.index.json", 20), r"vocab\.index\.json: unreadable or truncated"),
    (lambda d: _cut(d / "corpus.jsonl", 10), r"corpus\.jsonl: truncated \(\d+ bytes; passage 4 at byte \d+ is not a whole row\)"),
])
def test_a_damaged_index_is_named_at_load(corpus_file, tmp_path, damage, message):
    Retriever.from_jsonl(corpus_file, show_progress=False).save(str(tmp_path / "idx"))
    damage(tmp_path / "idx")
    with pytest.raises((FileNotFoundError, ValueError), match=message):
        Retriever.load(str(tmp_path / "idx"))


def _cut(path, nbytes):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - nbytes])
