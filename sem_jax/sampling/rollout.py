"""The search-aware rollout: the host loop around the compiled sampler.

decode until rows pause at `</search>` -> parse their queries -> ONE batched
retriever call -> tokenize the `<result>` blocks -> append them into the same KV
cache -> resume. Sampled ids are kept as sampled (token-in, token-out); inserted
ids are the tokenization of the inserted blocks and get loss mask 0.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from sem_jax import hosts
from sem_jax.protocol import SEM, Protocol
from sem_jax.sampling.sampler import Sampler


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Built from a config by `sem_jax.assemble.settings` (the config holds the defaults)."""
    group_size: int                # G trajectories per prompt
    max_searches: int              # searches answered per trajectory; then the protocol's limit note once
    top_k: int                     # passages per search
    max_tokens_per_passage: int
    max_block_tokens: int          # one search's inserted block at most (passages cut to fit: counted)
    max_note_tokens: int           # the limit note at most


@dataclasses.dataclass
class Trajectory:
    prompt_index: int
    prompt_ids: list[int]
    response_ids: np.ndarray   # [n] int32: sampled and inserted tokens, in order
    loss_mask: np.ndarray      # [n] int8: 1 on sampled tokens, 0 on inserted ones
    logprobs: np.ndarray       # [n] float32: sampler logprobs (0 where inserted)
    num_searches: int
    queries: list[str]
    text: str                  # the decoded response (special tokens dropped)
    end_reason: str            # "eos", "length" or "search_limit"


@dataclasses.dataclass
class RolloutStats:
    decode_s: float = 0.0
    retrieval_s: float = 0.0
    insert_s: float = 0.0
    pause_rounds: int = 0
    retriever_calls: int = 0
    cut_blocks: int = 0            # result blocks whose passages were cut shorter to fit max_block_tokens


def rollout(sampler: Sampler, tokenizer, retriever, prompts: Sequence[Sequence[int]], key: jax.Array,
            cfg: RolloutConfig, protocol: Protocol = SEM) -> tuple[list[Trajectory], RolloutStats]:
    """G trajectories per prompt (row = prompt * G + g), with searches answered by `retriever`;
    `protocol` reads the queries and writes the inserted blocks.

    On a multi-process run each process passes its own prompts and gets its own trajectories;
    prompts are padded (with repeats, rolled out and dropped) to the same count everywhere and
    to a multiple of the process's batch shards."""
    if not prompts:
        raise ValueError("rollout needs at least one prompt (on every process)")
    stats = RolloutStats()
    g = cfg.group_size
    real = len(prompts) * g
    per = hosts.agree_max(len(prompts))
    while (per * g) % sampler.row_multiple():
        per += 1
    state = sampler.start(list(prompts) + [prompts[-1]] * (per - len(prompts)), g, key)
    b = per * g
    room = sampler.config.response_tokens  # sampled and inserted
    searches = np.zeros(b, int)
    refused = np.zeros(b, bool)
    ended_by_limit = np.zeros(b, bool)
    queries: list[list[str]] = [[] for _ in range(b)]
    note_ids = tokenizer.encode(protocol.limit_note, add_special_tokens=False)[:cfg.max_note_tokens]
    while True:
        t0 = time.perf_counter()
        state = sampler.decode(state)
        any_paused = sampler.any_paused(state)  # on any process: all take part in the insert
        stats.decode_s += time.perf_counter() - t0
        if not any_paused:
            break
        stats.pause_rounds += 1
        paused = sampler.local(state.paused)
        resp, lens = sampler.local(state.resp), sampler.local(state.resp_len)
        blocks: list[list[int]] = [[] for _ in range(b)]
        end = np.zeros(b, bool)
        ask = []
        for row in np.flatnonzero(paused):
            if row >= real:  # a padding row: end it, no retrieval
                end[row] = True
            elif searches[row] < cfg.max_searches:
                ask.append(row)
            elif not refused[row]:
                blocks[row], refused[row] = list(note_ids), True
            else:  # asked again after the note: stop the row
                end[row] = ended_by_limit[row] = True
        if ask:  # this process's rows only: every host searches for its own
            t0 = time.perf_counter()
            texts = [tokenizer.decode(resp[r, :lens[r]].tolist(), skip_special_tokens=True) for r in ask]
            qs = [protocol.parse_query(t) for t in texts]
            results = retriever.search(qs, cfg.top_k)  # once per pause round, for every row
            stats.retriever_calls += 1
            for row, q, res in zip(ask, qs, results):
                blocks[row], shortened = protocol.block_ids(q, res, tokenizer, cfg.max_tokens_per_passage,
                                                            cfg.max_block_tokens)
                stats.cut_blocks += shortened
                searches[row] += 1
                queries[row].append(q)
            stats.retrieval_s += time.perf_counter() - t0
        for row in range(b):  # the buffer holds every search's block when max_inserted_tokens is sized so
            blocks[row] = blocks[row][:max(0, room - int(lens[row]))]
        t0 = time.perf_counter()
        state = sampler.insert(state, blocks, end)
        jax.block_until_ready(state.resp_len)  # time the append-prefill, not its dispatch (decode syncs next anyway)
        stats.insert_s += time.perf_counter() - t0

    resp, lp, sampled, lens, eos = (sampler.local(x) for x in (state.resp, state.resp_logprob, state.resp_sampled,
                                                                  state.resp_len, state.eos))
    out = []
    for row in range(real):
        n = int(lens[row])
        ids = resp[row, :n].astype(np.int32)
        reason = "search_limit" if ended_by_limit[row] else "eos" if eos[row] else "length"
        out.append(Trajectory(
            prompt_index=row // g, prompt_ids=list(prompts[row // g]), response_ids=ids,
            loss_mask=sampled[row, :n].astype(np.int8), logprobs=lp[row, :n].astype(np.float32),
            num_searches=int(searches[row]), queries=queries[row],
            text=tokenizer.decode(ids.tolist(), skip_special_tokens=True), end_reason=reason))
    return out, stats
