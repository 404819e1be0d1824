"""The one place a config becomes runtime objects; train, evaluate and aot all build here.

`settings(config)` turns the config's fields into the runtime dataclasses (sampling, rollout,
GRPO, optimizer, reward); nothing else reads those fields, so there is no second set of
defaults. The `build_*` functions make the objects that hold arrays or files (mesh, policy,
retriever, samplers, trainer), and `build_run` puts a training run's together.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from ml_collections import ConfigDict

from sem_jax.data.example import Example
from sem_jax.data.mix import process_share
from sem_jax.data.questions import load_questions
from sem_jax.errors import Refused
from sem_jax.hosts import CallLog, batch_shards, local_batch_multiple
from sem_jax.model import Qwen2, Qwen2Config, from_pretrained
from sem_jax.model.tokenizer import load_tokenizer, train_bpe_tokenizer
from sem_jax.protocol import Protocol, get_protocol
from sem_jax.rl.loss import GRPOConfig
from sem_jax.rl.trainer import GRPOTrainer, OptimConfig
from sem_jax.sampling import RolloutConfig, Sampler, SamplingConfig, build_stop_automaton
from sem_jax.sem.reward import RewardParams, check_sem_params, get_reward
from sem_jax.sharding import make_mesh, tensor_groups


# -- the config's fields as runtime dataclasses ---------------------------------------------

# Inserted tokens are bounded per search, so that buffers are sized from the config alone:
PASSAGE_EXTRA_TOKENS = 16   # per passage beyond its text's budget: its title, cut (chat.TITLE_TOKENS)
                            # where a block is over budget, and marks ("(i) ", ": ", " ...", newline)
BLOCK_EXTRA_TOKENS = 16     # per result block beyond its passages: the tags
NOTE_TOKENS = 32            # the search-limit note


def inserted_tokens(config: ConfigDict) -> tuple[int, int]:
    """(one search's block at most, all inserted tokens of a response at most): max_searches
    blocks of top_k passages, and the limit note once."""
    r = config.retrieval
    block = r.top_k * (r.max_tokens_per_passage + PASSAGE_EXTRA_TOKENS) + BLOCK_EXTRA_TOKENS
    return block, config.rollout.max_searches * block + NOTE_TOKENS


@dataclasses.dataclass(frozen=True)
class Settings:
    protocol: Protocol
    system_prompt: str              # config.system_prompt, or the protocol's
    sampling: SamplingConfig        # training rollouts (eos ids added once the tokenizer is known)
    rollout: RolloutConfig
    grpo: GRPOConfig
    optim: OptimConfig
    reward: Callable                # (parsed, example, params) -> (reward, case)
    reward_params: RewardParams

    @property
    def greedy(self) -> SamplingConfig:
        """Evaluation: the same budget, greedy."""
        return SamplingConfig(max_new_tokens=self.sampling.max_new_tokens, greedy=True,
                              eos_ids=self.sampling.eos_ids, max_inserted_tokens=self.sampling.max_inserted_tokens)

    def with_eos(self, tokenizer) -> "Settings":
        return dataclasses.replace(self, sampling=dataclasses.replace(self.sampling, eos_ids=stop_ids(tokenizer)))


# Fields that must be positive (counts and sizes) or not negative, checked before anything is built.
POSITIVE = ("rollout.group_size", "rollout.max_new_tokens", "rl.micro_batch", "rl.logprob_chunk",
            "data.prompts_per_step", "data.eval_questions", "data.max_prompt_tokens", "retrieval.top_k",
            "retrieval.max_tokens_per_passage", "train.log_every", "train.ckpt_every", "train.keep_checkpoints",
            "sft.traces", "sft.steps", "sft.rows")
NOT_NEGATIVE = ("rollout.max_searches", "rollout.temperature", "rollout.window_steps", "train.total_steps",
                "train.eval_every", "optim.lr", "optim.weight_decay", "optim.warmup_steps", "optim.grad_clip",
                "rl.beta", "rl.clip_eps", "sft.lr", "sft.width", "sft.micro_batch", "sft.grad_clip", "retrieval.threads")


# Fields with both bounds: (low, high, "[" or "(" for a closed or open low end, "]" or ")" likewise),
# and why where it is not plain.
RANGES = {
    "reward_params.tau": (0.0, 1.0, "(", "]", "F1 at or above it counts as correct: 0 takes every answer, "
                                              "over 1 none"),
    "optim.b1": (0.0, 1.0, "[", ")", "Adam's decay"),
    "optim.b2": (0.0, 1.0, "[", ")", "Adam's decay"),
    "optim.lr": (0.0, 1.0, "[", "]", ""),
    "sft.lr": (0.0, 1.0, "[", "]", ""),
    "optim.weight_decay": (0.0, 1.0, "[", "]", ""),
    "sft.weight_decay": (0.0, 1.0, "[", "]", ""),
    "rl.clip_eps": (0.0, 1.0, "[", "]", "a ratio's distance from 1"),
    "rl.clip_eps_high": (0.0, 10.0, "[", "]", "a ratio's distance from 1"),
    "rollout.top_p": (0.0, 1.0, "(", "]", ""),
    "rollout.top_k": (0, 1 << 30, "[", "]", "0: all tokens"),
    "rollout.group_size": (2, 1 << 30, "[", "]", "GRPO's advantages compare a question's trajectories: with "
                                                 "one, every group ties and no step learns"),
    "sft.search_share": (0.0, 1.0, "[", "]", ""),
    "train.min_start_valid": (0.0, 1.0, "[", "]", ""),
    "rl.adv_eps": (0.0, 1.0, "(", "]", ""),
    "optim.eps": (0.0, 1.0, "(", "]", ""),
}


def _numbers(config: ConfigDict, prefix: str = "") -> list[tuple[str, float]]:
    out = []
    for k, v in config.items():
        if isinstance(v, ConfigDict):
            out += _numbers(v, f"{prefix}{k}.")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append((f"{prefix}{k}", v))
    return out


def check_fields(config: ConfigDict) -> None:
    """Refuse, naming the field: a number that is not finite, a count or size that is not
    positive, a rate that is negative, a value outside its range (`RANGES`)."""
    for name, value in _numbers(config):
        if not math.isfinite(value):
            raise ValueError(f"config.{name}={value!r}: must be a finite number")

    def get(name):
        value = config
        for part in name.split("."):
            value = value[part]
        return value
    for names, ok, what in ((POSITIVE, lambda v: v > 0, "> 0"), (NOT_NEGATIVE, lambda v: v >= 0, ">= 0")):
        for name in names:
            if not ok(get(name)):
                raise ValueError(f"config.{name}={get(name)!r}: must be {what}")
    for name, (low, high, lo_end, hi_end, why) in RANGES.items():
        value = get(name)
        if value is None:  # optional (rl.clip_eps_high): unset is allowed
            continue
        above = value > low if lo_end == "(" else value >= low
        below = value < high if hi_end == ")" else value <= high
        if not (above and below):
            where = f">= {low}" if high == 1 << 30 else f"in {lo_end}{low}, {high}{hi_end}"
            raise ValueError(f"config.{name}={value!r}: must be {where}" + (f" ({why})" if why else ""))


def settings(config: ConfigDict) -> Settings:
    """Every runtime dataclass of `config`, checked: counts, sizes and rates in range, unknown
    protocol or reward names, a reward that cannot read the protocol's responses, SEM constants
    under which a search is free."""
    check_fields(config)
    r = config.rollout
    protocol = get_protocol(config.protocol)
    reward = config.reward or protocol.reward
    get_reward(reward)
    if reward == "sem" and protocol.name != "sem":
        raise ValueError(f"reward='sem' reads SEM's first and final answers; protocol={protocol.name!r} gives one "
                         "answer (leave reward unset for the protocol's own)")
    reward_params = RewardParams(**config.reward_params.to_dict())
    if reward == "sem":
        check_sem_params(reward_params)
    block, inserted = inserted_tokens(config)
    system_prompt = config.system_prompt or protocol.system_prompt
    if config.prompt_example:
        system_prompt += protocol.example
    return Settings(
        protocol=protocol,
        system_prompt=system_prompt,
        sampling=SamplingConfig(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                top_k=r.top_k, max_inserted_tokens=inserted),
        rollout=RolloutConfig(group_size=r.group_size, max_searches=r.max_searches, top_k=config.retrieval.top_k,
                              max_tokens_per_passage=config.retrieval.max_tokens_per_passage,
                              max_block_tokens=block, max_note_tokens=NOTE_TOKENS),
        grpo=GRPOConfig(beta=config.rl.beta, clip_eps=config.rl.clip_eps, clip_eps_high=config.rl.clip_eps_high,
                        loss_agg=config.rl.loss_agg, dr_grpo_length=r.max_new_tokens),
        optim=OptimConfig(total_steps=config.train.total_steps, **config.optim.to_dict()),
        reward=get_reward(reward),
        reward_params=reward_params,
    )


def stop_ids(tokenizer) -> tuple[int, ...]:
    """The ids that end a response, for training and evaluation alike: the tokenizer's eos
    (`<|im_end|>` for Qwen2.5 instruct) and `<|endoftext|>` where the vocabulary has it."""
    ids = (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    return tuple(sorted({i for i in ids if isinstance(i, int) and i >= 0}))


def micro_batch(config: ConfigDict, processes: int = 1) -> int:
    """Rows per gradient micro-batch: `rl.micro_batch`, at most one step's rows."""
    micro = min(config.rl.micro_batch, config.data.prompts_per_step * config.rollout.group_size)
    if micro % processes:
        raise ValueError(f"rl.micro_batch={micro} must divide by the {processes} processes")
    return micro


# -- objects -----------------------------------------------------------------------------

def build_mesh(config: ConfigDict, devices: Sequence | None = None) -> Mesh:
    return make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor, devices=devices)


