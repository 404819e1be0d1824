"""Answers scored (EM, F1: `answers`) and the rewards built on them (SEM's and ReSearch's: `rules`);
the protocols' prompts and parsers are `sem_jax.protocol`."""

from sem_jax.rewards.answers import exact_match, normalize_answer, score_answer, token_f1
from sem_jax.rewards.rules import CASES, RewardParams, get_reward, research_reward, sem_reward

__all__ = ["CASES", "RewardParams", "exact_match", "get_reward", "normalize_answer", "research_reward",
           "score_answer", "sem_reward", "token_f1"]
