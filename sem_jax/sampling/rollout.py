"""The search-aware rollout engine: the host loop around the compiled sampler.

`Engine(sampler, tokenizer, retriever, cfg, protocol)`: `set_weights(params)`, then `run(prompts,
key)` hands back G trajectories per prompt (token ids, the sampler's log-probs, loss masks) and the
step's stats; `release()` drops the sampler's weights while the trainer updates them. `rollout(...)`
is one `run` of a new engine.

Glossary:

- **row**: one trajectory, `prompt * G + g`. Its random draws are keyed by (key, row, position)
  (`sampler.row_keys`), so its tokens depend neither on its slot, its neighbours nor the setting.
- **group**: the G rows of one prompt, GRPO's group.
- **slot**: a place in the device's decode batch, holding one row at a time (`_Slots`, the slot table).
- **padding row**: a row past the step's real rows, added so that every process has the same number of
  rows, a multiple of its batch shards (its prompt repeats the last one). It is never admitted from
  the queue, ends at its first pause, and is dropped.
- **pause**: a row stopped at the protocol's stop string, waiting for its results. It holds its slot,
  not the others.
- **boundary**: a return from the device to the host, and what the host does there, in this order:
  collect the rows that ended (their slots free up) -> serve the new pauses (send their queries to the
  retriever's thread pool, or the limit note) -> append the answers that are due -> admit queued rows
  into free slots -> one exchange between processes -> one refill call -> narrow -> decode.
- **refill**: a boundary's one device call: it appends result blocks, ends rows and admits rows,
  copied from a cache of the step's prompts (each prefilled once at the start, however its group's
  rows are admitted).
- **due step**: the decode step at which a search's answers are appended: `chunk_steps` after its
  query was sent, or sooner when no slot has anything to decode. The host waits for them if they are
  not back by then. The retriever runs beside those steps, and the schedule (every call's shapes, so
  their float rounding) is a function of the rows alone: a step replays bit for bit whatever the
  retriever's latency.
- **narrowing** (`narrow=True`): once the queue is empty, the decode batch halves while the rows that
  hold slots fit in half of it (they move to the first slots, their cache lines with them), so a
  step's tail decodes its last rows, not its empty slots. The widths follow the schedule, so a narrowed
  step replays bit for bit too (its tail's rows decode at other widths than the rest, so they round
  differently from a setting that does not narrow). It stops at `narrow_floor` slots: each width
  compiles its own programs, and a decode step of a few rows reads the same weights as one of one
  row. On by default; it applies on one process with an unsplit batch (`Sampler.can_narrow`), not
  under lockstep.
- **admission**: while rows are queued, a decode call comes back once `admit_share` of its slots
  have ended (at least one row, at most as many as are queued), and the next boundary admits queued
  rows into every free slot: each boundary costs a round trip and a refill call, which rows ending
  one by one would each pay. Pauses and due steps bring it back sooner; admission then takes the
  slots that are free. (On several processes: a share of one process's slots, its rows ended on
  any process, at most the longest queue of one.)
- **lockstep** (`lockstep=True`): the same engine with barriers. Decoding runs until no row is active,
  the paused rows' queries go to the retriever together and are waited for, and rows are admitted
  only when every slot is free (with slots = rows: one static batch, as a lockstep sampler runs it).

Sampled ids are kept as sampled (token-in, token-out); inserted ids are the tokenization of the
inserted blocks and get loss mask 0.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from sem_jax import hosts
from sem_jax.protocol import SEM, Protocol
from sem_jax.protocol.chat import response_text
from sem_jax.sampling.sampler import Sampler, bucket_length


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Built from a config by `Config.engine` (the config holds the defaults)."""
    group_size: int                # G trajectories per prompt
    max_searches: int              # searches answered per trajectory; then the protocol's limit note once
    top_k: int                     # passages per search
    max_tokens_per_passage: int
    max_block_tokens: int          # one search's inserted block at most (passages cut to fit: counted)
    max_note_tokens: int           # the limit note at most
    slots: int = 0                 # decode slots per process; 0: every row of the step
    chunk_steps: int = 8           # decode steps from a query to its answer's append (retrieval runs beside them)
    lockstep: bool = False         # barriers at pauses and admissions (see the module docstring)
    narrow: bool = True            # continuous, one process, queue empty: halve the batch while half its slots are free
    narrow_floor: int = 8          # narrowing stops at this many slots
    admit_share: float = 0.25      # rows queued: come back to admit them once this share of the slots has ended
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


