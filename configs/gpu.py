"""One NVIDIA GPU through jax[cuda]: Qwen2.5-1.5B-Instruct (fits an 80 GB card with f32
master weights, AdamW state and bf16 activations). Set the paths before running:

    python -m sem_jax.train --config configs/gpu.py \
        --config.model.path=/models/Qwen2.5-1.5B-Instruct --config.retrieval.index_dir=/data/index
"""

from sem_jax.config import base_config


def get_config():
    c = base_config()
    c.run_dir = "runs/gpu"
    c.model.path = "/models/Qwen2.5-1.5B-Instruct"  # local HF directory (no hub downloads)
    c.model.dtype = "float32"            # master weights
    c.model.compute_dtype = "bfloat16"
    c.model.remat = "dots"
    c.mesh.update(data=1, fsdp=-1, tensor=1)
    c.data.train_file = "/data/sem_train.jsonl"  # prepared by scripts/prepare_data.py (data issue)
    c.data.eval_file = "/data/sem_eval.jsonl"
    c.data.prompts_per_step = 16
    c.retrieval.index_dir = "/data/index"  # scripts/build_index.py
    c.retrieval.top_k = 5
    c.retrieval.max_tokens_per_passage = 128
    c.rollout.group_size = 5
    c.rollout.max_new_tokens = 1024
    c.rl.beta = 0.001
    c.rl.micro_batch = 8
    c.rl.logprob_chunk = 256
    c.optim.lr = 1e-6
    c.train.total_steps = 500
    c.train.eval_every = 50
    c.train.ckpt_every = 50
    c.peak_flops = 989e12  # dense bf16, H100/H200 SXM
    return c
