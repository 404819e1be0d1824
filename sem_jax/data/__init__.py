"""Data: the example type, sources, and the SEM training mix."""

from sem_jax.data.example import Example

__all__ = ["Example"]
