"""SEM semantics: prompt template, response parser, answer scoring, rewards."""

from sem_jax.sem.parse import Parsed, parse_response
from sem_jax.sem.reward import CASES, RewardParams, get_reward, research_reward, sem_reward
from sem_jax.sem.scoring import exact_match, normalize_answer, score_answer, token_f1
from sem_jax.sem.template import SYSTEM_PROMPT, chat_prompt, encode_prompt

__all__ = ["CASES", "Parsed", "RewardParams", "SYSTEM_PROMPT", "chat_prompt", "encode_prompt",
           "exact_match", "get_reward", "normalize_answer", "parse_response", "research_reward",
           "score_answer", "sem_reward", "token_f1"]
