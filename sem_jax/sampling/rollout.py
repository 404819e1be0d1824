"""The search-aware rollout engine: the host loop around the compiled sampler.

A step's rows (prompt x G) go through a fixed number of decode slots. The device decodes every
active slot until a row pauses or, while queued rows wait for a slot, ends, or until the step at
which pending answers are due. At a boundary the host collects the rows that ended (their slots
free up), sends the queries of rows that paused at `</search>` to the retriever on a thread pool,
and in ONE batched call appends the result blocks that are due, ends rows and admits queued rows
into the free slots (copied from a cache of the step's prompts, each prefilled once at the start,
whenever its group's rows are admitted). A row that waits for its results holds its slot but not
the others. An answer is due `chunk_steps` decode steps after its query was sent (or sooner, when
no slot has anything to decode) and is waited for if it is not back by then: the retriever runs
beside those steps, and the schedule (every call's shapes, and so their float rounding) is a
function of the rows alone, so a step replays bit for bit whatever the retriever's latency.

`narrow=True`: once the queue is empty, the decode batch halves while the rows that hold slots fit
in half of it (they move to the first slots, their cache lines with them): a step's tail decodes
its last rows, not its empty slots. The widths follow the schedule, so a narrowed step replays bit
for bit too; its tail's rows decode at other widths than the rest and round differently, so it is
off by default (see `sem_jax.settings`).

`lockstep=True` is the same engine with barriers: decoding runs until no row is active, the
paused rows' queries go to the retriever together and are waited for, and rows are admitted only
when every slot is free (with slots = rows: one static batch, as a lockstep sampler runs it).

Sampled ids are kept as sampled (token-in, token-out); inserted ids are the tokenization of the
inserted blocks and get loss mask 0. A row's random draws are keyed by (key, row, position)
(`sampler.row_keys`), so its tokens do not depend on its slot, its neighbours or the setting.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from sem_jax import hosts
from sem_jax.protocol import SEM, Protocol
from sem_jax.protocol.chat import response_text
from sem_jax.sampling.sampler import Sampler, bucket_length


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Built from a config by `sem_jax.assemble.settings` (the config holds the defaults)."""
    group_size: int                # G trajectories per prompt
    max_searches: int              # searches answered per trajectory; then the protocol's limit note once
    top_k: int                     # passages per search
    max_tokens_per_passage: int
    max_block_tokens: int          # one search's inserted block at most (passages cut to fit: counted)
    max_note_tokens: int           # the limit note at most
    slots: int = 0                 # decode slots per process; 0: every row of the step
    chunk_steps: int = 8           # decode steps from a query to its answer's append (retrieval runs beside them)
    lockstep: bool = False         # barriers at pauses and admissions (see the module docstring)
    narrow: bool = False           # continuous, queue empty: halve the decode batch while half its slots are free
    retrieval_threads: int = 4     # host threads that run retriever calls beside decoding
    retrieval_timeout_s: float = 300.0  # a retriever call not back this long after it is due fails the rollout


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
    seconds: float = 0.0       # from admission to end
    # [p + n - 1, E]: the residual stream entering the sampler's `resid_layer` at every input position
    # (prompt and response but the last token), where the sampler keeps it; else None.
    resid: np.ndarray | None = None


@dataclasses.dataclass
class RolloutStats:
    rollout_s: float = 0.0
    decode_s: float = 0.0          # in decode calls (device time and its waits)
    insert_s: float = 0.0          # in refill calls: appends and admissions
    retrieval_s: float = 0.0       # spent in retriever calls (on the pool's threads)
    retrieval_wait_s: float = 0.0  # the host waited for results with nothing to decode
    boundaries: int = 0            # returns from the device to the host
    decode_steps: int = 0
    slot_steps: int = 0            # decode steps x slots (all processes')
    active_slot_steps: int = 0     # ... in which the slot decoded a row
    admissions: int = 0            # rows admitted after the first fill
    prefills: int = 0              # prompt prefills: one per prompt, however its group is admitted
    inserts: int = 0               # result blocks and notes appended
    refills: int = 0               # refill calls
    narrowed: int = 0              # times the decode batch was halved (or more) at the step's tail
    retriever_calls: int = 0
    cut_blocks: int = 0            # result blocks whose passages were cut shorter to fit max_block_tokens
    searched_tokens: int = 0       # sampled tokens of rows that searched ...
    searched_s: float = 0.0        # ... and those rows' seconds (admission to end)
    direct_tokens: int = 0
    direct_s: float = 0.0

    @property
    def occupancy(self) -> float:
        """Active slot-steps / slot-steps."""
        return self.active_slot_steps / max(self.slot_steps, 1)

    @property
    def retrieval_hidden_s(self) -> float:
        """Retrieval seconds spent while the device decoded other rows."""
        return max(0.0, self.retrieval_s - self.retrieval_wait_s)

    def metrics(self) -> dict[str, float]:
        """The per-step metrics (metrics.jsonl, TensorBoard)."""
        per = max(self.refills, 1)
        return {"rollout/seconds": self.rollout_s, "rollout/occupancy": self.occupancy,
                "rollout/decode_steps": self.decode_steps, "rollout/admissions_per_refill": self.admissions / per,
                "rollout/inserts_per_refill": self.inserts / per, "rollout/prefills": self.prefills,
                "rollout/narrowed": self.narrowed,
                "rollout/retrieval_hidden_s": self.retrieval_hidden_s, "rollout/retrieval_wait_s": self.retrieval_wait_s,
                "rollout/searched_tokens_per_s": self.searched_tokens / max(self.searched_s, 1e-9),
                "rollout/direct_tokens_per_s": self.direct_tokens / max(self.direct_s, 1e-9),
                "time/retrieval": self.retrieval_s, "retriever_calls": self.retriever_calls,
                "cut_blocks": self.cut_blocks}


