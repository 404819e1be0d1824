"""Stop strings detected on device, whatever the tokenization.

`</search>` is not one token and its ids depend on context (`</`+`search`+`>`,
` </`+`search`+`>\n`, `?</`+`search`+`>\n\n`, byte by byte, ...). So we build a
byte-level Aho-Corasick automaton over the stop strings and lift it to tokens:
`table[token, state]` is the state after feeding that token's bytes, and whether
a stop string was completed anywhere inside the token. One gather per decode step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

_BYTE_DECODER: dict[str, int] | None = None


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE token characters -> bytes."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
            list(range(ord("®"), ord("ÿ") + 1))
        cs = bs[:]
        n = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(bs, cs)}
    return _BYTE_DECODER


def token_bytes(tokenizer, vocab_size: int | None = None) -> list[bytes]:
    """The bytes each token id stands for; ids past the tokenizer (padded rows) are empty."""
    decoder = _byte_decoder()
    added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    n = vocab_size or len(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(min(n, len(tokenizer)))))
    out = []
    for i, tok in enumerate(tokens):
        if i in added:
            out.append(added[i].encode())
        elif tok is not None and all(ch in decoder for ch in tok):
            out.append(bytes(decoder[ch] for ch in tok))
        else:  # not byte-level BPE: fall back to the decoded text
            out.append(tokenizer.decode([i]).encode())
    return out + [b""] * (n - len(out))


@dataclasses.dataclass(frozen=True)
class StopAutomaton:
    """`table[token, state]` = next_state * 2 + (1 if a stop string ends inside the token)."""

    stops: tuple[str, ...]
    table: np.ndarray  # [vocab, num_states] int32

    @property
    def num_states(self) -> int:
        return self.table.shape[1]

    def feed(self, ids: Sequence[int], state: int = 0) -> list[bool]:
        """Host-side replay: for each id, whether a stop string completed at it."""
        hits = []
        for i in ids:
            v = int(self.table[i, state])
            state, hit = v >> 1, bool(v & 1)
            hits.append(hit)
        return hits


def _byte_dfa(stops: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Aho-Corasick completed to a DFA: delta [states, 256], accept [states]."""
    goto: list[dict[int, int]] = [{}]
    accept = [False]
    for s in stops:
        node = 0
        for b in s:
            if b not in goto[node]:
                goto.append({})
                accept.append(False)
                goto[node][b] = len(goto) - 1
            node = goto[node][b]
        accept[node] = True
    delta = np.zeros((len(goto), 256), np.int32)
    fail = [0] * len(goto)
    queue = []
    for b in range(256):
        child = goto[0].get(b)
        if child is not None:
            delta[0, b] = child
            queue.append(child)
    while queue:  # breadth first: fail[] of shallower nodes is final
        node = queue.pop(0)
        accept[node] = accept[node] or accept[fail[node]]
        for b in range(256):
            child = goto[node].get(b)
            if child is None:
                delta[node, b] = delta[fail[node], b]
            else:
                fail[child] = delta[fail[node], b]
                delta[node, b] = child
                queue.append(child)
    return delta, np.array(accept)


def trie_states(stops: Sequence[str]) -> int:
    """The states `build_stop_automaton` makes for `stops`: one per distinct byte prefix of the
    stop strings, plus the start (the table's second dimension, which compile-only checks size)."""
    return len({x.encode()[:i] for x in stops for i in range(1, len(x.encode()) + 1)}) + 1


def build_stop_automaton(tokenizer, stops: Sequence[str], vocab_size: int | None = None) -> StopAutomaton:
    """Token-level stop table for `stops` over the tokenizer's vocabulary (padded to `vocab_size`)."""
    return stop_automaton_from_bytes(token_bytes(tokenizer, vocab_size), stops)


def stop_automaton_from_bytes(toks: Sequence[bytes], stops: Sequence[str]) -> StopAutomaton:
    """Token-level stop table given each token id's bytes."""
    if not stops or any(not s for s in stops):
        raise ValueError(f"stop strings must be non-empty, got {stops!r}")
    delta, accept = _byte_dfa([s.encode() for s in stops])
    lengths = np.array([len(t) for t in toks])
    # Longest tokens first: at byte position p only the first (lengths > p) rows still feed bytes,
    # so each position's pass touches the tokens that long (a 151k vocabulary's longest token is
    # 128 bytes, its mean under 7), every start state at once.
    order = np.argsort(-lengths, kind="stable")
    width = max(1, int(lengths.max(initial=0)))
    data = np.zeros((len(toks), width), np.int32)
    for row, i in enumerate(order):
        data[row, :lengths[i]] = np.frombuffer(toks[i], np.uint8)
    longer = np.searchsorted(-lengths[order], -np.arange(width), side="left")  # rows with length > p
    states = delta.shape[0]
    state = np.tile(np.arange(states, dtype=np.int32), (len(toks), 1))  # [token, start state]
    hit = np.zeros_like(state, bool)
    for pos in range(width):
        n = int(longer[pos])
        nxt = delta[state[:n], data[:n, pos, None]]
        hit[:n] |= accept[nxt]
        state[:n] = nxt
    table = np.empty_like(state)
    table[order] = state * 2 + hit
    return StopAutomaton(tuple(stops), table)
