"""Which kernel runs where: the one place that decides, by platform and by the config's kernel
mode (`model.kernels`), between a Pallas kernel of this package and XLA's own program, and
whether the layers run one by one or under the layer scan.

The model asks here for each call (`choice`); the sampler and the trainer ask only for their
per-layer default and, for the sampled LM head, `head_candidates`: neither imports a kernel.
"""

from __future__ import annotations

import jax

from sem_jax.kernels.head_sampling import head_candidates

MODES = ("auto", "pallas", "interpret", "xla")  # model.kernels: auto = Pallas where it applies, on TPU


def on_tpu() -> bool:
    """Whether this trace compiles for TPUs: the ambient mesh's devices (a compile-only TPU
    topology from a CPU host counts), else the default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    return (jax.default_backend() if mesh.empty else mesh.abstract_device.platform) == "tpu"


def check_mode(name: str, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"{name}={mode!r}; choose one of {MODES}")


def choice(name: str, mode: str, applies: bool, auto: bool, needs: str) -> str | None:
    """A kernel mode (`name`'s `mode`) resolved for one call: None for XLA's program ("xla", or
    "auto" where `auto` does not hold), else the mode; a kernel asked for where it cannot apply
    is refused, saying what it `needs`."""
    if mode == "xla" or (mode == "auto" and not auto):
        return None
    if not applies:
        raise ValueError(f"{name}={mode!r} needs {needs}")
    return mode


def per_layer_default(sampler: bool = False, platform: str | None = None) -> bool:
    """Whether the trainer (or, `sampler`, the sampler) runs the layers one by one
    (`hidden_states(layers=...)`) rather than under the layer scan, on `platform` (default: the
    backend's). Both on CPUs, where the scan copies each layer's weights (and cache window) before
    using them. The sampler on GPUs too: there the scan also copied each layer's slices, and
    transposed the whole stacked KV cache for the attention's dots at every decode step (a
    per-layer cache stores keys and values in the dots' layout: a 3x faster decode step on an
    H200). TPUs keep the scan (with the `cache_attention` kernel reading the cache in place)."""
    platform = platform or jax.default_backend()
    return platform == "cpu" or (sampler and platform == "gpu")


__all__ = ["MODES", "check_mode", "choice", "head_candidates", "on_tpu", "per_layer_default"]
