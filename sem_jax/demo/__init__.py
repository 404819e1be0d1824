"""The CPU demo as a stage of its own: a synthetic world (`world`), a warm start of a tiny
random-init policy on it (`warm_start`), then the ordinary `sem_jax.train` on the world's files
from the warm-start directory (`stage`), and the before/after table (`report`)."""
