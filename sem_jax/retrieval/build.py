"""A BM25 index built from a stream of passages, in bounded memory, in bm25s's own files.

bm25s builds its index from every passage's tokens held in Python lists at once (tens of GB at
Wikipedia scale). This writes the same index (the same scores, to the bit: `bm25s.BM25.load`
and `Retriever.load` read it) in one pass over the corpus: each chunk of passages is tokenized
by bm25s, its (passage, term, count) triples go to scratch files, and a second pass over those
files scores them and places them in the term-major arrays, memory-mapped on disk. What stays
in memory grows with the vocabulary and with a few bytes per passage, not with the text.

Passages with a blank text and repeated ids are refused (counted over the whole corpus, the
first ones named, nothing written): a search must not return an empty passage, and an id must
name one passage.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from collections.abc import Iterable, Iterator

import numpy as np
from tqdm import tqdm

from sem_jax.retrieval.bm25 import FORMAT, _quiet_bm25s, _stemmer
from sem_jax.run_lock import RunLock
from sem_jax.whole_dir import writing

STATE_INT, STATE_FLOAT = np.int32, np.float32  # bm25s's int_dtype and dtype


class CorpusError(ValueError):
    """The corpus holds passages that cannot be indexed (blank texts, repeated ids)."""


def _id_hash(passage_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(passage_id.encode(), digest_size=8).digest(), "little", signed=True)


def build_index(passages: Iterable[tuple[str, dict[str, str]]], out_dir: str, *, stemmer: str | None = "english",
                stopwords: str | None = "en", k1: float = 1.5, b: float = 0.75, chunk: int = 20_000,
                total: int | None = None, show_progress: bool = True) -> dict:
    """Index `(where, {id, title, text})` passages into `out_dir` (written whole: built in
    a scratch directory of its own beside it, then renamed). The title is indexed with the text, as `Retriever.build`
    does. Returns the index settings (sem_jax_index.json) with the build's counts."""
    import bm25s

    _quiet_bm25s()
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CorpusError(f"{out_dir}: a file, not an index directory: give another --out (only an index is replaced)")
    # One build per output: two would share the scratch directory below, each deleting the other's files.
    with RunLock.beside(out_dir, "index build"):
        return _build(passages, out_dir, bm25s, stemmer=stemmer, stopwords=stopwords, k1=k1, b=b, chunk=chunk,
                      total=total, show_progress=show_progress)


def _build(passages, out_dir: str, bm25s, *, stemmer, stopwords, k1, b, chunk, total, show_progress) -> dict:
    start = time.time()
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not os.path.exists(os.path.join(out_dir, "sem_jax_index.json")):
        raise CorpusError(f"{out_dir}: not empty and not an index: give another --out (only an index is replaced)")
    with writing(out_dir) as scratch:  # the earlier index is set aside until the new one is in place
        stats = _write(passages, scratch, bm25s, _stemmer(stemmer), stopwords, k1, b, chunk, total, show_progress)
        settings = {"format": FORMAT, "stemmer": stemmer, "stopwords": stopwords, "k1": k1, "b": b,
                    "method": "lucene", "num_docs": stats["passages"]}
        with open(os.path.join(scratch, "sem_jax_index.json"), "w") as fh:
            json.dump(settings, fh, indent=2)
        for name in ("triples.doc", "triples.term", "triples.tf"):
            os.remove(os.path.join(scratch, name))
    return {**settings, **stats, "seconds": time.time() - start}


