"""LoRA: low-rank adapters on the projections of the top layers, the base weights frozen.

A target projection W [in, out] of layer i >= `first` is used as W + (alpha / rank) * A_i @ B_i,
A_i [in, rank] drawn as PEFT draws it, B_i [rank, out] zeros (so step 0 is the base model).
Adapters are a plain dict `{target: {"a": [n, in, rank], "b": [n, rank, out]}}` over the
n = num_layers - first adapted layers; the trainer's optimizer holds these alone.

The frozen layers below `first` never meet a gradient: the training forward builds each layer's
weights of its own (`layer_weights`), the layers below from the base alone, so autodiff has
nothing to carry back through them. The sampler and export use the merged weights (`merge`,
once per step): no extra cost per decoded token.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sem_jax.errors import Refused
from sem_jax.model.architecture import Qwen2Config

# Target name -> (the stacked kernel it adapts, the HF module it is in PEFT's names).
TARGETS = {
    "q": ("q_kernel", "self_attn.q_proj"), "k": ("k_kernel", "self_attn.k_proj"),
    "v": ("v_kernel", "self_attn.v_proj"), "o": ("o_kernel", "self_attn.o_proj"),
    "gate": ("gate_kernel", "mlp.gate_proj"), "up": ("up_kernel", "mlp.up_proj"),
    "down": ("down_kernel", "mlp.down_proj"),
}


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Which projections of which layers carry adapters, and their rank and scale."""
    rank: int
    alpha: float
    targets: tuple[str, ...]
    first: int          # the lowest adapted layer
    num_layers: int     # the model's depth

    def __post_init__(self):
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise Refused(f"config.lora.targets={','.join(self.targets)!r}: choose among {','.join(TARGETS)}")
        if not 0 <= self.first < self.num_layers:
            raise Refused(f"config.lora.layers={self.num_layers - self.first}: the model has {self.num_layers} layers")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def adapted(self) -> int:
        return self.num_layers - self.first

    def describe(self) -> str:
        return (f"LoRA rank {self.rank}, alpha {self.alpha:g} on {','.join(self.targets)} of layers "
                f"{self.first}-{self.num_layers - 1}")


def spec_of(lora: Any, cfg: Qwen2Config) -> LoraSpec | None:
    """The spec of the config's `lora` section (`sem_jax.config.Lora`) for model `cfg`; None
    when `lora.rank` is 0 (a full fine-tune)."""
    if not lora.rank:
        return None
    layers = lora.layers or cfg.num_layers
    targets = tuple(t.strip() for t in lora.targets.split(",") if t.strip())
    return LoraSpec(rank=lora.rank, alpha=lora.alpha, targets=targets, first=cfg.num_layers - layers,
                    num_layers=cfg.num_layers)


def matrix_dims(cfg: Qwen2Config, target: str) -> tuple[int, int]:
    """(in, out) of a target's projection as a 2-D matrix."""
    e, m, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q": (e, q), "k": (e, kv), "v": (e, kv), "o": (q, e), "gate": (e, m), "up": (e, m), "down": (m, e)}[target]


def init_adapters(spec: LoraSpec, cfg: Qwen2Config, seed: int = 0) -> dict[str, dict[str, jax.Array]]:
    """Fresh adapters in float32: A uniform in +-1/sqrt(in) (PEFT's Kaiming-uniform with a = sqrt(5)),
    B zeros, so that the adapted model starts as the base."""
    keys = jax.random.split(jax.random.key(seed), len(spec.targets))
    out = {}
    for key, t in zip(keys, spec.targets):
        fan_in, fan_out = matrix_dims(cfg, t)
        bound = 1.0 / np.sqrt(fan_in)
        out[t] = {"a": jax.random.uniform(key, (spec.adapted, fan_in, spec.rank), jnp.float32, -bound, bound),
                  "b": jnp.zeros((spec.adapted, spec.rank, fan_out), jnp.float32)}
    return out


def abstract_adapters(spec: LoraSpec, cfg: Qwen2Config, sharding: Any = None) -> dict:
    """`init_adapters`' shapes as abstract arrays, placed by `sharding` when given (a restore's
    target, a compile-only check's argument)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        jax.eval_shape(lambda: init_adapters(spec, cfg)))


def delta(spec: LoraSpec, adapter: dict[str, jax.Array], shape: tuple[int, ...]) -> jax.Array:
    """scale * A @ B for every adapted layer, shaped as the stacked kernel's layers [n, *shape[1:]]."""
    d = jnp.einsum("lir,lro->lio", adapter["a"], adapter["b"]) * spec.scale
    return d.reshape(d.shape[0], *shape[1:])


