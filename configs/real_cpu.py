"""The real Qwen2.5-Coder-0.5B-Instruct on the CPU, on the bundled questions: a check of the whole
stack on real weights (evaluation, GRPO steps, export), not a training recipe. Fetch it first:

    python scripts/fetch_real_model.py --out ~/.cache/sem_jax/qwen2.5-coder-0.5b-instruct
    python -m sem_jax.evaluate --config configs/real_cpu.py --hf ~/.cache/sem_jax/qwen2.5-coder-0.5b-instruct
    python -m sem_jax.train --config configs/real_cpu.py

or, with the format taught by supervised traces instead of shown in the prompt:

    python -m sem_jax.sft --config configs/real_cpu.py --config.prompt_example=False --out runs/real_sft
    python -m sem_jax.train --config configs/real_cpu.py --config.prompt_example=False \
        --config.model.path=runs/real_sft

The paper's recipe (prompt, reward, clip, lr) at a CPU's batch and budgets, in float32, without
the KL term's reference model (memory).
"""

import os

from sem_jax.config import base_config, paper_recipe

REAL_MODEL = os.path.expanduser(os.environ.get("SEM_JAX_REAL_MODEL", "~/.cache/sem_jax/qwen2.5-coder-0.5b-instruct"))


def get_config():
    c = paper_recipe(base_config())
    c.run_dir = "runs/real_cpu"
    c.model.path = REAL_MODEL
    c.model.compute_dtype = "float32"    # bf16 matmuls are slow on XLA:CPU
    c.model.eval_dtype = "float32"
    # Out of the box this model writes the SEM format in none of its answers (every group's rewards
    # then tie); with the worked example, 77% of them on 22 questions.
    c.prompt_example = True
    c.retrieval.top_k = 2
    c.retrieval.max_tokens_per_passage = 64
    c.rollout.group_size = 2
    c.rollout.max_new_tokens = 96
    c.data.prompts_per_step = 2
    c.data.eval_questions = 8
    # Memory (float32 weights, AdamW moments, gradients, activations without remat): the update
    # peaks at 16.1 GiB with one row per micro-batch, 20.1 with two (`python -m sem_jax.aot
    # --config configs/real_cpu.py --hbm_gib 24`); no frozen reference, another 2.5 GB copy.
    c.rl.micro_batch = 1
    c.rl.beta = 0.0
    # The warm start (sem_jax.sft): 30 steps of one packed 512-token row (about three traces each).
    c.sft.update(traces=200, steps=30, rows=1, width=512, lr=2e-5)
    c.train.total_steps = 2
    c.train.ckpt_every = 1
    return c
