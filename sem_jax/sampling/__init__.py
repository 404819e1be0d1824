"""Compiled sampling with stop strings, and the search-aware rollout around it."""

from sem_jax.sampling.rollout import Engine, RetrieverError, RolloutConfig, RolloutStats, Trajectory, rollout
from sem_jax.sampling.sampler import Sampler, SamplerState, SamplingConfig, sample_tokens
from sem_jax.sampling.stop import StopAutomaton, build_stop_automaton, stop_automaton_from_bytes

__all__ = ["Engine", "RetrieverError", "RolloutConfig", "RolloutStats", "Sampler", "SamplerState", "SamplingConfig", "StopAutomaton",
           "Trajectory", "build_stop_automaton", "rollout", "sample_tokens",
           "stop_automaton_from_bytes"]