def build_rollout_mesh(config: ConfigDict, mesh: Mesh) -> Mesh:
    """The sampler's mesh: `mesh` itself (rollout.tensor = 0) or its devices in tensor-parallel
    groups of rollout.tensor (`sharding.tensor_groups`; rollout.spread: the MLP and LM head over all of them)."""
    if config.rollout.spread and not config.rollout.tensor:
        raise ValueError("rollout.spread splits the MLP and LM head over rollout.tensor's groups: set rollout.tensor too")
    return tensor_groups(mesh, config.rollout.tensor, config.rollout.spread) if config.rollout.tensor else mesh


def init_model_config(config: ConfigDict, tokenizer) -> Qwen2Config:
    """The random-init architecture of `config.model.init` (vocabulary padded to 64)."""
    i = config.model.init
    return Qwen2Config(vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=i.hidden_size,
                       intermediate_size=i.intermediate_size, num_layers=i.num_layers, num_heads=i.num_heads,
                       num_kv_heads=i.num_kv_heads, rope_theta=i.rope_theta,
                       tie_word_embeddings=i.tie_word_embeddings, bos_token_id=None,
                       eos_token_id=tokenizer.eos_token_id)


def build_policy(config: ConfigDict, texts: Callable[[], list[str]] | None, run_dir: str,
                 mesh: Mesh | None = None, resuming: bool = False) -> tuple[Qwen2, Any]:
    """The policy and its tokenizer: a local HF directory (weights streamed straight into their
    shardings on `mesh`), or (no path) a random tiny model with a small BPE trained on
    `texts()` (saved to run_dir/tokenizer, reused on resume; `resuming` without it is refused:
    a BPE trained again need not give the checkpoint's token ids)."""
    m = config.model
    dtype, compute = jnp.dtype(m.dtype), jnp.dtype(m.compute_dtype)
    if m.path:
        tokenizer = load_tokenizer(m.tokenizer or m.path)
        model = from_pretrained(m.path, dtype=dtype, compute_dtype=compute, remat=m.remat, mesh=mesh,
                                kernels=m.kernels)
        return model, tokenizer
    tok_dir = os.path.join(run_dir, "tokenizer")
    if os.path.exists(os.path.join(tok_dir, "tokenizer.json")):  # resumed run: the same tokenizer
        tokenizer = load_tokenizer(tok_dir)
    else:
        if texts is None:
            raise FileNotFoundError(f"{tok_dir}: no tokenizer.json (was this run trained with model.path unset?)")
        if resuming:
            raise Refused(f"{tok_dir}: no tokenizer.json, but {run_dir}/ckpt holds checkpoints of a random-init "
                          "model whose tokenizer was trained with the run; one trained again need not give the "
                          "same token ids. Put the run's tokenizer back there, or train in a new run_dir")
        tokenizer = train_bpe_tokenizer(texts(), m.init.tokenizer_vocab)
        if jax.process_index() == 0:
            tokenizer.save_pretrained(tok_dir)
    model = Qwen2(init_model_config(config, tokenizer), rngs=nnx.Rngs(config.seed), param_dtype=dtype,
                  dtype=compute, remat=m.remat, cache_kernel=m.kernels, attention_kernel=m.kernels,
                  decode_kernel=m.kernels)
    return model, tokenizer


