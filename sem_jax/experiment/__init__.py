"""SEM vs ReSearch on a real checkpoint, real MMLU and GSM8K, invented multi-hop questions:
`python -m sem_jax.experiment` (pipeline.py)."""