class Engine:
    """The rollout engine (see the module docstring): a sampler, the retriever that answers its rows'
    searches and the protocol that reads their queries and writes the inserted blocks."""

    def __init__(self, sampler: Sampler, tokenizer, retriever, cfg: RolloutConfig, protocol: Protocol = SEM):
        self.sampler, self.tokenizer, self.retriever = sampler, tokenizer, retriever
        self.cfg, self.protocol = cfg, protocol
        self.note_ids = tokenizer.encode(protocol.limit_note, add_special_tokens=False)[:cfg.max_note_tokens]

    def set_weights(self, params: Any) -> None:
        """Sample from `params` (the policy's whole weights) from the next `run` on."""
        self.sampler.set_params(params)

    def release(self) -> None:
        """Drop the sampler's copy of the weights, so that the update's peak holds none;
        `set_weights` before the next `run`."""
        self.sampler.release()

    def run(self, prompts: Sequence[Sequence[int]], key: jax.Array,
            script: np.ndarray | None = None) -> tuple[list[Trajectory], RolloutStats]:
        """G trajectories per prompt (row = prompt * G + g), with searches answered by the
        retriever. `script` [rows, S]: tokens forced at each row's sampled positions (-1: sampled;
        `sampler.decode_step`), for scripted workloads; indexed by the row's id over every process
        (process p's rows follow those of processes < p).

        On a multi-process run each process passes its own prompts and gets its own trajectories;
        prompts are padded (padding rows) to the same count everywhere and to a multiple of the
        process's batch shards; each boundary is agreed between processes in one exchange."""
        if not prompts:
            raise ValueError("rollout needs at least one prompt (on every process)")
        return _Step(self, prompts, key, script).run()


def rollout(sampler: Sampler, tokenizer, retriever, prompts: Sequence[Sequence[int]], key: jax.Array,
            cfg: RolloutConfig, protocol: Protocol = SEM,
            script: np.ndarray | None = None) -> tuple[list[Trajectory], RolloutStats]:
    """One `Engine.run` (the sampler's current weights)."""
    return Engine(sampler, tokenizer, retriever, cfg, protocol).run(prompts, key, script)


@dataclasses.dataclass
class _Row:
    """A row's host-side record while it is rolled out."""
    searches: int = 0
    refused: bool = False
    ended_by_limit: bool = False
    queries: list[str] = dataclasses.field(default_factory=list)
    admitted: float = 0.0


@dataclasses.dataclass
class _Slots:
    """The slot table (this process's slots): the row each holds (-1: free) and whether that row's
    pause has been served (answered, asked for, or ended). `take` reorders every field at once."""
    row: np.ndarray
    asked: np.ndarray

    @classmethod
    def empty(cls, n: int) -> _Slots:
        return cls(np.full(n, -1), np.zeros(n, bool))

    @property
    def width(self) -> int:
        return len(self.row)

    def held(self) -> np.ndarray:
        return self.row >= 0

    def free(self) -> np.ndarray:
        return np.flatnonzero(self.row < 0)

    def slot_of(self) -> dict[int, int]:
        return {int(r): s for s, r in enumerate(self.row) if r >= 0}

    def take(self, keep: np.ndarray) -> _Slots:
        return _Slots(*(getattr(self, f.name)[keep] for f in dataclasses.fields(self)))


@dataclasses.dataclass
class _Search:
    """A retriever call in flight: the rows it answers and the decode step its answers are due."""
    future: concurrent.futures.Future
    rows: list[int]
    due: int


@dataclasses.dataclass
class _Refill:
    """What a boundary hands the device in its one refill call, per slot."""
    blocks: list[list[int]]
    end: np.ndarray
    resume: np.ndarray
    admit: list[tuple[int, int, int]]  # (slot, prompt index, global row id)

    @classmethod
    def nothing(cls, width: int) -> _Refill:
        return cls([[] for _ in range(width)], np.zeros(width, bool), np.zeros(width, bool), [])

    @property
    def work(self) -> bool:
        return bool(self.admit) or bool(self.end.any()) or bool(self.resume.any())


_NEVER = 1 << 30  # no answer pending


