"""The shared training config. `configs/*.py` start from `base_config()` and override.

Every field can be overridden on the command line: `--config.rl.beta=0.0`. Fields that
may be None are placeholders so that overrides still type-check. `sem_jax.assemble.settings`
turns these fields into the runtime dataclasses; this file holds their only defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.util
import os
import sys

from ml_collections import ConfigDict, config_dict

from sem_jax.data.questions import DEMO_DIR
from sem_jax.sem.reward import RewardParams


def base_config() -> ConfigDict:
    c = ConfigDict()
    c.seed = 0
    c.run_dir = "runs/demo"  # checkpoints, TensorBoard events, metrics.jsonl, config.json
    c.protocol = "sem"                   # sem | research: prompts, parser, result blocks and reward together
    c.system_prompt = config_dict.placeholder(str)  # None: the protocol's (sem_jax/protocol/)
    c.prompt_example = False             # append the protocol's worked example to the system prompt

    c.model = ConfigDict()
    c.model.path = config_dict.placeholder(str)        # local HF Qwen2 directory; None: random init (below)
    c.model.tokenizer = config_dict.placeholder(str)   # tokenizer directory (default: model.path)
    c.model.preset = config_dict.placeholder(str)      # architecture name (sem_jax.model.presets) for
                                                        # compile-only checks without weights
    c.model.dtype = "float32"                           # parameter dtype
    c.model.compute_dtype = "float32"                   # activation dtype
    c.model.eval_dtype = ""                             # parameter dtype of sem_jax.evaluate ("": model.dtype)
    c.model.remat = "none"                              # none | full | dots | dots_no_batch
    c.model.kernels = "auto"                            # Pallas kernels: auto (Pallas where they apply on
                                                        # TPU) | xla | pallas | interpret (Qwen2(cache_kernel=,
                                                        # attention_kernel=, decode_kernel=))
    # Random-init model when model.path is None: a small BPE is trained on the data.
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
    c.retrieval.threads = 0              # search threads per process (0: every core of the host)

    c.rollout = ConfigDict()
    c.rollout.group_size = 5             # G: trajectories per question
    c.rollout.max_searches = 2           # answered searches per trajectory
    c.rollout.max_new_tokens = 128       # sampled tokens per response; inserted results get room of their
                                         # own (sem_jax.assemble.inserted_tokens)
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0
    # Decode attention reads a window of the KV cache grown in steps of >= this many tokens,
    # not the whole response budget (each window size compiles once); 0: the whole cache.
    c.rollout.window_steps = 32
    # The sampler's layout. 0: the training mesh (FSDP: every decode step gathers each weight's
    # shards). T >= 1: the devices as data x T, each group of T devices holding the compute-dtype
    # weights whole, split over it by tensor parallelism (resharded once per step): each decode step
    # reads a 1/T share of the weights where it is. T must divide each process's devices.
    c.rollout.tensor = 0
    # With rollout.tensor: the MLP's weights (two thirds of a Qwen2.5's) and an untied LM head split
    # over every device, not one group's; each decode step gathers its rows over the groups for
    # them, a few MB sent in place of reading the weights (sharding.RULES).
    c.rollout.spread = False

    # None: the protocol's own reward. `research` on the sem protocol is ReSearch's reward on SEM's
    # format (the demo's baseline), not ReSearch as ReSearch runs (protocol=research).
    c.reward = config_dict.placeholder(str)
    c.reward_params = ConfigDict(dataclasses.asdict(RewardParams()))  # sem_jax.sem.reward.RewardParams

    c.rl = ConfigDict()
    c.rl.beta = 0.001                    # KL to the frozen reference (k3); 0 skips the reference pass
    c.rl.clip_eps = 0.2
    c.rl.clip_eps_high = config_dict.placeholder(float)  # None: symmetric clipping
    c.rl.loss_agg = "seq_mean_token_mean"  # | token_mean | dr_grpo
    c.rl.adv_eps = 1e-6
    c.rl.scale_adv_by_std = True         # False: Dr. GRPO advantages (mean removed only)
    c.rl.micro_batch = 4                 # rows per gradient micro-batch; when each batch shard's share
                                         # of it is a multiple of rollout.group_size (or shares a divisor
                                         # with it), a group's prompt runs once for its rows
    c.rl.logprob_chunk = 128             # sequence chunk for the LM head in log-prob passes

    c.optim = ConfigDict(dict(lr=1e-6, weight_decay=0.01, b1=0.9, b2=0.999, eps=1e-8, grad_clip=1.0,
                              warmup_steps=0, schedule="constant"))

    # The format warm start, `python -m sem_jax.sft` (sem_jax/traces.py): supervised traces of the
    # protocol from data.train_file, before GRPO.
    c.sft = ConfigDict()
    c.sft.traces = 256                   # traces built (questions reused in shuffled rounds)
    c.sft.search_share = 0.5             # of them searching (from needs_search questions); the rest direct
    c.sft.steps = 64
    c.sft.rows = 8                       # packed rows per step
    c.sft.width = 0                      # tokens per row; 0: the longest trace, bucketed, at least 256
    c.sft.micro_batch = 0                # rows per gradient micro-batch; 0: all
    c.sft.lr = 1e-5                      # AdamW, warmup over a tenth of the steps, cosine to 0
    c.sft.weight_decay = 0.0
    c.sft.grad_clip = 1.0
    c.sft.eval = True                    # score the held-out questions before and after

    c.train = ConfigDict()
    c.train.total_steps = 10
    c.train.log_every = 1
    c.train.eval_every = 0               # 0: evaluate only at the end
    c.train.eval_at_start = True         # evaluate the initial policy (step 0) before training
    c.train.min_start_valid = 0.25       # warn when fewer step-0 responses follow the protocol's format
    c.train.ckpt_every = 5
    c.train.keep_checkpoints = 3
    c.train.debug_hosts = False          # multi-process: check every step that all processes made the same device calls
    c.train.debug_kill_at_step = config_dict.placeholder(int)  # crash tests: SIGKILL after this step's checkpoint

    c.peak_flops = config_dict.placeholder(float)  # per-device peak FLOP/s, for MFU (None: not reported)
    return c


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


def eval_dtype(config: ConfigDict) -> str:
    """The parameter dtype of `sem_jax.evaluate`: `model.eval_dtype`, or `model.dtype` when unset."""
    return config.model.eval_dtype or config.model.dtype


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing (`app.run(main, flags_parser=parse_flags)`), with an unknown config
    field said in one line (`unknown_field`) instead of a traceback."""
    from absl import flags
    try:
        return flags.FLAGS(argv)
    except (flags.Error, AttributeError, KeyError) as e:
        message = unknown_field(argv)
        if message:
            sys.exit(message)
        if isinstance(e, flags.Error):
            sys.exit(f"FATAL Flags parsing error: {e}\nPass --helpshort or --helpfull to see help on flags.")
        raise