class _Triples:
    """The corpus's (passage, term, count) triples, written chunk by chunk to scratch files with the
    index's term ids, the document frequencies and lengths, and the corpus copy with its offsets."""

    def __init__(self, scratch: str, bm25s, stemmer, stopwords):
        self.bm25s, self.stemmer, self.stopwords = bm25s, stemmer, stopwords
        self.vocab: dict[str, int] = {}
        self.df = np.zeros(1 << 16, np.int64)
        self.lengths, self.hashes, self.chunk_sizes, self.offsets = [], [], [], []
        self.n = self.nnz = 0
        self.files = {k: open(os.path.join(scratch, f"triples.{k}"), "wb") for k in ("doc", "term", "tf")}
        self.corpus = open(os.path.join(scratch, "corpus.jsonl"), "wb")

    def add(self, rows: list[dict[str, str]]) -> None:
        if not rows:
            return
        vocab = self.vocab
        tokens = self.bm25s.tokenize([f"{r['title']}\n{r['text']}" for r in rows], stopwords=self.stopwords,
                                     stemmer=self.stemmer, show_progress=False)
        # The chunk's own term ids -> the index's: one lookup per distinct term; new terms numbered in
        # sorted order (bm25s numbers a chunk's terms in set order, which differs from run to run).
        local = np.empty(len(tokens.vocab), np.int64)
        for w, i in sorted(tokens.vocab.items()):
            local[i] = vocab.setdefault(w, len(vocab))
        doc = np.repeat(np.arange(len(rows), dtype=np.int64), [len(t) for t in tokens.ids])
        term = local[np.fromiter(itertools.chain.from_iterable(tokens.ids), np.int64, count=len(doc))]
        if len(vocab) > len(self.df):
            self.df = np.concatenate([self.df, np.zeros(max(len(vocab), 2 * len(self.df)) - len(self.df), np.int64)])
        # (passage, term) pairs with their counts, ordered by passage then term.
        keys, tf = np.unique(doc * len(vocab) + term, return_counts=True)
        d, t = keys // len(vocab), keys % len(vocab)
        self.df[:len(vocab)] += np.bincount(t, minlength=len(vocab))
        (d + self.n).astype(STATE_INT).tofile(self.files["doc"])
        t.astype(STATE_INT).tofile(self.files["term"])
        tf.astype(STATE_FLOAT).tofile(self.files["tf"])
        self.lengths.append(np.bincount(doc, minlength=len(rows)).astype(np.int64))
        self.hashes.append(np.array([_id_hash(r["id"]) for r in rows], np.int64))
        self.chunk_sizes.append(len(keys))
        for r in rows:
            self.offsets.append(self.corpus.tell())
            self.corpus.write(json.dumps({"id": r["id"], "title": r["title"], "text": r["text"]}, ensure_ascii=False)
                              .encode() + b"\n")
        self.n += len(rows)
        self.nnz += len(keys)

    def close(self) -> None:
        self.corpus.close()
        for fh in self.files.values():
            fh.close()


def _write(passages, scratch, bm25s, stemmer, stopwords, k1, b, chunk, total, show_progress) -> dict:
    out = _Triples(scratch, bm25s, stemmer, stopwords)
    blank: list[str] = []
    n_blank = 0
    bar = tqdm(total=total, desc="indexing", unit=" passages", disable=not show_progress, mininterval=2)
    rows: list[dict[str, str]] = []
    try:
        for where, row in passages:
            if not row["text"].strip():
                n_blank += 1
                if len(blank) < 3:
                    blank.append(where)
                continue
            rows.append(row)
            if len(rows) >= chunk:
                out.add(rows)
                bar.update(len(rows))
                rows = []
        out.add(rows)
        bar.update(len(rows))
    finally:
        bar.close()
        out.close()
    repeated = _repeated_ids(np.concatenate(out.hashes) if out.hashes else np.zeros(0, np.int64), scratch, out.offsets)
    if n_blank or repeated[0]:
        raise CorpusError("the corpus cannot be indexed: "
                          + "; ".join(x for x in (
                              f"{n_blank} passage(s) with a blank text (first: {', '.join(blank)})" if n_blank else "",
                              f"{repeated[0]} repeated id(s) (first: {', '.join(repeated[1])})" if repeated[0] else "")
                                     if x) + "; mend or drop them and build again")
    if not out.n:
        raise CorpusError("the corpus holds no passage")
    vocab, terms = out.vocab, len(out.vocab)
    vocab.setdefault("", terms)  # bm25s's empty token, past the last column as bm25s puts it
    _score(scratch, out.df[:terms], np.concatenate(out.lengths), out.chunk_sizes, out.nnz, k1, b, show_progress)
    with open(os.path.join(scratch, "vocab.index.json"), "w", encoding="utf-8") as fh:
        json.dump(vocab, fh, ensure_ascii=False)
    with open(os.path.join(scratch, "corpus.mmindex.json"), "w") as fh:
        json.dump(out.offsets, fh)
    with open(os.path.join(scratch, "params.index.json"), "w") as fh:
        json.dump({"k1": k1, "b": b, "delta": 0.5, "method": "lucene", "idf_method": "lucene", "dtype": "float32",
                   "int_dtype": "int32", "num_docs": out.n, "version": bm25s.__version__, "backend": "numpy"}, fh,
                  indent=4)
    return {"passages": out.n, "vocabulary": len(vocab), "postings": out.nnz}


