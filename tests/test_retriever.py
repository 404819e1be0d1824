"""bm25s retriever: ranking, save/load, edge cases, corpus formats, the index script."""

import os
import json
import subprocess
import sys

import numpy as np
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
    run = lambda corpus: subprocess.run([sys.executable, "scripts/build_index.py", "--corpus", str(corpus), "--out",
                                         str(out)], capture_output=True, text=True, timeout=300)
    proc = run(corpus_file)  # its last row is blank: refused, nothing written
    assert proc.returncode != 0 and f"1 passage(s) with a blank text (first: {corpus_file}:8)" in proc.stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".index.")]
    mended = tmp_path / "mended.jsonl"
    mended.write_text("".join(corpus_file.read_text().splitlines(keepends=True)[:-1]))
    proc = run(mended)
    assert proc.returncode == 0, proc.stderr
    assert "indexed 5 passages" in proc.stdout and f"{mended}: skipped 2 broken row(s)" in proc.stdout
    assert Retriever.load(str(out)).search(["highest mountain"], 1)[0][0].id == "d2"


def _random_docs(n, seed=0):
    rng = np.random.RandomState(seed)
    words = [f"w{i}x" for i in range(400)] + ["running", "runs", "ran", "the", "a", "of"]
    docs = [{"id": f"p{i}", "title": f"T{i % 7}", "text": " ".join(rng.choice(words, rng.randint(1, 40)))}
            for i in range(n)]
    return docs + [{"id": "stopwords only", "title": "", "text": "the of a"}]


def test_sparse_product_scores_as_bm25s_ranks():
    import bm25s
    import Stemmer
    docs = _random_docs(3000)
    r = Retriever.build(docs, show_progress=False)
    rng = np.random.RandomState(5)
    words = " ".join(d["text"] for d in docs[:50]).split()
    queries = [" ".join(rng.choice(words, rng.randint(1, 8))) for _ in range(60)] + ["w1x w1x w1x", "T2 T2"]
    ours = r.search(queries, 10)
    tokens = bm25s.tokenize(queries, stopwords="en", stemmer=Stemmer.Stemmer("english"), return_ids=False,
                            show_progress=False)
    ref_ids, ref_scores = r.bm25.retrieve(tokens, k=10, backend_selection="numpy", show_progress=False)
    index = {d["id"]: i for i, d in enumerate(docs)}
    for hits, ids, scores in zip(ours, ref_ids, ref_scores):
        mine = np.array([h.score for h in hits])
        np.testing.assert_allclose(mine, scores[scores > 0], rtol=1e-6)
        if not hits:
            continue
        got = [index[h.id] for h in hits]
        # Sums in another order round differently: passages clearly above the k-th score are the same;
        # which of those tied at it are kept is arbitrary in bm25s (index order here).
        clear = mine[-1] + 1e-5 * mine[0]
        assert {g for g, x in zip(got, mine) if x > clear} == {int(i) for i, x in zip(ids, scores) if x > clear}
        assert all(a < b for a, b, x, y in zip(got, got[1:], mine, mine[1:]) if x == y)


@pytest.mark.parametrize("chunk", [1, 333, 100_000])
def test_streaming_build_writes_bm25s_index_to_the_bit(tmp_path, chunk):
    from sem_jax.retrieval.build import build_index
    docs = _random_docs(1000 if chunk == 1 else 3000)
    Retriever.build(docs, show_progress=False).save(str(tmp_path / "bm25s"))
    stats = build_index(((f"row {i}", d) for i, d in enumerate(docs)), str(tmp_path / "ours"), chunk=chunk,
                        show_progress=False)
    assert stats["passages"] == len(docs)
    arrays = {side: {n: np.load(tmp_path / side / f"{n}.csc.index.npy") for n in ("data", "indices", "indptr")}
              for side in ("bm25s", "ours")}
    vocab = {side: json.loads((tmp_path / side / "vocab.index.json").read_text()) for side in ("bm25s", "ours")}
    assert set(vocab["ours"]) == set(vocab["bm25s"]) and vocab["ours"][""] == len(vocab["ours"]) - 1
    for term, j in vocab["bm25s"].items():  # every term's postings: same passages, same float32 scores
        if term:
            a, b = arrays["bm25s"], arrays["ours"]
            k = vocab["ours"][term]
            sa, sb = slice(a["indptr"][j], a["indptr"][j + 1]), slice(b["indptr"][k], b["indptr"][k + 1])
            np.testing.assert_array_equal(b["indices"][sb], a["indices"][sa])
            np.testing.assert_array_equal(b["data"][sb], a["data"][sa])
    for name in ("corpus.jsonl", "corpus.mmindex.json", "params.index.json", "sem_jax_index.json"):
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "bm25s" / name).read_bytes(), name
    ref, ours = Retriever.load(str(tmp_path / "bm25s")), Retriever.load(str(tmp_path / "ours"), threads=2)
    queries = ["w1x w2x running", "w33x T3", "ran w7x w8x w9x", "zzz", "T6"] * 4
    assert ours.search(queries, 5) == ref.search(queries, 5)
    ref.threads = 1
    assert ours.search(queries, 5) == ref.search(queries, 5)  # threads change no result


