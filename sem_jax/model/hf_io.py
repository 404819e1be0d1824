"""Hugging Face Qwen2 / Qwen2.5 / Qwen3 checkpoints <-> sem_jax models.

Loading streams: each parameter is built with `jax.make_array_from_callback`,
so every device reads only its own slice straight from the memory-mapped
safetensors files; the whole model is never held twice in host memory.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from sem_jax.model.architecture import Qwen2Config
from sem_jax.model.qwen2 import Qwen2, param_shapes
from sem_jax.model.safetensors_io import SafetensorsFile, write_safetensors
from sem_jax.sharding import named_sharding

log = logging.getLogger(__name__)

# sem_jax name -> (HF name, layout). Layout: "same" (as stored), "flat" (HF keeps it
# 1-D), or n: HF stores [out, in] and our first n dims are the `in` dims.
LAYER_MAP: dict[str, tuple[str, Any]] = {
    "input_norm": ("input_layernorm.weight", "same"),
    "q_kernel": ("self_attn.q_proj.weight", 1),
    "q_bias": ("self_attn.q_proj.bias", "flat"),
    "k_kernel": ("self_attn.k_proj.weight", 1),
    "k_bias": ("self_attn.k_proj.bias", "flat"),
    "v_kernel": ("self_attn.v_proj.weight", 1),
    "v_bias": ("self_attn.v_proj.bias", "flat"),
    "q_norm": ("self_attn.q_norm.weight", "same"),
    "k_norm": ("self_attn.k_norm.weight", "same"),
    "o_kernel": ("self_attn.o_proj.weight", 2),
    "post_norm": ("post_attention_layernorm.weight", "same"),
    "gate_kernel": ("mlp.gate_proj.weight", 1),
    "up_kernel": ("mlp.up_proj.weight", 1),
    "down_kernel": ("mlp.down_proj.weight", 1),
}
TOP_MAP: dict[str, tuple[str, Any]] = {
    "embed": ("model.embed_tokens.weight", "same"),
    "final_norm": ("model.norm.weight", "same"),
    "lm_head": ("lm_head.weight", 1),
}


def hf_tensors(cfg: Qwen2Config) -> list[tuple[str, str, int | None, Any, tuple[int, ...]]]:
    """Every HF tensor: (HF name, sem_jax name, layer or None, layout, sem_jax per-tensor shape)."""
    out = []
    for name, (shape, _) in param_shapes(cfg).items():
        if name.startswith("layers."):
            key = name.split(".", 1)[1]
            hf, layout = LAYER_MAP[key]
            out += [(f"model.layers.{i}.{hf}", name, i, layout, shape[1:]) for i in range(cfg.num_layers)]
        else:
            hf, layout = TOP_MAP[name]
            out.append((hf, name, None, layout, shape))
    return out


def hf_shape(layout: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
    if layout == "same":
        return shape
    if layout == "flat":
        return (int(np.prod(shape)),)
    return (int(np.prod(shape[layout:])), int(np.prod(shape[:layout])))


def to_ours(w: np.ndarray, layout: Any, shape: tuple[int, ...]) -> np.ndarray:
    return w.reshape(shape) if layout in ("same", "flat") else w.T.reshape(shape)


def to_hf(x: np.ndarray, layout: Any) -> np.ndarray:
    if layout == "same":
        return x
    if layout == "flat":
        return x.reshape(-1)
    return x.reshape(int(np.prod(x.shape[:layout])), -1).T


def model_variables(model: Qwen2) -> dict[str, nnx.Variable]:
    """Flat sem_jax name -> parameter Variable (names as in `param_shapes`)."""
    out = {"embed": model.embed, "final_norm": model.final_norm}
    out.update({f"layers.{k}": v for k, v in model.layers.items()})
    if not model.config.tie_word_embeddings:
        out["lm_head"] = model.lm_head
    return out


class _Checkpoint:
    """Name -> file lookup over one `model.safetensors` or an indexed set of shards."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(index):
            with open(index) as fh:
                weight_map = json.load(fh).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no 'weight_map'")
            files = {f: SafetensorsFile(os.path.join(path, f)) for f in sorted(set(weight_map.values()))}
            self.where = {name: files[f] for name, f in weight_map.items()}
        elif os.path.exists(single):
            f = SafetensorsFile(single)
            self.where = {name: f for name in f.keys()}
        else:
            raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json "
                                    "(only safetensors checkpoints are read: no pickle)")

    def get(self, name: str, expected: tuple[int, ...]) -> np.ndarray:
        f = self.where.get(name)
        if f is None or name not in f:
            raise KeyError(f"{f.path if f else 'checkpoint'}: missing tensor {name!r}")
        arr = f[name]
        if tuple(arr.shape) != tuple(expected):
            raise ValueError(f"{f.path}: tensor {name!r} has shape {tuple(arr.shape)}, "
                             f"config.json implies {tuple(expected)}")
        return arr


def read_config(path: str) -> Qwen2Config:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{cfg_path}: not found (is {path!r} a Hugging Face model directory?)")
    with open(cfg_path) as fh:
        return Qwen2Config.from_hf(json.load(fh), source=cfg_path)


