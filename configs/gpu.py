"""One NVIDIA GPU through jax[cuda]: Qwen2.5-1.5B-Instruct (default) or Qwen3-1.7B
(`configs/gpu.py:qwen3-1.7b`), each fitting an 80 GB card with f32 master weights, AdamW state and
bf16 activations. Set the paths before running:

    python -m sem_jax.train --config configs/gpu.py \
        --config.model.path=/models/Qwen2.5-1.5B-Instruct --config.retrieval.index_dir=/data/index
    python -m sem_jax.train --config configs/gpu.py:qwen3-1.7b --config.model.path=/models/Qwen3-1.7B
"""

from sem_jax.config import base_config, paper_recipe


# model -> (local HF directory: no hub downloads, micro-batch, prompts per step). From `python -m
# sem_jax.aot --config configs/gpu.py[:MODEL] --hbm_gib 80` (compiled for the CPU backend, so an
# estimate) for 1024 sampled + 1504 inserted response tokens, remat dots:
# - qwen2.5-1.5b: update peak 73.3 GiB at micro-batch 2, 116.0 at 4, 52.3 at 1;
# - qwen3-1.7b: its KV cache is 4x the 1.5B's (8 KV heads against 2): at 16 prompts x 5 rows the
#   decode loop peaked at 103.4 GiB and the update at 85.1 (micro-batch 2); at 8 prompts and
#   micro-batch 1 the insert peaks at 73.4, the update at 59.9.
MODELS = {"qwen2.5-1.5b": ("/models/Qwen2.5-1.5B-Instruct", 2, 16),
          "qwen3-1.7b": ("/models/Qwen3-1.7B", 1, 8)}


def get_config(model: str = "qwen2.5-1.5b"):
    if model not in MODELS:
        raise ValueError(f"configs/gpu.py:{model}: choose one of {sorted(MODELS)}")
    c = paper_recipe(base_config())
    c.run_dir = "runs/gpu" if model == "qwen2.5-1.5b" else f"runs/gpu-{model}"
    c.model.path, c.rl.micro_batch, c.data.prompts_per_step = MODELS[model]
    c.model.preset = model
    c.model.remat = "dots"
    c.mesh.update(data=1, fsdp=-1, tensor=1)
    c.data.train_file = "/data/sem_train.jsonl"  # written by scripts/prepare_data.py
    c.data.eval_file = "/data/sem_eval.jsonl"
    c.retrieval.index_dir = "/data/index"  # scripts/build_index.py
    c.train.total_steps = 500
    c.train.eval_every = 50
    c.train.ckpt_every = 50
    c.peak_flops = 989e12  # dense bf16, H100/H200 SXM
    return c
