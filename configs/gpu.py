"""One NVIDIA GPU through jax[cuda]: Qwen2.5-1.5B-Instruct (fits an 80 GB card with f32
master weights, AdamW state and bf16 activations). Set the paths before running:

    python -m sem_jax.train --config configs/gpu.py \
        --config.model.path=/models/Qwen2.5-1.5B-Instruct --config.retrieval.index_dir=/data/index
"""

from sem_jax.config import base_config, paper_recipe


def get_config():
    c = paper_recipe(base_config())
    c.run_dir = "runs/gpu"
    c.model.path = "/models/Qwen2.5-1.5B-Instruct"  # local HF directory (no hub downloads)
    c.model.preset = "qwen2.5-1.5b"
    c.model.remat = "dots"
    c.mesh.update(data=1, fsdp=-1, tensor=1)
    c.data.train_file = "/data/sem_train.jsonl"  # written by scripts/prepare_data.py
    c.data.eval_file = "/data/sem_eval.jsonl"
    c.data.prompts_per_step = 16
    c.retrieval.index_dir = "/data/index"  # scripts/build_index.py
    # Estimate with `python -m sem_jax.aot --config configs/gpu.py --hbm_gib 80` (compiled for the CPU
    # backend, so an estimate) for 1024 sampled + 1504 inserted response tokens: update peak 73.3 GiB
    # at micro-batch 2 with remat dots, 116.0 at 4, 52.3 at 1.
    c.rl.micro_batch = 2
    c.train.total_steps = 500
    c.train.eval_every = 50
    c.train.ckpt_every = 50
    c.peak_flops = 989e12  # dense bf16, H100/H200 SXM
    return c