def _repeated_ids(hashes: np.ndarray, scratch: str, offsets: list[int]) -> tuple[int, list[str]]:
    """(how many passages repeat an earlier id, the first few ids): 8-byte hashes sorted, and
    any equal pair checked against the ids written (a hash collision is no repeat)."""
    if len(hashes) < 2:
        return 0, []
    order = np.argsort(hashes, kind="stable")
    same = np.flatnonzero(hashes[order][1:] == hashes[order][:-1])
    if not len(same):
        return 0, []
    repeats = []  # (position of the later passage, its id)
    with open(os.path.join(scratch, "corpus.jsonl"), "rb") as fh:
        def id_at(i: int) -> str:
            fh.seek(offsets[i])
            return json.loads(fh.readline())["id"]
        for pair in same:
            a, c = sorted((int(order[pair]), int(order[pair + 1])))
            later = id_at(c)
            if id_at(a) == later:
                repeats.append((c, later))
    names = list(dict.fromkeys(x for _, x in sorted(repeats)))[:3]
    count = len(repeats)
    return count, [repr(x) for x in names]


def _score(scratch: str, df: np.ndarray, lengths: np.ndarray, chunk_sizes: list[int], nnz: int, k1: float, b: float,
           show_progress: bool) -> None:
    """bm25s's lucene scores, idf x tf / (tf + k1 (1 - b + b len / avg len)), computed as bm25s
    computes them (idf in float32, the rest in float64, stored as float32), placed term-major
    (CSC over passages x terms) by counting sort."""
    n = len(lengths)
    avg = lengths.mean()  # as bm25s: the mean of the passages' token counts
    idf = np.where(df > 0, np.log(1 + (n - df + 0.5) / (df + 0.5)), 0).astype(STATE_FLOAT)
    norm = k1 * ((1 - b) + b * lengths / avg)
    indptr = np.zeros(len(df) + 1, np.int64)
    np.cumsum(df, out=indptr[1:])
    data = np.lib.format.open_memmap(os.path.join(scratch, "data.csc.index.npy"), "w+", STATE_FLOAT, (nnz,))
    indices = np.lib.format.open_memmap(os.path.join(scratch, "indices.csc.index.npy"), "w+", STATE_INT, (nnz,))
    cursor = indptr[:-1].copy()
    streams = [np.memmap(os.path.join(scratch, f"triples.{k}"), dt, "r", shape=(nnz,))
               for k, dt in (("doc", STATE_INT), ("term", STATE_INT), ("tf", STATE_FLOAT))]
    at = 0
    for size in tqdm(chunk_sizes, desc="scoring", unit=" chunks", disable=not show_progress, mininterval=2):
        doc, term, tf = (np.asarray(s[at:at + size]) for s in streams)
        at += size
        if not size:  # passages of stopwords only
            continue
        tf64 = tf.astype(np.float64)
        score = (idf[term] * (tf64 / (norm[doc] + tf64))).astype(STATE_FLOAT)
        order = np.argsort(term, kind="stable")  # passages stay ascending within a term
        term_sorted = term[order]
        first = np.flatnonzero(np.r_[True, term_sorted[1:] != term_sorted[:-1]])
        counts = np.diff(np.r_[first, len(term_sorted)])
        rank = np.arange(len(term_sorted)) - np.repeat(first, counts)
        where = cursor[term_sorted] + rank
        data[where] = score[order]
        indices[where] = doc[order]
        cursor[term_sorted[first]] += counts
    assert np.array_equal(cursor, indptr[1:]), "every posting placed once"
    data.flush()
    indices.flush()
    del data, indices
    np.save(os.path.join(scratch, "indptr.csc.index.npy"), indptr)


def corpus_passages(path: str) -> Iterator[tuple[str, dict[str, str]]]:
    """(where, passage) of a jsonl corpus, read line by line; broken rows are counted and
    skipped, reported at the end."""
    from sem_jax.retrieval.bm25 import parse_corpus_row
    from sem_jax.rows import jsonl_lines, reason

    broken, first = 0, None
    for where, line in jsonl_lines(path):
        try:
            if isinstance(line, ValueError):
                raise line
            yield where, parse_corpus_row(json.loads(line), where, allow_blank=True)
        except ValueError as e:
            broken += 1
            first = first or f"{where}: {reason(e, where)}"
    if broken:
        print(f"{path}: skipped {broken} broken row(s); first: {first}", flush=True)