class _Step:
    """One `Engine.run`: the step's rows, its slot table, the queue of rows waiting for a slot and
    the searches in flight; `run` goes from boundary to boundary until no process has rows left."""

    def __init__(self, engine: Engine, prompts: Sequence[Sequence[int]], key: jax.Array, script):
        self.t_start = time.perf_counter()
        self.engine, self.cfg, self.sampler = engine, engine.cfg, engine.sampler
        self.stats = RolloutStats()
        self.prompts, self.g = prompts, self.cfg.group_size
        self.real = len(prompts) * self.g  # rows past this are padding rows
        multiple = self.sampler.row_multiple()
        per = hosts.agree_max(len(prompts))
        while (per * self.g) % multiple:
            per += 1
        padded = list(prompts) + [prompts[-1]] * (per - len(prompts))
        n_rows = per * self.g
        width = min(hosts.agree_max(-(-(self.cfg.slots or n_rows) // multiple) * multiple), n_rows)
        self.offset = jax.process_index() * n_rows  # this process's rows in the global row ids
        self.forced = None if script is None else self.sampler.replicated(np.asarray(script, np.int32))
        self.rows = [_Row() for _ in range(n_rows)]
        self.out: dict[int, Trajectory] = {}
        self.slots = _Slots.empty(width)
        self.queue: collections.deque[int] = collections.deque()
        self.prompt_kv = None
        if width == n_rows:  # every row in a slot from the start: each prompt prefilled once for its group
            self.state = self.sampler.start(padded, self.g, key)
            self.slots.row[:] = np.arange(n_rows)
        else:  # padding rows are never admitted: rows past `real` just end
            prompt_width = hosts.agree_max(bucket_length(max(len(p) for p in prompts)))
            self.state = self.sampler.empty(width, prompt_width, key)
            self.prompt_kv = self.sampler.prefill_prompts(padded, prompt_width)
            self.queue.extend(range(self.real))
        self.stats.prefills = len(prompts)
        now = time.perf_counter()
        for r in self.slots.row[self.slots.held()]:
            self.rows[r].admitted = now
        self.searches: list[_Search] = []
        self.first_fill = width < n_rows
        self.narrowing = self.cfg.narrow and not self.cfg.lockstep and self.sampler.can_narrow()
        self.hung = False

    def run(self) -> tuple[list[Trajectory], RolloutStats]:
        pool = concurrent.futures.ThreadPoolExecutor(max(1, self.cfg.retrieval_threads),
                                                     thread_name_prefix="retrieval")
        try:
            while self._boundary(pool):
                pass
        finally:
            pool.shutdown(wait=not self.hung, cancel_futures=True)  # a hung call's thread is left behind
        self.stats.rollout_s = time.perf_counter() - self.t_start
        return [self.out[r] for r in range(self.real)], self.stats

    def _boundary(self, pool: concurrent.futures.Executor) -> bool:
        """One boundary, in the glossary's order; False once no process has rows left."""
        paused, done, lens = self.sampler.flags(self.state)
        refill = _Refill.nothing(self.slots.width)
        finished = np.flatnonzero(self.slots.held() & done)
        # (A row the host ended while it was paused stays paused: it is collected, not served.)
        pauses = np.flatnonzero(paused & ~done & ~self.slots.asked & self.slots.held())
        resp = self.sampler.local(self.state.resp) if len(finished) or len(pauses) else None  # one transfer
        if len(finished):
            self._collect(finished, resp, lens)
        self._serve(pauses, resp, lens, refill, pool)
        idle = not (~paused & ~done).any() and not refill.resume.any() and not (self.queue and len(self.slots.free()))
        self._append_due(refill, idle)
        room = self.sampler.config.response_tokens  # sampled and inserted
        for s in range(self.slots.width):  # the buffer holds every search's block when max_inserted_tokens is sized so
            refill.blocks[s] = refill.blocks[s][:max(0, room - int(lens[s]))]
        self._admit(refill)
        self.slots.asked[refill.resume] = False
        work, live, queued, next_due, sizes = self._exchange(refill)
        if work:
            self._refill(refill, sizes)
        if not live:
            return False
        ends = min(queued, self._admit_batch())  # freed slots take queued rows
        if self.narrowing and not self.queue:
            self._narrow()
            ends = self._ends_to_narrow(int(np.sum(refill.end)))
        self._decode(next_due, ends)
        return True

    def _collect(self, finished: np.ndarray, resp: np.ndarray, lens: np.ndarray) -> None:
        """The trajectories of the rows that ended in `finished` slots (padding rows dropped); their
        slots free up. `resp` and `lens`: this process's slots' responses and lengths, already read."""
        sampler, stats = self.sampler, self.stats
        lp, sampled, eos = (sampler.local(x) for x in (self.state.resp_logprob, self.state.resp_sampled, self.state.eos))
        resid = None if self.state.cache.resid is None else sampler.local(self.state.cache.resid)
        now = time.perf_counter()
        for s in finished:
            row = int(self.slots.row[s])
            if row >= self.real:
                continue
            n, prompt = int(lens[s]), self.prompts[row // self.g]
            ids = resp[s, :n].astype(np.int32)
            rec = self.rows[row]
            mask = sampled[s, :n].astype(np.int8)
            t = self.out[row] = Trajectory(
                prompt_index=row // self.g, prompt_ids=list(prompt), response_ids=ids, loss_mask=mask,
                logprobs=lp[s, :n].astype(np.float32), num_searches=rec.searches, queries=rec.queries,
                text=response_text(self.engine.tokenizer, ids),
                end_reason="search_limit" if rec.ended_by_limit else "eos" if eos[s] else "length",
                seconds=now - rec.admitted, resid=None if resid is None else resid[s, :len(prompt) + n - 1].copy())
            if t.num_searches:
                stats.searched_tokens += int(mask.sum())
                stats.searched_s += t.seconds
            else:
                stats.direct_tokens += int(mask.sum())
                stats.direct_s += t.seconds
        self.slots.row[finished] = -1

    def _serve(self, pauses: np.ndarray, resp: np.ndarray | None, lens: np.ndarray, refill: _Refill,
               pool: concurrent.futures.Executor) -> None:
        """New pauses: a search for rows under their limit (one retriever call for them all), the
        limit note once, then the row's end; a padding row ends."""
        e, ask = self.engine, []
        for s in pauses:
            row, self.slots.asked[s] = self.slots.row[s], True
            rec = self.rows[row]
            if row >= self.real:
                refill.end[s] = True
            elif rec.searches < self.cfg.max_searches:
                ask.append(s)
            elif not rec.refused:
                refill.blocks[s], rec.refused, refill.resume[s] = list(e.note_ids), True, True
            else:  # asked again after the note: stop the row
                refill.end[s] = rec.ended_by_limit = True
        if ask:  # this process's rows only: every host searches for its own
            texts = [response_text(e.tokenizer, resp[s, :lens[s]]) for s in ask]
            future = pool.submit(_answer, e.retriever, e.protocol, e.tokenizer, texts, self.cfg)
            self.searches.append(_Search(future, [int(self.slots.row[s]) for s in ask],
                                         self.stats.decode_steps + self.cfg.chunk_steps))
            self.stats.retriever_calls += 1

    def _append_due(self, refill: _Refill, idle: bool) -> None:
        """The blocks of the searches that are due (waited for if not back): at their due step, or
        the earliest one's when nothing else can decode (`idle`); lockstep takes every search."""
        lockstep = self.cfg.lockstep
        clock = self.stats.decode_steps
        if self.searches and idle and not lockstep:
            clock = max(clock, min(job.due for job in self.searches))
        due = [job for job in self.searches if lockstep or job.due <= clock]
        if not all(job.future.done() for job in due):
            t0 = time.perf_counter()
            _, late = concurrent.futures.wait([job.future for job in due], timeout=self.cfg.retrieval_timeout_s)
            if late:
                self.hung = True
                raise RetrieverError(f"{type(self.engine.retriever).__name__}.search: {len(late)} call(s) not back "
                                     f"{self.cfg.retrieval_timeout_s:g} s after their answer was due "
                                     "(rollout.retrieval_timeout_s)")
            self.stats.retrieval_wait_s += time.perf_counter() - t0
        slot_of = self.slots.slot_of()
        for job in due:
            self.searches.remove(job)
            qs, got, cut, seconds = job.future.result()
            self.stats.retrieval_s += seconds
            self.stats.cut_blocks += cut
            for r, q, blk in zip(job.rows, qs, got):
                s, rec = slot_of[r], self.rows[r]
                rec.searches += 1
                rec.queries.append(q)
                refill.blocks[s], refill.resume[s] = blk, True

    def _admit(self, refill: _Refill) -> None:
        """Queued rows into the free slots (lockstep: only when every slot is free)."""
        free = self.slots.free()
        if not (self.queue and len(free) and (not self.cfg.lockstep or len(free) == self.slots.width)):
            return
        for s in free[:len(self.queue)]:
            row = self.queue.popleft()
            refill.admit.append((int(s), row // self.g, self.offset + row))
            self.slots.row[s], self.slots.asked[s] = row, False
        self.stats.admissions += 0 if self.first_fill else len(refill.admit)
        self.first_fill = False

    def _exchange(self, refill: _Refill) -> tuple[bool, bool, int, int, tuple[int, ...]]:
        """The boundary's one exchange between processes (their device calls must match): whether
        any has device work, rows left, the most rows queued on one (for freed slots), the earliest
        step at which answers are due (it ends the next decode call), and the refill call's shapes."""
        work, live, queued, negated, *sizes = hosts.agree_max_each(
            refill.work, bool(self.queue) or bool(self.searches) or bool(self.slots.held().any()),
            len(self.queue), -min([job.due for job in self.searches], default=_NEVER),
            *self.sampler.refill_sizes(refill.blocks, refill.admit))
        return bool(work), bool(live), int(queued), -negated, tuple(sizes)

    def _refill(self, refill: _Refill, sizes: tuple[int, ...]) -> None:
        t0 = time.perf_counter()
        self.state = self.sampler.refill(self.state, refill.blocks, refill.end, refill.resume, refill.admit,
                                         self.prompt_kv, sizes=sizes)
        jax.block_until_ready(self.state.resp_len)  # time the appends, not their dispatch
        stats = self.stats
        stats.insert_s += time.perf_counter() - t0
        stats.refills += 1
        stats.inserts += sum(1 for b in refill.blocks if b)
        now = time.perf_counter()
        for _, _, row in refill.admit:
            self.rows[row - self.offset].admitted = now

    def _admit_batch(self) -> int:
        """The rows that must end before a decode call comes back to admit queued ones."""
        return max(1, round(self.cfg.admit_share * self.slots.width))

    def _narrow(self) -> None:
        keep = _narrower(self.slots.row, self.cfg.narrow_floor)
        if keep is not None:
            self.state = self.sampler.narrow(self.state, keep)
            self.slots = self.slots.take(keep)
            self.stats.narrowed += 1

    def _ends_to_narrow(self, ended: int) -> int:
        """How many rows must end before the next boundary can halve the batch (0: it cannot): the
        held rows, less those this boundary's refill ended, must fit in half the slots."""
        if not can_halve(self.slots.width, self.cfg.narrow_floor):
            return 0
        return max(1, int(self.slots.held().sum()) - ended - self.slots.width // 2)

    def _decode(self, next_due: int, ends: int) -> None:
        """Continuous: back to the host as soon as a row pauses (a query to send), once `ends` rows
        have ended (freed slots take queued rows, or the batch can narrow; 0: no end brings it
        back), and at the next answers' due step.
        Lockstep: until no row is active."""
        lockstep, stats = self.cfg.lockstep, self.stats
        t0 = time.perf_counter()
        self.state, steps, busy = self.sampler.decode_counted(
            self.state, None if lockstep or next_due == _NEVER else next_due - stats.decode_steps, self.forced,
            pauses=0 if lockstep else 1, ends=0 if lockstep else ends)
        stats.decode_s += time.perf_counter() - t0
        stats.decode_steps += steps
        stats.slot_steps += steps * self.slots.width * jax.process_count()
        stats.active_slot_steps += busy
        stats.boundaries += 1


def can_halve(width: int, floor: int) -> bool:
    """Whether narrowing may halve a batch of `width` slots: the half is at least `floor` (and 1) wide."""
    return width // 2 >= max(1, floor)


def _narrower(slot_row: np.ndarray, floor: int) -> np.ndarray | None:
    """The slots to keep when at most half of them hold a row: every held slot, then free ones up
    to the narrowest halving of the width that still holds them all and is at least `floor` wide
    (each width compiles once; halvings keep their number small). None: keep the width."""
    held = np.flatnonzero(slot_row >= 0)
    width = len(slot_row)
    while len(held) and len(held) <= width // 2 and can_halve(width, floor):
        width //= 2
    if width == len(slot_row):
        return None
    free = np.flatnonzero(slot_row < 0)
    return np.concatenate([held, free[:width - len(held)]])
