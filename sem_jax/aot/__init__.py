"""Compile-only tooling: a config's programs compiled for a target (a TPU topology from a CPU host)
without running them.

- `python -m sem_jax.aot` (`__main__`): the fit check, per-device memory of every program a step runs;
- `roofline` (`--roofline`): XLA's FLOPs and bytes per call against the ideal and predicted times per chip;
- `measure` (`--measure`): the same programs run and timed on the local devices, beside the prediction;
- `programs`: abstract inputs, placement and costs shared by the three; `collectives`: what each
  collective sends over the interconnect.
"""
