"""Qwen2.5-7B-Instruct (default), -14B-Instruct, Qwen3-8B or Qwen3-14B on a Cloud TPU v4 pod, FSDP
over every chip. Paths are placeholders: /mnt/sem_jax is a bucket every worker mounts (`tpu/pod.sh
mount`), /mnt/disks a worker's own disk (model weights, the index).

    python -m sem_jax.train --config configs/tpu_v4.py             # Qwen2.5-7B-Instruct
    python -m sem_jax.train --config configs/tpu_v4.py:14b         # Qwen2.5-14B-Instruct
    python -m sem_jax.train --config configs/tpu_v4.py:qwen3-8b    # Qwen3-8B
    python -m sem_jax.train --config configs/tpu_v4.py:qwen3-14b   # Qwen3-14B
"""

from sem_jax.config import base_config, paper_recipe

# size -> (model directory, preset, micro-batch). Micro-batches checked with sem_jax.aot (tpu/README.md)
# for 1024 sampled + 1504 inserted response tokens:
# - Qwen2.5-7B on v4:2x2x4: the update peaks at 15.3 of 16 GiB with 16 rows (one per chip), its
#   rollout's insert at 15.2 beside the trainer's state;
# - Qwen2.5-14B on v4:4x4x4: 12.4 with 64 rows (one per chip), the insert 9.3 (with 2 rows: 7.35);
# - Qwen3-8B on v4:2x4x4 (its KV cache, 2.6x the 7B's, does not fit 16 chips): 9.1 with 32 rows (one per
#   chip), the insert 10.3;
# - Qwen3-14B on v4:4x4x4: 12.0 with 64 rows (one per chip), the insert 8.4. With 2 rows (7.5 GiB) the
#   roofline put the update at 6% MFU, 160 calls a step each reading the weights again.
MODELS = {"7b": ("/mnt/disks/models/Qwen2.5-7B-Instruct", "qwen2.5-7b", 16),
          "14b": ("/mnt/disks/models/Qwen2.5-14B-Instruct", "qwen2.5-14b", 64),
          "qwen3-8b": ("/mnt/disks/models/Qwen3-8B", "qwen3-8b", 32),
          "qwen3-14b": ("/mnt/disks/models/Qwen3-14B", "qwen3-14b", 64)}


def get_config(size: str = "7b"):
    if size not in MODELS:
        raise ValueError(f"configs/tpu_v4.py:{size}: choose one of {sorted(MODELS)}")
    c = paper_recipe(base_config())
    c.run_dir = f"/mnt/sem_jax/runs/sem-{size}"  # shared by every host: a bucket mounted by tpu/pod.sh mount
    c.model.path, c.model.preset, c.rl.micro_batch = MODELS[size]
    c.model.remat = "full"
    c.mesh.update(data=1, fsdp=-1, tensor=1)  # training: FSDP over every chip
    # Sampling: tensor-parallel groups of one host's 4 chips (Qwen2.5-7B has 4 KV heads, the others 8:
    # a group of 8 would span two hosts), each holding the bf16 attention weights whole between its chips; the
    # MLP's weights and the LM head split over every chip (each decode step gathers its rows instead).
    c.rollout.tensor = 4
    c.rollout.spread = True
    c.data.train_file = "/mnt/sem_jax/data/sem_train.jsonl"
    c.data.eval_file = "/mnt/sem_jax/data/sem_eval.jsonl"
    c.data.prompts_per_step = 64
    c.retrieval.index_dir = "/mnt/disks/index"  # every host holds a copy (retrieval runs per host)
    c.train.total_steps = 300
    c.train.eval_every = 25
    c.train.ckpt_every = 25
    c.peak_flops = 275e12  # TPU v4 bf16 per chip
    return c