def build_retriever(config: ConfigDict):
    from sem_jax.retrieval import Retriever  # imports bm25s: only after the distributed runtime starts
    r = config.retrieval
    if r.index_dir:
        return Retriever.load(r.index_dir, threads=r.threads)
    return Retriever.from_jsonl(r.corpus, show_progress=False, threads=r.threads)


def build_sampler(model: Qwen2, tokenizer, sampling: SamplingConfig, config: ConfigDict, protocol: Protocol, *,
                  mesh: Mesh | None = None, calls: CallLog | None = None) -> Sampler:
    t, kv = config.rollout.tensor, model.config.num_kv_heads
    if t and kv % t:
        print(f"WARNING: rollout.tensor={t} does not divide the model's {kv} KV heads: each tensor-parallel "
              f"group holds every row's whole KV cache on each of its {t} devices", flush=True)
    m = model.config.intermediate_size
    if mesh is not None and config.rollout.spread and m % mesh.size:
        print(f"WARNING: rollout.spread: the model's {m} MLP columns do not divide over the {mesh.size} devices: "
              f"split over the largest run of the sampler's mesh axes that divides them (sharding.logical_to_spec)",
              flush=True)
    stop = build_stop_automaton(tokenizer, protocol.stop_strings, vocab_size=model.config.vocab_size)
    return Sampler(model, stop, sampling, mesh=mesh, calls=calls, window_steps=config.rollout.window_steps,
                   max_prompt_tokens=config.data.max_prompt_tokens)


