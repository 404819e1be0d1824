"""Greedy evaluation of a policy (used by training and by `sem_jax.evaluate`): EM, F1, search
ratio and searches per question, by source."""

from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter, defaultdict
from collections.abc import Sequence

import jax
import numpy as np

from sem_jax.data.example import Example
from sem_jax.data.mix import process_share
from sem_jax.hosts import agree_max, gather_json
from sem_jax.protocol import SEM, Protocol
from sem_jax.sampling.rollout import RolloutConfig, Trajectory, rollout
from sem_jax.rewards.answers import score_answer


def score_trajectory(t: Trajectory, ex: Example, protocol: Protocol = SEM) -> dict:
    p = protocol.parse(t.text, t.end_reason == "eos")
    em, f1 = score_answer(p.answer, ex)
    return {"id": ex.id, "source": ex.source, "needs_search": ex.needs_search, "question": ex.question,
            "gold": list(ex.answers),
            "answer": p.answer, "valid": p.valid, "reason": p.reason, "em": em, "f1": f1, "searches": t.num_searches,
            "response_tokens": int(len(t.response_ids)), "end_reason": t.end_reason, "response": t.text}


RECORD_KEYS = ("source", "needs_search", "em", "f1", "searches", "response_tokens", "valid", "reason",
               "end_reason")  # what `aggregate` reads


def reason_key(reason: str) -> str:
    """A parser's reason as a metric name: `invalid/must_start_with_think_then_answer`."""
    return "invalid/" + (re.sub(r"[^a-z0-9]+", "_", reason.lower()).strip("_") or "unknown")


def invalid_reasons(records: Sequence[dict]) -> Counter:
    """How many responses the parser rejected, by its reason."""
    return Counter(r["reason"] for r in records if not r["valid"])


def top_reasons(scores: dict[str, float], n: int) -> str:
    """The `n` commonest `invalid/...` shares of `aggregate`'s scores: "no_tags 60%, ..."."""
    reasons = sorted(((k.removeprefix("invalid/"), v) for k, v in scores.items() if k.startswith("invalid/")),
                     key=lambda kv: -kv[1])
    return ", ".join(f"{k} {100 * v:.0f}%" for k, v in reasons[:n])


def aggregate(records: Sequence[dict]) -> dict[str, float]:
    """Means overall, per source and per label (`known`: questions that need no search, `unknown`:
    those that do): em, f1, search_ratio (share with >= 1 search), searches/question, response
    tokens, the share of valid responses and of responses cut by the budget (`length`); and
    overall, the share of responses the parser rejected for each reason (`invalid/...`)."""
    out: dict[str, float] = {}
    groups = defaultdict(list)
    for r in records:  # a source named for its label (the demo's) is one group; in a fixed order (the output's)
        for name in dict.fromkeys(("all", r["source"], "unknown" if r["needs_search"] else "known")):
            groups[name].append(r)
    for name, rs in groups.items():
        sfx = "" if name == "all" else f"/{name}"
        out[f"em{sfx}"] = float(np.mean([r["em"] for r in rs]))
        out[f"f1{sfx}"] = float(np.mean([r["f1"] for r in rs]))
        out[f"search_ratio{sfx}"] = float(np.mean([r["searches"] > 0 for r in rs]))
        out[f"searches_per_q{sfx}"] = float(np.mean([r["searches"] for r in rs]))
        out[f"response_tokens{sfx}"] = float(np.mean([r["response_tokens"] for r in rs]))
        out[f"valid{sfx}"] = float(np.mean([r["valid"] for r in rs]))
        out[f"length{sfx}"] = float(np.mean([r["end_reason"] == "length" for r in rs]))
    for reason, n in invalid_reasons(records).items():  # why responses were invalid, overall
        out[reason_key(reason)] = n / len(records)
    return out


MODES = ("policy", "direct", "naive_rag")


PROGRESS_S = 60.0  # an evaluation says how far it is at most this often