@dataclasses.dataclass
class _Row:
    """A row's host-side record while it is rolled out."""
    searches: int = 0
    refused: bool = False
    ended_by_limit: bool = False
    queries: list[str] = dataclasses.field(default_factory=list)
    admitted: float = 0.0


class RetrieverError(RuntimeError):
    """The retriever answered wrongly (not one result list per query) or not in time."""


def _answer(retriever, protocol: Protocol, tokenizer, texts: list[str], cfg: RolloutConfig):
    """One retriever call for the queries in `texts` (run on the pool): (queries, blocks, cut, seconds)."""
    t0 = time.perf_counter()
    qs = [protocol.parse_query(t) for t in texts]
    results = retriever.search(qs, cfg.top_k)
    if len(results) != len(qs):  # zip would drop the rest, and their rows would wait forever
        raise RetrieverError(f"{type(retriever).__name__}.search returned {len(results)} result lists for "
                             f"{len(qs)} queries (one list per query is needed)")
    blocks, cut = [], 0
    for q, res in zip(qs, results):
        ids, shortened = protocol.block_ids(q, res, tokenizer, cfg.max_tokens_per_passage, cfg.max_block_tokens)
        blocks.append(ids)
        cut += shortened
    return qs, blocks, cut, time.perf_counter() - t0


