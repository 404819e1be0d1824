"""Pallas kernels for TPU (attention over the KV cache, splash attention, a decode step's attention
inputs, MLP and sampled LM head) and the one dispatch that chooses them (`dispatch`)."""
