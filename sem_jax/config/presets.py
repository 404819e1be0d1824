"""The config files' starting points: `configs/*.py` start from `base_config()` (every field at
its default, from `schema`) or one of the configs below, and override."""

from __future__ import annotations

from ml_collections import ConfigDict

from sem_jax.config.schema import Config, WarmStart, World, to_config_dict


def base_config() -> ConfigDict:
    """Every field at its default (`schema`, which owns them): what `configs/*.py` start from."""
    return to_config_dict()


def cpu_config() -> ConfigDict:
    """The embedded CPU default of `sem_jax.train`: a tiny random-init Qwen2 on the bundled
    questions, no downloads. Its sizes and RL settings are the demo's (`sem_jax.demo`), which
    runs this training on its own world from its warm start."""
    c = base_config()
    # The tiny model reads every prompt token on every pass: a short instruction, same protocol.
    c.system_prompt = "Answer first. Search only if unsure."
    # Untied output embeddings (as Qwen2.5-7B) learnt the demo's known facts and copying where tied
    # ones were slow and unreliable; RoPE theta 1e4 suits its short contexts.
    c.model.init.update(tokenizer_vocab=1024, hidden_size=128, intermediate_size=384, num_layers=4,
                        num_heads=4, num_kv_heads=2, tie_word_embeddings=False, rope_theta=1e4)
    c.retrieval.top_k = 1               # one passage per search: short contexts for a tiny model
    c.retrieval.max_tokens_per_passage = 48
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 192
    c.rollout.temperature = 0.7          # at T = 1 the tiny model samples its known answers wrong too often
    c.data.prompts_per_step = 8
    c.rl.beta = 0.0
    c.rl.micro_batch = 32
    c.optim.lr = 1e-4                    # higher rates broke the answer format within ~10 steps
    c.optim.schedule = "cosine"          # decays to 0 at the last step: held-out answers stay put once
                                         # the search decision is learnt
    c.optim.warmup_steps = 10            # Adam's first steps move every weight by about the full rate:
                                         # without a warmup the demo's policy stopped all searching
                                         # (known and unknown) within 5 steps
    c.train.total_steps = 100
    c.train.ckpt_every = 20
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
    c.model.eval_dtype = "bfloat16"      # evaluation needs no master weights: half the memory
    return c


DEMO_SECTIONS = ("world", "warm_start")


def demo_config() -> ConfigDict:
    """`make demo`: a synthetic world, a tiny Qwen2 warm-started on it, then GRPO with the SEM
    reward. No downloads; 10 to 20 minutes on 2 cores."""
    c = cpu_config()
    c.world = to_config_dict(World())
    # Supervised warm start of the random-init policy on the world's templated traces, saved as an
    # HF directory in run_dir/warm_start (which the training then loads as model.path).
    c.warm_start = to_config_dict(WarmStart())
    return c


def training_config(demo: Config) -> Config:
    """The ordinary training config inside a demo config: without the demo's sections."""
    return demo.replace(**{name: None for name in DEMO_SECTIONS})
