"""SEM's scoring and rewards (the protocol's prompts and parser: sem_jax.protocol)."""

from sem_jax.sem.reward import CASES, RewardParams, get_reward, research_reward, sem_reward
from sem_jax.sem.scoring import exact_match, normalize_answer, score_answer, token_f1

__all__ = ["CASES", "RewardParams", "exact_match", "get_reward", "normalize_answer", "research_reward",
           "score_answer", "sem_reward", "token_f1"]