def run_mode(mode: str, sampler, tokenizer, retriever, examples: Sequence[Example], cfg: RolloutConfig,
             batch_size: int, system_prompt: str | None = None, protocol: Protocol = SEM) -> list[dict]:
    """Per-question records for one mode (greedy, group size 1); `system_prompt` (default: the
    protocol's) is the policy mode's (the baselines have their own)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}; choose from {MODES}")
    rcfg = dataclasses.replace(cfg, group_size=1, max_searches=cfg.max_searches if mode == "policy" else 0)
    records = []
    start = said = time.perf_counter()
    for i in range(0, len(examples), batch_size):
        chunk = list(examples[i:i + batch_size])
        if mode == "naive_rag":
            hits = retriever.search([e.question for e in chunk], cfg.top_k)  # once per question
            prompts = [tokenizer.encode(protocol.rag_prompt(e, protocol.format_results(h, tokenizer,
                                                                                       cfg.max_tokens_per_passage)),
                                        add_special_tokens=False) for e, h in zip(chunk, hits)]
        elif mode == "direct":
            prompts = [protocol.encode_prompt(tokenizer, e, protocol.direct_system_prompt) for e in chunk]
        else:
            prompts = [protocol.encode_prompt(tokenizer, e, system_prompt) for e in chunk]
        trajs, _ = rollout(sampler, tokenizer, retriever, prompts, jax.random.key(0), rcfg, protocol)
        for t, e in zip(trajs, chunk):
            rec = score_trajectory(t, e, protocol)
            if mode == "naive_rag":
                rec["searches"] = 1  # it always retrieves (before answering)
            records.append(rec)
        if time.perf_counter() - said > PROGRESS_S and jax.process_index() == 0:  # a long set says where it is
            said = time.perf_counter()
            print(f"[eval] {mode}: {len(records)} of {len(examples)} questions, {said - start:.0f}s", flush=True)
    return records


def shared_records(mode: str, sampler, tokenizer, retriever, share: Sequence[Example], filler: Example,
                   cfg: RolloutConfig, batch_size: int, system_prompt: str | None, protocol: Protocol, mesh,
                   keys: Sequence[str] | None = None) -> list[list[dict]]:
    """`run_mode` on this process's `share` of the questions, padded with `filler` to the count
    of the largest share (the same device calls everywhere); every process's records (only
    `keys` of them, when given), in process order."""
    n = agree_max(len(share))
    padded = list(share) + [filler] * (n - len(share))
    with jax.set_mesh(mesh):
        records = run_mode(mode, sampler, tokenizer, retriever, padded, cfg, batch_size, system_prompt,
                           protocol)[:len(share)]
    return gather_json([{k: r[k] for k in keys} for r in records] if keys else records)


def all_records(mode: str, sampler, tokenizer, retriever, examples: Sequence[Example], cfg: RolloutConfig,
                batch_size: int, system_prompt: str | None, protocol: Protocol, mesh) -> list[dict]:
    """Records of `examples` (the same list on every process), each process scoring every
    `process_count`-th question; returned in `examples`' order on every process."""
    count = jax.process_count()
    everyone = shared_records(mode, sampler, tokenizer, retriever, process_share(examples, jax.process_index(), count),
                              examples[0], cfg, batch_size, system_prompt, protocol, mesh)
    return [everyone[i % count][i // count] for i in range(len(examples))]


def policy_scores(sampler, tokenizer, retriever, examples: Sequence[Example], cfg: RolloutConfig, batch_size: int,
                  system_prompt: str, protocol: Protocol, mesh) -> dict[str, float]:
    """Greedy policy-mode scores of all processes' held-out questions, each process giving its
    share `examples`; the sampler's weights are released after."""
    everyone = shared_records("policy", sampler, tokenizer, retriever, examples, examples[-1], cfg, batch_size,
                              system_prompt, protocol, mesh, RECORD_KEYS)
    sampler.release()
    return aggregate(sum(everyone, []))
