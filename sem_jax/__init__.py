"""sem_jax: SEM (search-efficient RL for LLMs) as a JAX/Flax training stack."""

__version__ = "0.1.0"