@contextlib.contextmanager
def one_line_config_errors(default_config: str | None = None):
    """Around `config_flags.DEFINE_config_file` with a default config, which applies the command
    line's overrides as it loads it: an unknown field then fails there."""
    try:
        yield
    except (AttributeError, KeyError):
        message = unknown_field(sys.argv, default_config)
        if message:
            sys.exit(message)
        raise


def unknown_field(argv: list[str], default_config: str | None = None) -> str | None:
    """"unknown config field 'rl.bta'; did you mean rl.beta?" for the first `--config.X` of `argv`
    that the config file (`--config`, else `default_config`) does not have; None if all exist."""
    path = default_config
    for i, arg in enumerate(argv[1:], start=1):
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
    if not path:
        return None
    file, _, arg = path.partition(":")
    try:
        spec = importlib.util.spec_from_file_location("_config_for_flags", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        config = module.get_config(arg) if arg else module.get_config()
    except Exception:  # noqa: BLE001 - the config's own error is shown by absl instead
        return None
    for arg in argv[1:]:
        name = arg.lstrip("-").split("=", 1)[0]
        if name.startswith("config.") and not _has(config, name[7:]):
            close = difflib.get_close_matches(name[7:], _paths(config), n=3, cutoff=0.5)
            return f"unknown config field {name[7:]!r}" + (f"; did you mean {', '.join(close)}?" if close else "")
    return None


def _has(config: ConfigDict, path: str) -> bool:
    node = config
    for part in path.split("."):
        if not isinstance(node, ConfigDict) or part not in node:
            return False
        node = node[part]
    return True


def _paths(config: ConfigDict, prefix: str = "") -> list[str]:
    out = []
    for k, v in config.items():
        out += _paths(v, f"{prefix}{k}.") if isinstance(v, ConfigDict) else [f"{prefix}{k}"]
    return out
