"""The shared training config. `configs/*.py` start from `base_config()` and override.

Every field can be overridden on the command line: `--config.rl.beta=0.0`. Fields that
may be None are placeholders so that overrides still type-check.
"""

from __future__ import annotations

import dataclasses
import os

from ml_collections import ConfigDict, config_dict

from sem_jax.data.questions import DEMO_DIR
from sem_jax.sem.reward import RewardParams


def base_config() -> ConfigDict:
    c = ConfigDict()
    c.seed = 0
    c.run_dir = "runs/demo"  # checkpoints, TensorBoard events, metrics.jsonl, config.json

    c.model = ConfigDict()
    c.model.path = config_dict.placeholder(str)        # local HF Qwen2 directory; None: random init (below)
    c.model.tokenizer = config_dict.placeholder(str)   # tokenizer directory (default: model.path)
    c.model.preset = config_dict.placeholder(str)      # architecture name (sem_jax.model.presets) for
                                                        # compile-only checks without weights
    c.model.dtype = "float32"                           # parameter dtype
    c.model.compute_dtype = "float32"                   # activation dtype
    c.model.remat = "none"                              # none | full | dots | dots_no_batch
    # Random-init model when model.path is None (CPU demo): a small BPE is trained on the data.
    c.model.init = ConfigDict(dict(tokenizer_vocab=512, hidden_size=64, intermediate_size=128,
                                   num_layers=2, num_heads=4, num_kv_heads=2, rope_theta=1e6,
                                   tie_word_embeddings=True))

    c.mesh = ConfigDict(dict(data=1, fsdp=-1, tensor=1))  # -1: all remaining devices

    c.distributed = ConfigDict()
    c.distributed.mode = "auto"          # auto: initialise on TPU pods or with a coordinator; on | off
    c.distributed.coordinator_address = config_dict.placeholder(str)  # host:port (GPU/CPU clusters)
    c.distributed.num_processes = config_dict.placeholder(int)
    c.distributed.process_id = config_dict.placeholder(int)
    c.distributed.cpu_collectives = config_dict.placeholder(str)  # "gloo" for multi-process CPU runs

    c.data = ConfigDict()
    c.data.train_file = os.path.join(DEMO_DIR, "train.jsonl")
    c.data.eval_file = os.path.join(DEMO_DIR, "eval.jsonl")
    c.data.prompts_per_step = 4          # questions per GRPO step (x group_size trajectories)
    c.data.eval_questions = 100          # held-out questions per evaluation (greedy)
    c.data.max_prompt_tokens = 256       # prompt length the AOT check sizes for

    c.retrieval = ConfigDict()
    c.retrieval.index_dir = config_dict.placeholder(str)  # built by scripts/build_index.py
    c.retrieval.corpus = os.path.join(DEMO_DIR, "corpus.jsonl")  # indexed in memory when no index_dir
    c.retrieval.top_k = 3                # passages per search
    c.retrieval.max_tokens_per_passage = 64

    c.rollout = ConfigDict()
    c.rollout.group_size = 5             # G: trajectories per question
    c.rollout.max_searches = 2           # answered searches per trajectory
    c.rollout.max_new_tokens = 128       # response budget: sampled + inserted tokens
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0

    c.reward = "sem"                     # sem | research
    c.reward_params = ConfigDict(dataclasses.asdict(RewardParams()))

    c.rl = ConfigDict()
    c.rl.beta = 0.001                    # KL to the frozen reference (k3); 0 skips the reference pass
    c.rl.clip_eps = 0.2
    c.rl.clip_eps_high = config_dict.placeholder(float)  # None: symmetric clipping
    c.rl.loss_agg = "seq_mean_token_mean"  # | token_mean | dr_grpo
    c.rl.adv_eps = 1e-6
    c.rl.scale_adv_by_std = True         # False: Dr. GRPO advantages (mean removed only)
    c.rl.micro_batch = 4                 # rows per gradient micro-batch
    c.rl.logprob_chunk = 128             # sequence chunk for the LM head in log-prob passes

    c.optim = ConfigDict(dict(lr=1e-6, weight_decay=0.01, b1=0.9, b2=0.999, eps=1e-8, grad_clip=1.0,
                              warmup_steps=0, schedule="constant"))

    c.train = ConfigDict()
    c.train.total_steps = 10
    c.train.log_every = 1
    c.train.eval_every = 0               # 0: evaluate only at the end
    c.train.ckpt_every = 5
    c.train.keep_checkpoints = 3
    c.train.debug_kill_at_step = config_dict.placeholder(int)  # crash tests: SIGKILL after this step's checkpoint

    c.peak_flops = config_dict.placeholder(float)  # per-device peak FLOP/s, for MFU (None: not reported)
    return c


def demo_config() -> ConfigDict:
    """The embedded CPU default: tiny random model, demo questions and corpus, no downloads."""
    c = base_config()
    c.optim.lr = 1e-3
    c.rl.beta = 0.0
    c.rollout.group_size = 4
    c.train.total_steps = 6
    c.train.ckpt_every = 3
    return c


def paper_recipe(c: ConfigDict) -> ConfigDict:
    """Settings shared by the accelerator configs, after ReSearch/SEM: G = 5, top-5 passages,
    lr 1e-6, KL 0.001 (k3), clip 0.2, and a 1024-token response budget."""
    c.retrieval.top_k = 5
    c.retrieval.max_tokens_per_passage = 128
    c.rollout.group_size = 5
    c.rollout.max_new_tokens = 1024
    c.rl.beta = 0.001
    c.rl.clip_eps = 0.2
    c.rl.logprob_chunk = 256
    c.optim.lr = 1e-6
    c.model.dtype = "float32"            # master weights
    c.model.compute_dtype = "bfloat16"
    return c