def check_positions(config: ConfigDict, s: Settings, model_config: Qwen2Config) -> None:
    """The longest sequence a rollout can build must fit the model's positions (RoPE beyond them
    is untrained): refused at start, with the sum."""
    longest = config.data.max_prompt_tokens + s.sampling.max_new_tokens + s.sampling.max_inserted_tokens
    if longest > model_config.max_position_embeddings:
        raise ValueError(f"data.max_prompt_tokens={config.data.max_prompt_tokens} + rollout.max_new_tokens="
                         f"{s.sampling.max_new_tokens} + {s.sampling.max_inserted_tokens} inserted tokens (retrieval, "
                         f"rollout.max_searches) = {longest} is over the model's max_position_embeddings="
                         f"{model_config.max_position_embeddings}")


def cap_prompts(examples: Sequence[Example], protocol: Protocol, system_prompt: str, tokenizer, limit: int,
                where: str) -> list[Example]:
    """The examples whose prompt fits in `limit` tokens, in order; the others are counted by source
    and reported (the sampler refuses longer prompts: the fit check and the buckets assume the cap)."""
    keep, skipped = [], Counter()
    for e in examples:
        if len(protocol.encode_prompt(tokenizer, e, system_prompt)) <= limit:
            keep.append(e)
        else:
            skipped[e.source] += 1
    if skipped:
        by = ", ".join(f"{k} {v}" for k, v in sorted(skipped.items()))
        print(f"{where}: skipped {sum(skipped.values())} of {len(examples)} questions whose prompt is over "
              f"data.max_prompt_tokens={limit} ({by})", flush=True)
    return keep