def rollout(sampler: Sampler, tokenizer, retriever, prompts: Sequence[Sequence[int]], key: jax.Array,
            cfg: RolloutConfig, protocol: Protocol = SEM,
            script: np.ndarray | None = None) -> tuple[list[Trajectory], RolloutStats]:
    """G trajectories per prompt (row = prompt * G + g), with searches answered by `retriever`;
    `protocol` reads the queries and writes the inserted blocks. `script` [rows, S]: tokens forced
    at each row's sampled positions (-1: sampled; `sampler.decode_step`), for scripted workloads;
    indexed by the row's id over every process (process p's rows follow those of processes < p).

    On a multi-process run each process passes its own prompts and gets its own trajectories;
    prompts are padded (with repeats, rolled out and dropped) to the same count everywhere and
    to a multiple of the process's batch shards; boundaries are agreed between processes."""
    if not prompts:
        raise ValueError("rollout needs at least one prompt (on every process)")
    t_start = time.perf_counter()
    stats = RolloutStats()
    g = cfg.group_size
    real = len(prompts) * g
    multiple = sampler.row_multiple()
    per = hosts.agree_max(len(prompts))
    while (per * g) % multiple:
        per += 1
    padded = list(prompts) + [prompts[-1]] * (per - len(prompts))
    n_rows = per * g
    slots = min(hosts.agree_max(-(-(cfg.slots or n_rows) // multiple) * multiple), n_rows)
    offset = jax.process_index() * n_rows  # this process's rows in the global row ids
    forced = None if script is None else sampler.replicated(np.asarray(script, np.int32))
    rows = [_Row() for _ in range(n_rows)]
    out: dict[int, Trajectory] = {}
    slot_row = np.full(slots, -1)
    room = sampler.config.response_tokens  # sampled and inserted
    note_ids = tokenizer.encode(protocol.limit_note, add_special_tokens=False)[:cfg.max_note_tokens]
    if slots == n_rows:  # every row in a slot from the start: each prompt prefilled once for its group
        state = sampler.start(padded, g, key)
        slot_row[:] = np.arange(n_rows)
        queue: collections.deque[int] = collections.deque()
        prompt_kv = None
    else:  # padding rows are never admitted: rows past `real` just end
        prompt_width = hosts.agree_max(bucket_length(max(len(p) for p in prompts)))
        state = sampler.empty(slots, prompt_width, key)
        prompt_kv = sampler.prefill_prompts(padded, prompt_width)
        queue = collections.deque(range(real))
    stats.prefills = len(prompts)
    now = time.perf_counter()
    for r in slot_row[slot_row >= 0]:
        rows[r].admitted = now
    pending: list[tuple[concurrent.futures.Future, list[int], int]] = []  # (job, the rows it answers, its step)
    asked = np.zeros(slots, bool)  # the slot's paused row has been answered or asked for
    first_fill = slots < n_rows
    narrow = cfg.narrow and not cfg.lockstep and sampler.can_narrow()
    hung = False
    pool = concurrent.futures.ThreadPoolExecutor(max(1, cfg.retrieval_threads), thread_name_prefix="retrieval")
    try:
        while True:
            # The host's side of a boundary: what ended, what paused, what is ready.
            paused, done, lens = sampler.flags(state)
            width = len(slot_row)  # the decode batch: `slots`, or fewer once narrowed
            blocks: list[list[int]] = [[] for _ in range(width)]
            end, resume = np.zeros(width, bool), np.zeros(width, bool)
            finished = [s for s in range(width) if slot_row[s] >= 0 and done[s]]
            # (A row the host ended while it was paused stays paused: it is collected, not served.)
            new_pauses = np.flatnonzero(paused & ~done & ~asked & (slot_row >= 0))
            resp = sampler.local(state.resp) if finished or len(new_pauses) else None  # one transfer a boundary
            if finished:
                _collect(sampler, state, resp, lens, tokenizer, finished, slot_row, rows, prompts, g, real, out, stats)
                slot_row[finished] = -1
            ask = []
            for s in new_pauses:
                row, asked[s] = slot_row[s], True
                if row >= real:  # a padding row: end it, no retrieval
                    end[s] = True
                elif rows[row].searches < cfg.max_searches:
                    ask.append(s)
                elif not rows[row].refused:
                    blocks[s], rows[row].refused, resume[s] = list(note_ids), True, True
                else:  # asked again after the note: stop the row
                    end[s] = rows[row].ended_by_limit = True
            if ask:  # this process's rows only: every host searches for its own
                texts = [response_text(tokenizer, resp[s, :lens[s]]) for s in ask]
                pending.append((pool.submit(_answer, retriever, protocol, tokenizer, texts, cfg),
                                [int(slot_row[s]) for s in ask], stats.decode_steps + cfg.chunk_steps))
                stats.retriever_calls += 1
            idle = not (~paused & ~done).any() and not resume.any() and not (queue and (slot_row < 0).any())
            # An answer is appended at the decode step fixed when its query was sent, chunk_steps
            # later (the host waits for it if it is not back by then), or sooner when nothing else
            # can decode; lockstep appends every answer at its barrier. So the schedule, and with
            # it every call's shapes (and their float rounding), depends on the rows alone, never
            # on the retriever's latency: a step replays bit for bit.
            clock = stats.decode_steps
            if pending and idle and not cfg.lockstep:
                clock = max(clock, min(step for *_, step in pending))
            due = [job for job in pending if cfg.lockstep or job[2] <= clock]
            if not all(f.done() for f, *_ in due):
                t0 = time.perf_counter()
                _, late = concurrent.futures.wait([f for f, *_ in due], timeout=cfg.retrieval_timeout_s)
                if late:
                    hung = True
                    raise RetrieverError(f"{type(retriever).__name__}.search: {len(late)} call(s) not back "
                                         f"{cfg.retrieval_timeout_s:g} s after their answer was due "
                                         "(rollout.retrieval_timeout_s)")
                stats.retrieval_wait_s += time.perf_counter() - t0
            for job in due:
                pending.remove(job)
                (qs, got, cut, seconds), asked_rows = job[0].result(), job[1]
                stats.retrieval_s += seconds
                stats.cut_blocks += cut
                slot_of = {int(r): s for s, r in enumerate(slot_row) if r >= 0}
                for r, q, blk in zip(asked_rows, qs, got):
                    s, row = slot_of[r], rows[r]
                    row.searches += 1
                    row.queries.append(q)
                    blocks[s], resume[s] = blk, True
            for s in range(width):  # the buffer holds every search's block when max_inserted_tokens is sized so
                blocks[s] = blocks[s][:max(0, room - int(lens[s]))]
            free = np.flatnonzero(slot_row < 0)
            admit = []
            if queue and len(free) and (not cfg.lockstep or len(free) == width):
                for s in free[:len(queue)]:
                    row = queue.popleft()
                    admit.append((int(s), row // g, offset + row))
                    slot_row[s] = row
                    asked[s] = False
                stats.admissions += 0 if first_fill else len(admit)
                first_fill = False
            asked[resume] = False
            # One exchange a boundary (processes' device calls must match): whether any has device
            # work, rows left, a use for freed slots (rows wait for one, or the batch may narrow),
            # and the earliest step at which answers are due (it ends the next decode call).
            work, live, refilling, negated = hosts.agree_max_each(
                bool(admit) or end.any() or resume.any(), bool(queue) or bool(pending) or (slot_row >= 0).any(),
                bool(queue) or narrow, -min([step for *_, step in pending], default=_NEVER))
            if work:
                t0 = time.perf_counter()
                state = sampler.refill(state, blocks, end, resume, admit, prompt_kv)
                jax.block_until_ready(state.resp_len)  # time the appends, not their dispatch
                stats.insert_s += time.perf_counter() - t0
                stats.refills += 1
                stats.inserts += int(sum(1 for b in blocks if b))
                now = time.perf_counter()
                for _, _, row in admit:
                    rows[row - offset].admitted = now
            if not live:
                break
            next_due = -negated  # the earliest step at which any process's answers are due
            if narrow and not queue:
                keep = _narrower(slot_row)
                if keep is not None:
                    state = sampler.narrow(state, keep)
                    slot_row, asked = slot_row[keep], asked[keep]
                    stats.narrowed += 1
            t0 = time.perf_counter()
            # Continuous: back to the host as soon as a row pauses (a query to send) or, while a
            # freed slot would be used, ends (a boundary costs less than a slot left idle), and at
            # the next answers' step. Otherwise, as lockstep, to the end.
            state, steps, busy = sampler.decode_counted(
                state, None if cfg.lockstep or next_due == _NEVER else next_due - stats.decode_steps, forced,
                release=0 if cfg.lockstep else 1, ends=refilling)
            stats.decode_s += time.perf_counter() - t0
            stats.decode_steps += steps
            stats.slot_steps += steps * len(slot_row) * jax.process_count()
            stats.active_slot_steps += busy
            stats.boundaries += 1
    finally:
        pool.shutdown(wait=not hung, cancel_futures=True)  # a hung call's thread is left behind, not waited on
    stats.rollout_s = time.perf_counter() - t_start
    return [out[r] for r in range(real)], stats


_NEVER = 1 << 30  # no answer pending


def _narrower(slot_row: np.ndarray) -> np.ndarray | None:
    """The slots to keep when at most half of them hold a row: every held slot, then free ones up
    to the narrowest halving of the width that still holds them all (each width compiles once;
    halvings keep their number small). None: keep the width."""
    held = np.flatnonzero(slot_row >= 0)
    width = len(slot_row)
    while len(held) and len(held) <= width // 2:
        width //= 2
    if width == len(slot_row):
        return None
    free = np.flatnonzero(slot_row < 0)
    return np.concatenate([held, free[:width - len(held)]])


def _collect(sampler: Sampler, state, resp: np.ndarray, lens: np.ndarray, tokenizer, finished: list[int],
             slot_row: np.ndarray, rows: list[_Row], prompts: Sequence[Sequence[int]], g: int, real: int,
             out: dict[int, Trajectory], stats: RolloutStats) -> None:
    """The trajectories of the rows that ended in `finished` slots (padding rows dropped); `resp`
    and `lens`: this process's slots' responses and lengths, already read."""
    lp, sampled, eos = (sampler.local(x) for x in (state.resp_logprob, state.resp_sampled, state.eos))
    resid = None if state.cache.resid is None else sampler.local(state.cache.resid)
    now = time.perf_counter()
    for s in finished:
        row = int(slot_row[s])
        if row >= real:
            continue
        n = int(lens[s])
        ids = resp[s, :n].astype(np.int32)
        rec = rows[row]
        reason = "search_limit" if rec.ended_by_limit else "eos" if eos[s] else "length"
        mask = sampled[s, :n].astype(np.int8)
        t = out[row] = Trajectory(
            prompt_index=row // g, prompt_ids=list(prompts[row // g]), response_ids=ids, loss_mask=mask,
            logprobs=lp[s, :n].astype(np.float32), num_searches=rec.searches, queries=rec.queries,
            text=response_text(tokenizer, ids), end_reason=reason,
            seconds=now - rec.admitted,
            resid=None if resid is None else resid[s, :len(prompts[row // g]) + n - 1].copy())
        if t.num_searches:
            stats.searched_tokens += int(mask.sum())
            stats.searched_s += t.seconds
        else:
            stats.direct_tokens += int(mask.sum())
            stats.direct_s += t.seconds