def layer_weights(spec: LoraSpec, layers: list[dict[str, jax.Array]], adapters: dict) -> list[dict[str, jax.Array]]:
    """Per-layer weights (`Qwen2.layer_list()` of the base) with each adapted layer's targets
    plus its delta; the layers below `first` are the base's own arrays."""
    out = [dict(p) for p in layers]
    for t in spec.targets:
        name = TARGETS[t][0]
        shape = (spec.adapted, *layers[spec.first][name].shape)
        d = delta(spec, adapters[t], shape)
        for j in range(spec.adapted):
            p = out[spec.first + j]
            p[name] = p[name] + d[j].astype(p[name].dtype)
    return out


def merge(spec: LoraSpec, base: Any, adapters: dict) -> Any:
    """The base's parameter state (`nnx.split(model)[1]`) with the adapters merged into their
    kernels: new arrays for the adapted kernels, the base's own for everything else."""
    names = [TARGETS[t][0] for t in spec.targets]
    kernels = {n: base["layers"][n][...] for n in names}
    merged = _merged_kernels_fn(spec)(kernels, {TARGETS[t][0]: adapters[t] for t in spec.targets})
    out = jax.tree.map(lambda x: x, base)
    for n in names:
        out["layers"][n] = out["layers"][n].replace(merged[n])
    return out


def _merged_kernels_fn(spec: LoraSpec):
    def fn(kernels, adapters):
        return {name: k.at[spec.first:].add(delta(spec, adapters[name], k.shape).astype(k.dtype))
                for name, k in kernels.items()}
    return _MERGE_FNS.setdefault(spec, jax.jit(fn))


_MERGE_FNS: dict[LoraSpec, Any] = {}  # one compiled merge per spec


def fingerprint(params: Any) -> str:
    """A short hash of a parameter state's values: each array's name, shape and dtype, and two sums
    of its bits read as 32-bit integers (plain and position-weighted, modulo 2^32). Integer sums do
    not depend on the order of the reduction, so any mesh and any number of processes give the same
    fingerprint; two bases that differ anywhere differ here but for sums that wrap alike."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    sums = np.asarray(jax.device_get(_sums([x for _, x in leaves])))
    h = hashlib.sha256()
    for (path, x), s in zip(leaves, sums):
        h.update(f"{jax.tree_util.keystr(path)}{tuple(x.shape)}{x.dtype}".encode())
        h.update(s.tobytes())
    return h.hexdigest()[:16]


@jax.jit
def _sums(leaves):
    def one(x):
        bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32).ravel(), jnp.uint32)
        w = (jnp.arange(bits.shape[0], dtype=jnp.uint32) % 251) + 1
        return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * w, dtype=jnp.uint32)])
    return jnp.stack([one(x) for x in leaves])


def check_base(recorded: str | None, have: str | None, model_path: str | None, where: str) -> None:
    """Refuse adapters (a checkpoint's, fingerprint `recorded`) on a base other than theirs."""
    if recorded != have:
        raise Refused(f"{where}: its adapters were trained on a base with fingerprint {recorded}, but "
                      f"model.path={model_path} has {have}; point model.path at the base the run trained on")


def peft_tensors(spec: LoraSpec, adapters: dict) -> dict[str, np.ndarray]:
    """The adapters under PEFT's names and layout for a Qwen2 causal LM (torch's [out, in]):
    `base_model.model.model.layers.{i}.{module}.lora_A.weight` [rank, in] and `lora_B.weight`
    [out, rank]."""
    out = {}
    for t in spec.targets:
        a, b = (np.asarray(jax.device_get(adapters[t][k]), np.float32) for k in ("a", "b"))
        for j in range(spec.adapted):
            prefix = f"base_model.model.model.layers.{spec.first + j}.{TARGETS[t][1]}"
            out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[j].T)
            out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[j].T)
    return out


def peft_config(spec: LoraSpec, base_path: str | None) -> dict[str, Any]:
    """PEFT's adapter_config.json for these adapters."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "target_modules": sorted(TARGETS[t][1].split(".")[1] for t in spec.targets),
            "layers_to_transform": list(range(spec.first, spec.num_layers)), "layers_pattern": "layers",
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "init_lora_weights": True, "base_model_name_or_path": base_path, "inference_mode": True}


__all__ = ["LoraSpec", "TARGETS", "abstract_adapters", "check_base", "delta", "fingerprint", "init_adapters", "layer_weights",
           "matrix_dims", "merge", "peft_config", "peft_tensors", "spec_of"]