def build_trainer(config: ConfigDict, model: Qwen2, s: Settings, mesh: Mesh, *, processes: int = 1,
                  per_layer: bool | None = None, unroll_head: int = 1) -> GRPOTrainer:
    return GRPOTrainer(model, s.grpo, s.optim, micro_batch=micro_batch(config, processes),
                       logprob_chunk=config.rl.logprob_chunk, per_layer=per_layer,
                       group_size=config.rollout.group_size, shards=batch_shards(mesh), unroll_head=unroll_head)


# -- a training run ------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    """Everything a training run holds besides its arrays (those live in `train.TrainState`)."""
    config: ConfigDict
    run_dir: str
    settings: Settings
    mesh: Mesh
    model: Qwen2
    tokenizer: Any
    retriever: Any
    sampler: Sampler                # training rollouts
    greedy: Sampler                 # evaluation
    trainer: GRPOTrainer
    calls: CallLog
    train_set: list[Example]
    eval_set: list[Example]         # this process's share of the held-out questions
    per_host: int                   # questions each process rolls out per step
    row_multiple: int               # each process's rows pad to a multiple of this
    pad_id: int


def build_run(config: ConfigDict, resuming: bool = False) -> Run:
    """The mesh, data, retriever, policy, samplers and trainer of a training run (`resuming`: its
    run_dir holds checkpoints, so nothing they depend on is built anew)."""
    pid, nproc = jax.process_index(), jax.process_count()
    # Each process rolls out its own share of every step's questions (hosts.py).
    if config.data.prompts_per_step % nproc:
        raise ValueError(f"data.prompts_per_step={config.data.prompts_per_step} must divide by the "
                         f"{nproc} processes")
    s = settings(config)
    run_dir = os.path.abspath(config.run_dir)
    mesh = build_mesh(config)
    rollout_mesh = build_rollout_mesh(config, mesh)
    train_set = load_questions(config.data.train_file)
    eval_all = load_questions(config.data.eval_file)
    retriever = build_retriever(config)
    # Text for a random-init model's BPE (only read when no model.path is given).
    texts = lambda: [s.system_prompt] + [e.question + " " + " ".join(e.answers)
                                              for e in train_set + eval_all[:config.data.eval_questions]] + \
        [f"{d['title']} {d['text']}" for d in retriever.passages()]
    model, tokenizer = build_policy(config, texts, run_dir, mesh, resuming=resuming)
    check_positions(config, s, model.config)
    s = s.with_eos(tokenizer)
    cap = lambda xs, where: cap_prompts(xs, s.protocol, s.system_prompt, tokenizer, config.data.max_prompt_tokens,
                                        where)
    train_set = cap(train_set, config.data.train_file)
    if not train_set:
        raise ValueError(f"{config.data.train_file}: no question's prompt fits data.max_prompt_tokens")
    eval_all = cap(eval_all, config.data.eval_file)[:config.data.eval_questions]
    eval_set = process_share(eval_all, pid, nproc)  # each process evaluates its share
    if not eval_set:
        raise ValueError(f"{nproc} processes need at least as many eval questions (data.eval_questions)")
    calls = CallLog(config.train.debug_hosts)
    trainer = build_trainer(config, model, s, mesh, processes=nproc)
    # Each process pads its rows so that the global batch splits into micro-batches and over the
    # batch shards, and its groups stay whole runs of the trainer's shared prompts.
    row_multiple = int(np.lcm.reduce([trainer.micro_batch // nproc, local_batch_multiple(mesh), trainer.share]))
    return Run(config=config, run_dir=run_dir, settings=s, mesh=mesh, model=model, tokenizer=tokenizer,
               retriever=retriever,
               sampler=build_sampler(model, tokenizer, s.sampling, config, s.protocol, mesh=rollout_mesh, calls=calls),
               greedy=build_sampler(model, tokenizer, s.greedy, config, s.protocol, mesh=rollout_mesh, calls=calls),
               trainer=trainer, calls=calls, train_set=train_set, eval_set=eval_set,
               per_host=config.data.prompts_per_step // nproc, row_multiple=row_multiple,
               pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