def from_pretrained(path: str, *, dtype: Any = jnp.float32, compute_dtype: Any = None,
                    mesh: Mesh | None = None, remat: str = "none", kernels: str = "auto") -> Qwen2:
    """Load a local Hugging Face Qwen2 or Qwen3 directory as a sem_jax `Qwen2` (the model of both).

    `dtype` is the parameter dtype, `compute_dtype` the activation dtype (defaults
    to `dtype`); `kernels` both of `Qwen2`'s kernel modes. With `mesh`, each parameter is
    placed straight into its sharding from the rules table while streaming.
    """
    cfg = read_config(path)
    ckpt = _Checkpoint(path)
    model = nnx.eval_shape(lambda: Qwen2(cfg, rngs=nnx.Rngs(0), param_dtype=dtype,
                                         dtype=compute_dtype or dtype, remat=remat, cache_kernel=kernels, decode_kernel=kernels,
                                         attention_kernel=kernels))
    by_param: dict[str, list] = {}
    for hf, name, layer, layout, shape in hf_tensors(cfg):
        by_param.setdefault(name, []).append((hf, layer, layout, shape))
    shapes = param_shapes(cfg)
    np_dtype = np.dtype(jnp.dtype(dtype))
    for name, var in model_variables(model).items():
        shape, axes = shapes[name]
        entries = by_param[name]
        # Check every tensor exists with the right shape before any device work.
        for hf, _, layout, tshape in entries:
            ckpt.get(hf, hf_shape(layout, tshape))
        sharding = named_sharding(mesh, axes, shape) if mesh is not None else \
            SingleDeviceSharding(jax.local_devices()[0])

        def read(index, entries=entries, stacked=name.startswith("layers.")):
            def one(hf, layout, tshape, sub):
                w = to_ours(ckpt.get(hf, hf_shape(layout, tshape)), layout, tshape)
                return np.asarray(w[sub], dtype=np_dtype)
            if not stacked:
                hf, _, layout, tshape = entries[0]
                return one(hf, layout, tshape, index)
            layers = range(len(entries))[index[0]]
            return np.stack([one(entries[l][0], entries[l][2], entries[l][3], index[1:]) for l in layers])

        var.set_value(jax.make_array_from_callback(shape, sharding, read))
    used = {hf for hf, *_ in hf_tensors(cfg)}
    unused = sorted(set(ckpt.where) - used - {"lm_head.weight"})
    if unused:
        log.warning("%s: %d tensor(s) not used by %s: %s", path, len(unused), cfg.architecture, unused[:5])
    return model


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size={size!r}: expected bytes or e.g. '5GB', '500MB'")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(m.group(1)) * scale)


def _host(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def save_pretrained(model: Qwen2, path: str, *, max_shard_size: int | str = "5GB",
                    dtype: Any = None) -> list[str]:
    """Write `model` as a Hugging Face directory of its architecture (Qwen2 or Qwen3) that
    `transformers` loads.

    Writes config.json, generation_config.json and safetensors in `dtype` (default:
    the parameter dtype), split into `model-0000k-of-0000N.safetensors` with an index
    when larger than `max_shard_size`. Tensors are gathered to the host one at a
    time (on a multi-host run every process gathers, process 0 writes). Returns the
    safetensors file names.
    """
    cfg = model.config
    out_dtype = np.dtype(jnp.dtype(dtype or model.param_dtype))
    if out_dtype not in (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)):
        raise ValueError(f"save_pretrained: dtype {out_dtype} not supported (float32, bfloat16, float16)")
    limit = _parse_size(max_shard_size)
    variables = model_variables(model)
    entries = hf_tensors(cfg)
    plan: list[list] = [[]]
    size = 0
    for entry in entries:
        nbytes = int(np.prod(entry[4])) * out_dtype.itemsize
        if plan[-1] and size + nbytes > limit:
            plan.append([])
            size = 0
        plan[-1].append(entry)
        size += nbytes
    if jax.process_index() == 0:  # the only writer
        os.makedirs(path, exist_ok=True)
    lookup = {e[0]: e for e in entries}

    def fetch(hf_name):
        _, name, layer, layout, _ = lookup[hf_name]
        value = variables[name][...]
        value = value[layer] if layer is not None else value
        return to_hf(_host(value), layout).astype(out_dtype)

    n = len(plan)
    names = ["model.safetensors"] if n == 1 else \
        [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    if jax.process_index() != 0:  # multi-host: take part in every gather, write nothing
        for hf_name in lookup:
            fetch(hf_name)
        return names
    weight_map, total = {}, 0
    for fname, group in zip(names, plan):
        total += write_safetensors(
            os.path.join(path, fname),
            [(hf, hf_shape(layout, shape), out_dtype) for hf, _, _, layout, shape in group], fetch)
        weight_map.update({hf: fname for hf, *_ in group})
    if n > 1:
        _write_json(os.path.join(path, "model.safetensors.index.json"),
                    {"metadata": {"total_size": total}, "weight_map": weight_map})
    dtype_name = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[out_dtype.name]
    _write_json(os.path.join(path, "config.json"), cfg.to_hf(dtype_name))
    _write_json(os.path.join(path, "generation_config.json"),
                {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id})
    return names


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2)
    os.replace(tmp, path)