def test_streaming_build_refuses_blank_texts_and_repeated_ids(tmp_path, monkeypatch):
    from sem_jax.retrieval import build
    docs = _random_docs(50)
    out = tmp_path / "idx"
    build.build_index(((str(i), d) for i, d in enumerate(docs)), str(out), show_progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = docs + [{"id": "p3", "title": "T", "text": "again"}, {"id": "x", "title": "T", "text": "  "},
                  {"id": "p3", "title": "T", "text": "thrice"}, {"id": "p9", "title": "T", "text": "w1x"}]
    with pytest.raises(build.CorpusError, match=r"1 passage\(s\) with a blank text \(first: line 52\); 3 repeated "
                                                r"id\(s\) \(first: 'p3', 'p9'\)"):
        build.build_index(((f"line {i}", d) for i, d in enumerate(bad)), str(out), chunk=7, show_progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the last good index stays whole
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".idx.")]  # no scratch left
    # Equal 8-byte hashes of different ids are no repeat.
    monkeypatch.setattr(build, "_id_hash", lambda passage_id: 7)
    assert build.build_index(((str(i), d) for i, d in enumerate(docs)), str(out), show_progress=False)["passages"] == 51
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(build.CorpusError, match="not empty and not an index"):
        build.build_index(iter([("0", docs[0])]), str(tmp_path / "notes"), show_progress=False)
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"
    # --out naming a file: refused, the file kept as it was (not renamed to FILE.old).
    (tmp_path / "file").write_text("mine")
    with pytest.raises(build.CorpusError, match="a file, not an index directory"):
        build.build_index(iter([("0", docs[0])]), str(tmp_path / "file"), show_progress=False)
    assert (tmp_path / "file").read_text() == "mine" and not (tmp_path / "file.old").exists()


def test_one_index_build_per_output(tmp_path):
    """A second build into the same --out while one runs is refused naming the first."""
    from sem_jax.retrieval import build
    from sem_jax.run_lock import RunLock, RunLocked
    out = tmp_path / "idx"
    docs = [{"id": str(i), "title": "", "text": f"passage {i}"} for i in range(5)]
    with RunLock.beside(str(out), "index build"):  # a build in flight
        with pytest.raises(RunLocked, match=rf"idx\.lock: another index build writes {out} \(host .*, pid {os.getpid()}"):
            build.build_index(((str(i), d) for i, d in enumerate(docs)), str(out), show_progress=False)
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".idx.")]
    assert build.build_index(((str(i), d) for i, d in enumerate(docs)), str(out), show_progress=False)["passages"] == 5


def test_an_index_rebuild_never_deletes_a_users_old_or_partial_directory(tmp_path):
    from sem_jax.retrieval import build
    out = tmp_path / "idx"
    docs = [{"id": str(i), "title": "", "text": f"passage {i}"} for i in range(5)]
    for name in ("idx.old", "idx.partial"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "keep.txt").write_text(name)
    for _ in range(2):  # a build, then a rebuild over it
        build.build_index(((str(i), d) for i, d in enumerate(docs)), str(out), show_progress=False)
    for name in ("idx.old", "idx.partial"):
        assert (tmp_path / name / "keep.txt").read_text() == name
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["idx", "idx.old", "idx.partial"]


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
