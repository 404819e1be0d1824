"""Host-side retrieval. Importing this package does not import bm25s (see bm25.py)."""

from sem_jax.retrieval.bm25 import Passage, Retriever, read_corpus

__all__ = ["Passage", "Retriever", "read_corpus"]
