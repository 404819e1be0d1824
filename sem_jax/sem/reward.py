"""Rewards selected by config: `sem` (the paper's answer-first reward) and `research`
(the ReSearch baseline). Every constant is a config field."""

from __future__ import annotations

import dataclasses

from sem_jax.data.example import Example
from sem_jax.protocol.sem import Parsed  # research_reward reads only .valid and .answer (any protocol's)
from sem_jax.sem.scoring import score_answer

CASES = ("invalid", "direct_correct", "direct_wrong", "redundant_search", "search_after_wrong",
         "research_correct", "research_wrong")


@dataclasses.dataclass(frozen=True)
class RewardParams:
    """The reward constants. The paper's are not public; these defaults are this project's choice,
    under one rule that `check_sem_params` enforces: every trajectory that searched earns less than
    a correct direct answer (by 0.2 at the defaults), or a policy could write a throwaway first
    answer and search for free on questions it knows."""
    r_direct: float = 1.0           # first answer correct, no search
    search_penalty: float = 0.5     # subtracted when a correct first answer is followed by a search
    r_no_search_wrong: float = 0.0  # first answer wrong, no search
    r_search_base: float = 0.1      # first answer wrong, searched: base ...
    r_search_scale: float = 0.7     # ... plus scale * F1(final answer): at most 0.8
    tau: float = 0.8                # F1 at or above which an answer counts as correct
    research_format_reward: float = 0.1  # ReSearch: well-formed but wrong
    allow_free_search: bool = False  # ablations only: accept constants under which a search is free

    def best_searched(self) -> float:
        """The most any trajectory with a search can earn under the SEM reward (F1 in [0, 1])."""
        return max(self.r_direct - self.search_penalty, self.r_search_base + max(self.r_search_scale, 0.0))


def check_sem_params(rp: RewardParams) -> None:
    """Refuse constants under which a searched answer ties or beats a correct direct one."""
    if rp.allow_free_search or rp.best_searched() < rp.r_direct:
        return
    raise ValueError(
        f"reward_params: a trajectory that searched can earn {rp.best_searched():.3g} "
        f"(max(r_direct - search_penalty, r_search_base + r_search_scale)), not less than r_direct={rp.r_direct:.3g}; "
        "a throwaway first answer would then buy a free search. Lower r_search_base + r_search_scale or raise "
        "search_penalty, or set reward_params.allow_free_search=True for an ablation")


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
