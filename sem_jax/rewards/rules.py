"""Rewards selected by config: `sem` (the paper's answer-first reward) and `research`
(the ReSearch baseline). Every constant is a config field."""

from __future__ import annotations

from sem_jax.data.example import Example
from sem_jax.protocol.sem import Parsed  # research_reward reads only .valid and .answer (any protocol's)
from sem_jax.rewards.answers import score_answer
from sem_jax.config import RewardParams  # the constants, each a config field (reward_params)

CASES = ("invalid", "direct_correct", "direct_wrong", "redundant_search", "search_after_wrong",
         "research_correct", "research_wrong")


def sem_reward(p: Parsed, ex: Example, rp: RewardParams) -> tuple[float, str]:
    if not p.valid:
        return 0.0, "invalid"
    first_ok = score_answer(p.first_answer, ex)[1] >= rp.tau
    if p.num_searches == 0:
        return (rp.r_direct, "direct_correct") if first_ok else (rp.r_no_search_wrong, "direct_wrong")
    if first_ok:
        return rp.r_direct - rp.search_penalty, "redundant_search"
    return rp.r_search_base + rp.r_search_scale * score_answer(p.final_answer, ex)[1], "search_after_wrong"


def research_reward(p: Parsed, ex: Example, rp: RewardParams) -> tuple[float, str]:
    if not p.valid:
        return 0.0, "invalid"
    f1 = score_answer(p.answer, ex)[1]
    return (f1, "research_correct") if f1 > 0 else (rp.research_format_reward, "research_wrong")


REWARDS = {"sem": sem_reward, "research": research_reward}


def get_reward(name: str):
    if name not in REWARDS:
        raise ValueError(f"reward={name!r}; choose one of {sorted(REWARDS)}")
    return REWARDS[name]
