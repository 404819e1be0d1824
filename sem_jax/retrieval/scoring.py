"""BM25 top-k over bm25s's index arrays, as one sparse product per few queries.

bm25s scores a query by `np.add.at` of each query term's postings into a dense array over every
passage, then ranks all passages: both cost grows with the corpus, and `np.add.at` is slow. The
index is a terms x passages matrix in CSR form (bm25s's CSC over passages x terms, the same three
arrays), so a batch of queries is (queries x terms counts) @ that matrix: scipy's C sparse
product touches only the postings of the query terms and yields only the passages they reach,
among which the top k are picked. Scores are the same float32 sums (to rounding); passages of
equal score come in index order.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import scipy.sparse as sp

QUERIES_PER_PRODUCT = 4  # small products: the result holds every passage a query reaches


class TermMatrix:
    """The index's scores as a terms x passages CSR matrix over the (memory-mapped) arrays."""

    def __init__(self, data: np.ndarray, indices: np.ndarray, indptr: np.ndarray, num_docs: int):
        if len(data) >= 2**31:  # scipy would copy the indices to int64: no longer memory-mapped
            raise ValueError(f"{len(data)} postings: over 2^31, beyond the sparse product's int32 indices")
        self.terms = len(indptr) - 1
        # int32 offsets (a copy of one entry per term) so that scipy keeps `indices` as they are.
        self.matrix = sp.csr_matrix((data, indices, np.asarray(indptr, np.int32)), shape=(self.terms, num_docs),
                                    copy=False)

    def top_k(self, queries: Sequence[Sequence[int]], k: int, threads: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
        """(passage indices, scores) of each query's best `k`, best first; a query is its term ids
        (repeats count again, as in bm25s; ids with no column are ignored)."""
        parts = [queries[i:i + QUERIES_PER_PRODUCT] for i in range(0, len(queries), QUERIES_PER_PRODUCT)]
        if threads > 1 and len(parts) > 1:
            with ThreadPoolExecutor(min(threads, len(parts))) as pool:  # scipy's product frees the GIL
                done = list(pool.map(lambda p: self._top_k(p, k), parts))
        else:
            done = [self._top_k(p, k) for p in parts]
        return [hit for part in done for hit in part]

    def _top_k(self, queries: Sequence[Sequence[int]], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        rows = [np.full(len(q), i) for i, q in enumerate(queries)]
        cols = [np.asarray(q, np.int64) for q in queries]
        rows, cols = (np.concatenate(x) if x else np.zeros(0, np.int64) for x in (rows, cols))
        keep = (cols >= 0) & (cols < self.terms)
        counts = sp.csr_matrix((np.ones(int(keep.sum()), np.float32), (rows[keep], cols[keep])),
                               shape=(len(queries), self.terms))  # duplicates are summed: counts
        reached = (counts @ self.matrix).tocsr()
        out = []
        for i in range(len(queries)):
            lo, hi = reached.indptr[i], reached.indptr[i + 1]
            docs, scores = reached.indices[lo:hi], reached.data[lo:hi]
            if len(scores) > k:
                best = np.argpartition(-scores, k - 1)[:k]
                # ties at the k-th score: keep the lowest passage indices among them
                kth = scores[best].min()
                tied = docs[scores == kth]
                above = best[scores[best] > kth]
                docs_k = np.concatenate([docs[above], np.sort(tied)[:k - len(above)]])
                scores_k = np.concatenate([scores[above], np.full(k - len(above), kth, scores.dtype)])
                docs, scores = docs_k, scores_k
            order = np.lexsort((docs, -scores))
            out.append((docs[order], scores[order]))
        return out
