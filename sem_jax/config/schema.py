"""The config as frozen, typed settings: every field's default, type and range, checked once.

The user's interface stays ml_collections: `configs/*.py` start from `sem_jax.config.base_config()`
(`to_config_dict` of the defaults below) and `--config.x=y` overrides it. `load(config)` turns that
ConfigDict into a `Config` once, refusing an unknown field, a value of the wrong type or out of
its range in one line naming the field, and a combination of fields that cannot work together
(checked beside the fields, in `__post_init__`); every module reads the typed `Config`, none a
ConfigDict. The sections build the runtime's objects they describe (`Config.sampling`,
`Config.engine`, `Config.grpo`, `Optim.build`, `Mesh.build`): there is no second layer.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import types
import typing
from typing import Any

from ml_collections import ConfigDict, config_dict

from sem_jax.data.questions import DEMO_DIR
from sem_jax.errors import Refused
from sem_jax.protocol import Protocol, get_protocol

if typing.TYPE_CHECKING:  # what the sections build is imported where it is built: a config loads without jax
    from sem_jax.rl.loss import GRPOConfig
    from sem_jax.rl.trainer import OptimConfig
    from sem_jax.sampling.rollout import RolloutConfig
    from sem_jax.sampling.sampler import SamplingConfig

BIG = 1 << 30  # an open upper end

# Inserted tokens are bounded per search, so that buffers are sized from the config alone:
PASSAGE_EXTRA_TOKENS = 16   # per passage beyond its text's budget: its title, cut (chat.TITLE_TOKENS)
                            # where a block is over budget, and marks ("(i) ", ": ", " ...", newline)
BLOCK_EXTRA_TOKENS = 16     # per result block beyond its passages: the tags
NOTE_TOKENS = 32            # the search-limit note


class ConfigError(Refused, ValueError):
    """A config field unknown, of the wrong type or out of its range: said in one line."""


def setting(default: Any, low: float | None = None, high: float | None = None, ends: str = "[]", why: str = "",
            choices: tuple | None = None) -> Any:
    """A field with its default and its check: a range [low, high] (`ends` "(" / ")" for open
    ends), or `choices`; `why` is said when a value is refused."""
    return dataclasses.field(default=default, metadata=dict(low=low, high=high, ends=ends, why=why, choices=choices))


def section(cls: type) -> Any:
    return dataclasses.field(default_factory=cls)


POSITIVE = dict(low=1, high=BIG)
COUNT = dict(low=0, high=BIG)
RATE = dict(low=0.0, high=BIG)
SHARE = dict(low=0.0, high=1.0)


@dataclasses.dataclass(frozen=True)
class ModelInit:
    """The random-init model when `model.path` is None (a small BPE is trained on the data)."""
    tokenizer_vocab: int = setting(512, **POSITIVE)
    hidden_size: int = setting(64, **POSITIVE)
    intermediate_size: int = setting(128, **POSITIVE)
    num_layers: int = setting(2, **POSITIVE)
    num_heads: int = setting(4, **POSITIVE)
    num_kv_heads: int = setting(2, **POSITIVE)
    rope_theta: float = setting(1e6, low=0.0, high=BIG, ends="()")
    tie_word_embeddings: bool = True


@dataclasses.dataclass(frozen=True)
class Model:
    path: str | None = None          # local HF Qwen2 or Qwen3 directory; None: random init (`init`)
    tokenizer: str | None = None     # tokenizer directory (default: path)
    preset: str | None = None        # architecture name (sem_jax.model.presets) for compile-only checks
    dtype: str = "float32"           # parameter dtype
    compute_dtype: str = "float32"   # activation dtype
    eval_dtype: str = ""             # parameter dtype of sem_jax.evaluate ("": dtype)
    remat: str = setting("none", choices=("none", "full", "dots", "dots_no_batch"))
    kernels: str = setting("auto", choices=("auto", "xla", "pallas", "interpret"))  # sem_jax.kernels.dispatch
    init: ModelInit = section(ModelInit)

    @property
    def evaluated_dtype(self) -> str:
        """The parameter dtype of `sem_jax.evaluate`: `eval_dtype`, or `dtype` when unset."""
        return self.eval_dtype or self.dtype


@dataclasses.dataclass(frozen=True)
class Mesh:
    data: int = setting(1, low=-1, high=BIG)
    fsdp: int = setting(-1, low=-1, high=BIG)   # -1: all remaining devices
    tensor: int = setting(1, low=-1, high=BIG)

    def build(self, devices: typing.Sequence | None = None) -> Any:
        """The training mesh over `devices` (default: all)."""
        from sem_jax.sharding import make_mesh
        return make_mesh(self.data, self.fsdp, self.tensor, devices=devices)


@dataclasses.dataclass(frozen=True)
class Distributed:
    mode: str = setting("auto", choices=("auto", "on", "off"))  # auto: on TPU pods or with a coordinator
    coordinator_address: str | None = None  # host:port (GPU/CPU clusters)
    num_processes: int | None = None
    process_id: int | None = None
    cpu_collectives: str | None = None      # "gloo" for multi-process CPU runs


@dataclasses.dataclass(frozen=True)
class Data:
    train_file: str = f"{DEMO_DIR}/train.jsonl"
    eval_file: str = f"{DEMO_DIR}/eval.jsonl"
    prompts_per_step: int = setting(4, **POSITIVE)   # questions per GRPO step (x group_size trajectories)
    eval_questions: int = setting(100, **POSITIVE)   # held-out questions per evaluation (greedy)
    max_prompt_tokens: int = setting(256, **POSITIVE)  # longer prompts are skipped at load


@dataclasses.dataclass(frozen=True)
class Retrieval:
    index_dir: str | None = None    # built by scripts/build_index.py
    corpus: str = f"{DEMO_DIR}/corpus.jsonl"  # indexed in memory when no index_dir
    top_k: int = setting(3, **POSITIVE)  # passages per search
    max_tokens_per_passage: int = setting(64, **POSITIVE)
    threads: int = setting(0, **COUNT)  # search threads per process (0: every core of the host)


@dataclasses.dataclass(frozen=True)
class Rollout:
    group_size: int = setting(5, **POSITIVE)  # training needs at least 2 (assemble.build_train says why)
    max_searches: int = setting(2, **COUNT)   # answered searches per trajectory
    max_new_tokens: int = setting(128, **POSITIVE)  # sampled tokens; inserted results get room of their own
    temperature: float = setting(1.0, low=0.0, high=BIG, ends="(]",
                                 why="sampling divides by it; evaluation decodes greedily whatever it is")
    top_p: float = setting(1.0, low=0.0, high=1.0, ends="(]")
    top_k: int = setting(0, why="0: all tokens", **COUNT)
    # Decode attention reads a window of the KV cache grown in steps of >= this many tokens (each
    # window size compiles once); 0: the whole cache.
    window_steps: int = setting(32, **COUNT)
    # The sampler's layout. 0: the training mesh. T >= 1: the devices as data x T, each group of T
    # devices holding the compute-dtype weights whole between them (tensor parallelism).
    tensor: int = setting(0, **COUNT)
    # With `tensor`: the MLP's weights and an untied LM head split over every device, not one group's.
    spread: bool = False
    # The rollout engine (sampling/rollout.py): decode slots per process (0: every row of the
    # step); `chunk_steps`: decode steps from a search's query to its answer's append (the
    # retriever runs beside them; the host waits if it takes longer): the schedule depends on the
    # rows alone, so a step replays bit for bit whatever the retriever's latency; retriever
    # threads; `lockstep`: barriers at pauses and admissions (one static batch decoded until every
    # row waits); `narrow`: once the queue is empty, the decode batch halves while its rows fit in
    # half of it (the step's tail decodes its last rows, not its empty slots; each width compiles
    # once), down to `narrow_floor` slots (a decode step of a few rows reads the same weights as one
    # of one row). It applies where rows cannot move between devices: the continuous engine on one
    # process with an unsplit batch; elsewhere it is a no-op (docs/usage.md). `admit_share`: while
    # rows are queued, a decode call comes back to admit them once this share of its slots has
    # ended (at least one row, at most as many as are queued): every boundary costs a host round
    # trip and a refill call, which rows that end one by one would each pay.
    slots: int = setting(0, why="0: every row of the step", **COUNT)
    chunk_steps: int = setting(8, **POSITIVE)
    lockstep: bool = False
    narrow: bool = True
    narrow_floor: int = setting(8, **POSITIVE)
    admit_share: float = setting(0.25, low=0.0, high=1.0)
    retrieval_threads: int = setting(4, **POSITIVE)
    # A retriever call not back this many seconds after its answer is due fails the rollout, naming it.
    retrieval_timeout_s: float = setting(300.0, low=0.0, high=BIG, ends="()")

    def __post_init__(self):
        if self.spread and not self.tensor:
            raise ConfigError("rollout.spread splits the MLP and LM head over rollout.tensor's groups: set "
                              "rollout.tensor too")


@dataclasses.dataclass(frozen=True)
class RewardParams:
    """The reward constants. The paper's are not public; these defaults are this project's choice,
    under one rule that `check_sem` enforces: every trajectory that searched earns less than
    a correct direct answer (by 0.2 at the defaults), or a policy could write a throwaway first
    answer and search for free on questions it knows."""
    r_direct: float = 1.0           # first answer correct, no search
    search_penalty: float = 0.5     # subtracted when a correct first answer is followed by a search
    r_no_search_wrong: float = 0.0  # first answer wrong, no search
    r_search_base: float = 0.1      # first answer wrong, searched: base ...
    r_search_scale: float = 0.7     # ... plus scale * F1(final answer): at most 0.8
    tau: float = setting(0.8, low=0.0, high=1.0, ends="(]",  # F1 at or above which an answer counts as correct
                         why="F1 at or above it counts as correct: 0 takes every answer, over 1 none")
    research_format_reward: float = 0.1  # ReSearch: well-formed but wrong
    allow_free_search: bool = False  # ablations only: accept constants under which a search is free

    def best_searched(self) -> float:
        """The most any trajectory with a search can earn under the SEM reward (F1 in [0, 1])."""
        return max(self.r_direct - self.search_penalty, self.r_search_base + max(self.r_search_scale, 0.0))

    def check_sem(self) -> None:
        """Refuse constants under which a searched answer ties or beats a correct direct one."""
        if self.allow_free_search or self.best_searched() < self.r_direct:
            return
        raise ConfigError(
            f"reward_params: a trajectory that searched can earn {self.best_searched():.3g} (max(r_direct - "
            f"search_penalty, r_search_base + r_search_scale)), not less than r_direct={self.r_direct:.3g}; a throwaway "
            "first answer would then buy a free search. Lower r_search_base + r_search_scale or raise "
            "search_penalty, or set reward_params.allow_free_search=True for an ablation")


@dataclasses.dataclass(frozen=True)
class RL:
    beta: float = setting(0.001, **RATE)      # KL to the frozen reference (k3); 0 skips the reference pass
    clip_eps: float = setting(0.2, low=0.0, high=1.0, why="a ratio's distance from 1")
    clip_eps_high: float | None = setting(None, low=0.0, high=10.0, why="a ratio's distance from 1")  # None: symmetric
    loss_agg: str = setting("seq_mean_token_mean", choices=("seq_mean_token_mean", "token_mean", "dr_grpo"))
    adv_eps: float = setting(1e-6, low=0.0, high=1.0, ends="(]")
    scale_adv_by_std: bool = True   # False: Dr. GRPO advantages (mean removed only)
    # Rows per gradient micro-batch; when each batch shard's share of it is a multiple of
    # rollout.group_size (or shares a divisor with it), a group's prompt runs once for its rows.
    micro_batch: int = setting(4, **POSITIVE)
    logprob_chunk: int = setting(128, **POSITIVE)  # sequence chunk for the LM head in log-prob passes


@dataclasses.dataclass(frozen=True)
class Optim:
    lr: float = setting(1e-6, low=0.0, high=1.0, ends="(]", why="an update of size 0 trains nothing")
    weight_decay: float = setting(0.01, **SHARE)
    b1: float = setting(0.9, low=0.0, high=1.0, ends="[)", why="Adam's decay")
    b2: float = setting(0.999, low=0.0, high=1.0, ends="[)", why="Adam's decay")
    eps: float = setting(1e-8, low=0.0, high=1.0, ends="(]")
    grad_clip: float = setting(1.0, **RATE)
    warmup_steps: int = setting(0, **COUNT)
    schedule: str = setting("constant", choices=("constant", "cosine"))

    def build(self, total_steps: int) -> OptimConfig:
        """The trainer's optimizer over `total_steps` updates (a cosine schedule ends there)."""
        from sem_jax.rl.trainer import OptimConfig
        return OptimConfig(total_steps=total_steps, **dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class Lora:
    """Low-rank adapters (`sem_jax.model.lora`) for GRPO and the warm start: the base weights stay
    frozen and the optimizer holds the adapters alone. rank 0: a full fine-tune."""
    rank: int = setting(0, why="0: a full fine-tune", **COUNT)
    alpha: float = setting(32.0, low=0.0, high=BIG, ends="()")  # the adapters' scale is alpha / rank
    targets: str = "q,k,v,o,gate,up,down"  # projections adapted, comma-separated
    # The top N layers carry adapters (0: all): the layers below are frozen whole, and the update's
    # backward pass stops at the lowest adapted layer.
    layers: int = setting(0, why="0: every layer", **COUNT)


@dataclasses.dataclass(frozen=True)
class SFT:
    """The format warm start, `python -m sem_jax.sft` (sem_jax/traces.py)."""
    traces: int = setting(256, **POSITIVE)      # traces built (questions reused in shuffled rounds)
    search_share: float = setting(0.5, **SHARE)  # of them searching
    # Which traces search. label: exactly those whose question needs_search (the warm start then
    # teaches the decision itself); random: a search_share of them whatever the question (the
    # format only, leaving GRPO the decision to learn).
    decision: str = setting("label", choices=("label", "random"))
    steps: int = setting(64, **POSITIVE)
    rows: int = setting(8, **POSITIVE)          # packed rows per step
    width: int = setting(0, **COUNT)            # tokens per row; 0: the longest trace, bucketed, at least 256
    micro_batch: int = setting(0, **COUNT)      # rows per gradient micro-batch; 0: all
    lr: float = setting(1e-5, low=0.0, high=1.0)  # AdamW, warmup over a tenth of the steps, cosine to 0
    weight_decay: float = setting(0.0, **SHARE)
    grad_clip: float = setting(1.0, **RATE)
    eval: bool = True                           # score the held-out questions before and after


@dataclasses.dataclass(frozen=True)
class Train:
    total_steps: int = setting(10, **COUNT)
    log_every: int = setting(1, **POSITIVE)
    eval_every: int = setting(0, **COUNT)        # 0: evaluate only at the end
    eval_at_start: bool = True                   # evaluate the initial policy (step 0) before training
    min_start_valid: float = setting(0.25, **SHARE)  # warn when fewer step-0 responses follow the format
    ckpt_every: int = setting(5, **POSITIVE)
    keep_checkpoints: int = setting(3, **POSITIVE)
    debug_hosts: bool = False   # multi-process: check every step that all processes made the same device calls
    debug_kill_at_step: int | None = None  # crash tests: SIGKILL after this step's checkpoint


@dataclasses.dataclass(frozen=True)
class World:
    """The demo's synthetic world (`sem_jax.demo.world`; its seed is the run's)."""
    rl_people: int = setting(120, **POSITIVE)    # people the RL questions ask about
    eval_people: int = setting(40, **POSITIVE)   # people only the eval questions ask about
    # People only the warm-start traces look up (many, each seen about once: the warm start learns
    # to copy names into queries and answers out of results, not to memorise people).
    warm_people: int = setting(4000, **POSITIVE)
    cities: int = setting(12, **POSITIVE)
    orgs: int = setting(12, **POSITIVE)
    countries: int = setting(20, **POSITIVE)     # known facts: capitals of invented countries ...
    sum_max: int = setting(4, **POSITIVE)        # ... and the sums a + b for a, b in 1..sum_max
    eval_fraction_known: float = setting(0.4, **SHARE)  # known facts held out of RL


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """The demo's supervised warm start of its random-init policy (`sem_jax.demo.warm_start`)."""
    lr: float = setting(3e-3, low=0.0, high=1.0)
    rows: int = setting(12, **POSITIVE)
    search_prob_a: float = setting(0.8, **SHARE)
    # At 0.2-0.3 GRPO sampled no search for some phrasing-B kinds: nothing to learn from.
    search_prob_b: float = setting(0.4, **SHARE)
    # First: copying random token strings (sft.copy_pairs); without it a tiny model never copied a
    # name into a query.
    copy_steps: int = setting(400, **COUNT)
    lookup_steps: int = setting(0, **COUNT)      # then: lookups alone (every trace searches)
    steps: int = setting(600, **COUNT)           # then: the whole mix
    known_copies: int = setting(48, **COUNT)     # known facts must be memorised: repeated
    lookup_copies: int = setting(1, **COUNT)


@dataclasses.dataclass(frozen=True)
class Experiment:
    """`python -m sem_jax.experiment` (sem_jax/experiment/): real MMLU and GSM8K, invented multi-hop
    questions, a format warm start, SEM and ReSearch runs, the evaluation of all four policies."""
    data_dir: str = "~/.cache/sem_jax/data"          # written by scripts/fetch_real_data.py
    mmlu_train: int = setting(400, **POSITIVE)       # known questions for the warm start and GRPO ...
    mmlu_eval: int = setting(200, **POSITIVE)        # ... and held out, disjoint, both stratified by subject
    gsm8k_eval: int = setting(200, **POSITIVE)       # out of domain: evaluation only
    people: int = setting(600, **POSITIVE)           # the multi-hop world's people ...
    eval_people: int = setting(100, **POSITIVE)      # ... of whom only the evaluation asks about these
    organisations: int = setting(120, **POSITIVE)
    cities: int = setting(60, **POSITIVE)
    countries: int = setting(20, **POSITIVE)
    multihop_eval: int = setting(200, **POSITIVE)    # multi-hop questions evaluated (stratified by hops)
    modes: str = "policy,direct,naive_rag"           # evaluation modes of every policy
    # The MMLU questions GRPO trains on as known. label: all (the paper's premise: a model that knows
    # MMLU); warm_right: those the warm start answers right first (greedy), for a model that knows
    # few. The evaluation's questions stay as drawn either way.
    known: str = setting("label", choices=("label", "warm_right"))


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    run_dir: str = "runs/demo"      # checkpoints, TensorBoard events, metrics.jsonl, config.json
    protocol: str = setting("sem", choices=("sem", "research"))  # prompts, parser, result blocks, reward
    system_prompt: str | None = None  # None: the protocol's (sem_jax/protocol/)
    prompt_example: bool = False    # append the protocol's worked example to the system prompt
    # None: the protocol's own reward. `research` on the sem protocol is ReSearch's reward on SEM's
    # format (the demo's baseline), not ReSearch as ReSearch runs (protocol=research).
    reward: str | None = setting(None, choices=("sem", "research"))
    peak_flops: float | None = setting(None, low=0.0, high=1e18, ends="()")  # FLOP/s per device, for MFU
    model: Model = section(Model)
    mesh: Mesh = section(Mesh)
    distributed: Distributed = section(Distributed)
    data: Data = section(Data)
    retrieval: Retrieval = section(Retrieval)
    rollout: Rollout = section(Rollout)
    reward_params: RewardParams = section(RewardParams)
    rl: RL = section(RL)
    optim: Optim = section(Optim)
    lora: Lora = section(Lora)
    sft: SFT = section(SFT)
    train: Train = section(Train)
    # The demo's own sections (configs/demo_cpu.py); None in every other config.
    world: World | None = None
    warm_start: WarmStart | None = None
    # The experiment's section (configs/real_experiment.py); None in every other config.
    experiment: Experiment | None = None

    def __post_init__(self):
        reward = self.reward_name()
        if reward == "sem" and self.protocol != "sem":
            raise ConfigError(f"reward='sem' reads SEM's first and final answers; protocol={self.protocol!r} gives one "
                              "answer (leave reward unset for the protocol's own)")
        if reward == "sem":
            self.reward_params.check_sem()

    # -- what the sections build ------------------------------------------------------------

    def chat_protocol(self) -> Protocol:
        """The protocol `protocol` names: prompts, parser, result blocks (sem_jax/protocol/)."""
        return get_protocol(self.protocol)

    def reward_name(self) -> str:
        """`reward`, or the protocol's own."""
        return self.reward or self.chat_protocol().reward

    def prompt(self) -> str:
        """The policy's system prompt: `system_prompt`, or the protocol's; with `prompt_example`, the
        protocol's worked example after it."""
        protocol = self.chat_protocol()
        return (self.system_prompt or protocol.system_prompt) + (protocol.example if self.prompt_example else "")

    def inserted_tokens(self) -> tuple[int, int]:
        """(one search's block at most, all inserted tokens of a response at most): max_searches
        blocks of top_k passages, and the limit note once."""
        r = self.retrieval
        block = r.top_k * (r.max_tokens_per_passage + PASSAGE_EXTRA_TOKENS) + BLOCK_EXTRA_TOKENS
        return block, self.rollout.max_searches * block + NOTE_TOKENS

    def sampling(self, eos_ids: tuple[int, ...] = (), greedy: bool = False) -> SamplingConfig:
        """The sampler's: training's draws (temperature, top-p, top-k), or `greedy` (evaluation) with
        the same budget; `eos_ids` end a response (`assemble.stop_ids`)."""
        from sem_jax.sampling.sampler import SamplingConfig
        r = self.rollout
        draws = dict(greedy=True) if greedy else dict(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
        return SamplingConfig(max_new_tokens=r.max_new_tokens, eos_ids=tuple(eos_ids),
                              max_inserted_tokens=self.inserted_tokens()[1], **draws)

    def engine(self) -> RolloutConfig:
        """The rollout engine's: its rows, searches, slots and retriever calls."""
        from sem_jax.sampling.rollout import RolloutConfig
        r = self.rollout
        return RolloutConfig(group_size=r.group_size, max_searches=r.max_searches, top_k=self.retrieval.top_k,
                             max_tokens_per_passage=self.retrieval.max_tokens_per_passage,
                             max_block_tokens=self.inserted_tokens()[0], max_note_tokens=NOTE_TOKENS, slots=r.slots,
                             chunk_steps=r.chunk_steps, lockstep=r.lockstep, narrow=r.narrow,
                             narrow_floor=r.narrow_floor, admit_share=r.admit_share,
                             retrieval_threads=r.retrieval_threads, retrieval_timeout_s=r.retrieval_timeout_s)

    def grpo(self) -> GRPOConfig:
        """The GRPO loss's: clipping, KL, aggregation (Dr. GRPO normalises by the sampled budget)."""
        from sem_jax.rl.loss import GRPOConfig
        rl = self.rl
        return GRPOConfig(beta=rl.beta, clip_eps=rl.clip_eps, clip_eps_high=rl.clip_eps_high, loss_agg=rl.loss_agg,
                          dr_grpo_length=self.rollout.max_new_tokens)

    def replace(self, **dotted: Any) -> "Config":
        """A copy with fields changed by dotted name (`replace(**{"model.path": d})`), checked as
        `load` checks them."""
        tree = to_dict(self)
        for name, value in dotted.items():
            node, *parents, leaf = [tree, *name.split(".")]
            for part in parents:
                node = node[part]
            node[leaf] = value
        return from_dict(tree)

    def to_json(self) -> str:
        return json.dumps(to_dict(self), indent=2)


OPTIONAL_SECTIONS = ("world", "warm_start", "experiment")


# -- ConfigDict <-> Config -------------------------------------------------------------------

def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _optional(hint: Any) -> tuple[Any, bool]:
    """(the type inside `T | None`, whether None is allowed)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return hint, False


def to_config_dict(value: Any = None) -> ConfigDict:
    """The ConfigDict of `value` (default: every default): what `configs/*.py` start from. A field
    that may be None is a typed placeholder, so that a command-line override still type-checks."""
    value = Config() if value is None else value
    out = ConfigDict()
    for f in dataclasses.fields(value):
        kind, _ = _optional(_hints(type(value))[f.name])
        v = getattr(value, f.name)
        if dataclasses.is_dataclass(kind):
            if v is not None:
                out[f.name] = to_config_dict(v)
        elif v is None:
            out[f.name] = config_dict.placeholder(kind)
        else:
            out[f.name] = v
    return out


def to_dict(value: Any) -> dict:
    return dataclasses.asdict(value)


def load(config: ConfigDict | dict) -> Config:
    """The typed, checked settings of `config` (a ConfigDict as the config files make it, or its
    dict); refused in one line naming the field: an unknown field, a wrong type, a value out of
    range or not among the choices."""
    return from_dict(config.to_dict() if isinstance(config, ConfigDict) else dict(config))


# What a resumed run may change: how long and how often it runs and evaluates, where its files are,
# and how its steps are computed (mesh, kernels, engine, threads, micro-batches). The rest defines
# what trains (protocol, reward, update, optimizer, model, LoRA, the data's shape) and is refused.
RESUMABLE = ("run_dir", "peak_flops", "train.", "mesh.", "distributed.", "data.train_file", "data.eval_file",
             "data.eval_questions", "retrieval.index_dir", "retrieval.corpus", "retrieval.threads",
             "rollout.window_steps", "rollout.tensor", "rollout.spread", "rollout.slots", "rollout.chunk_steps",
             "rollout.lockstep", "rollout.narrow", "rollout.narrow_floor", "rollout.admit_share",
             "rollout.retrieval_threads", "rollout.retrieval_timeout_s",
             "model.path", "model.tokenizer", "model.kernels", "model.remat", "model.eval_dtype", "rl.micro_batch",
             "rl.logprob_chunk", "sft.", "world.", "warm_start.", "experiment")


def resume_changes(before: Config, now: Config, where: str) -> dict[str, list]:
    """The fields `now` changes from the config a run was trained with (`before`, read from
    `where`), as {field: [before, now]}; refused, naming every field, where one is not RESUMABLE."""
    changed = changed_fields(json.loads(before.to_json()), now)
    refused = [k for k in changed
               if not any(k == r or k.startswith(r if r.endswith(".") else r + ".") for r in RESUMABLE)]
    if refused:
        said = "; ".join(f"{k}: {changed[k][0]!r} -> {changed[k][1]!r}" for k in refused)
        raise ConfigError(f"{where}: a resumed run cannot change what it trains ({said}). Nothing was changed; "
                          "resume with the run's config, or train in a new run_dir")
    return changed


def changed_fields(before: dict, now: Config) -> dict[str, list]:
    """The fields in which `now` differs from `before` (a config as JSON, maybe written before a
    field existed: one it lacks counts as its default), as {field: [before, now]}."""
    old, new, default = (flat_fields(t) for t in (before, json.loads(now.to_json()), json.loads(Config().to_json())))
    was = lambda k: old.get(k, default.get(k))
    return {k: [was(k), new.get(k)] for k in sorted(set(old) | set(new)) if was(k) != new.get(k)}


def flat_fields(tree: dict, prefix: str = "") -> dict:
    """A nested dict as {"section.field": value}."""
    out = {}
    for k, v in tree.items():
        out.update(flat_fields(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def run_config(run_dir: str, hint: str) -> Config:
    """The config a run was trained with (`sem_jax.train` writes run_dir/config.json); fields newer
    than the run keep their defaults. A run without one is refused, saying `hint` (what to do)."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        raise ConfigError(f"{path}: not found; {hint}")
    with open(path) as fh:
        try:
            tree = json.load(fh)
        except ValueError as e:
            raise ConfigError(f"{path}: not a JSON config ({e})") from None
    try:
        return from_dict(tree)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def from_dict(tree: dict) -> Config:
    return _build(Config, tree, "")


def _build(cls: type, tree: Any, prefix: str) -> Any:
    if not isinstance(tree, dict):
        raise ConfigError(f"config.{prefix.rstrip('.')}: a section, not {tree!r}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in tree if k not in fields]
    if unknown:
        name = prefix + unknown[0]
        close = [prefix + k for k in difflib.get_close_matches(unknown[0], list(fields), n=3, cutoff=0.6)]
        raise ConfigError(f"unknown config field {name!r}" + (f"; did you mean {', '.join(close)}?" if close else ""))
    values = {}
    for name, value in tree.items():
        kind, nullable = _optional(hints[name])
        where = prefix + name
        if dataclasses.is_dataclass(kind):
            values[name] = None if value is None and nullable else _build(kind, value, where + ".")
        else:
            values[name] = _check(where, _typed(where, kind, nullable, value), fields[name].metadata)
    return cls(**values)


def _typed(where: str, kind: type, nullable: bool, value: Any) -> Any:
    if value is None:
        if nullable:
            return None
        raise ConfigError(f"config.{where}=None: must be a {kind.__name__}")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ConfigError(f"config.{where}={value!r}: must be a {kind.__name__}")
    if kind is float and not math.isfinite(value):
        raise ConfigError(f"config.{where}={value!r}: must be a finite number")
    return value


def _check(where: str, value: Any, meta: Any) -> Any:
    if value is None or not meta:
        return value
    why = f" ({meta['why']})" if meta["why"] else ""
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ConfigError(f"config.{where}={value!r}: choose one of {', '.join(map(str, meta['choices']))}" + why)
    low, high, ends = meta["low"], meta["high"], meta["ends"]
    if low is None:
        return value
    above = value > low if ends[0] == "(" else value >= low
    below = value < high if ends[1] == ")" else value <= high
    if not (above and below):
        if high >= BIG and ends[0] == "(":
            where_ok = f"> {low}"
        elif high >= BIG:
            where_ok = f">= {low}" if low != 1 or not isinstance(value, int) else "> 0"
        else:
            where_ok = f"in {ends[0]}{low}, {high}{ends[1]}"
        raise ConfigError(f"config.{where}={value!r}: must be {where_ok}" + why)
    return value
