"""`make demo`: the embedded CPU demo (SEM learning *when* to search).

Not built yet: it lands with the demo issue. Until then this says so and shows
that the model stack imports and runs.
"""

import sys


def main() -> int:
    import jax.numpy as jnp
    from flax import nnx

    from sem_jax.model import Qwen2, Qwen2Config

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2)
    logits = Qwen2(cfg, rngs=nnx.Rngs(0))(jnp.zeros((1, 4), jnp.int32))
    print(f"sem_jax model stack OK (tiny Qwen2 forward: logits {tuple(logits.shape)}).")
    print("The CPU demo (synthetic world, warm start, GRPO with the SEM reward) is not built yet.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
