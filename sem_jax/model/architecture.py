"""Qwen2 / Qwen2.5 / Qwen3 architecture hyper-parameters, read from and written to HF `config.json`.

The families differ in the attention inputs only: Qwen2 projects q, k and v with biases; Qwen3
has none and RMS-normalises each head of q and k (over `head_dim`) before the rotary embedding.
`model_type` ("qwen2" or "qwen3", as HF spells it) is the one switch; `attention_bias` and
`qk_norm` say what it means for the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# HF model_type -> architecture class.
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES.values())


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None  # hidden_size // num_heads when None
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    bos_token_id: int | None = 151643
    eos_token_id: int | list[int] | None = 151645
    model_type: str = "qwen2"

    def __post_init__(self):
        if self.model_type not in ARCHITECTURES:
            raise ValueError(f"model_type {self.model_type!r}; choose one of {sorted(ARCHITECTURES)}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]

    @property
    def attention_bias(self) -> bool:
        """Whether q, k and v are projected with biases (Qwen2)."""
        return self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """Whether each head of q and k is RMS-normalised before the rotary embedding (Qwen3)."""
        return self.model_type == "qwen3"

    @property
    def matmul_params(self) -> int:
        """Weights that take part in matmuls per token (for FLOP counts): layers and LM head."""
        e, d, h, k, i = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, self.intermediate_size
        return self.num_layers * (e * d * (2 * h + 2 * k) + 3 * e * i) + self.vocab_size * e

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> "Qwen2Config":
        """Build from a Hugging Face Qwen2 or Qwen3 `config.json` dict; unsupported variants raise."""
        model_type = hf.get("model_type", "qwen2")
        archs = hf.get("architectures") or [ARCHITECTURES.get(model_type, "?")]
        if model_type not in ARCHITECTURES or ARCHITECTURES[model_type] not in archs:
            raise ValueError(f"{source}: unsupported architecture {archs} (model_type "
                             f"{hf.get('model_type')!r}); sem_jax supports {SUPPORTED_ARCHITECTURES}")
        if hf.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not supported")
        if model_type == "qwen3" and hf.get("attention_bias"):
            # No released Qwen3 has them; it would add an output-projection bias too.
            raise ValueError(f"{source}: attention_bias=true is not supported for Qwen3")
        # Current transformers writes `rope_parameters`; older configs `rope_theta`/`rope_scaling`.
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ValueError(f"{source}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf]
        if missing:
            raise ValueError(f"{source}: missing field(s) {missing}")
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"), rope_theta=float(theta),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"), model_type=model_type)

    def to_hf(self, dtype: str = "bfloat16") -> dict[str, Any]:
        extra = {"attention_bias": False} if self.model_type == "qwen3" else {}
        return {
            "architectures": [self.architecture], "model_type": self.model_type, **extra,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            # Both spellings so that old and new transformers read the same theta.
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings, "use_sliding_window": False,
            "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "torch_dtype": dtype, "dtype": dtype,
        }
