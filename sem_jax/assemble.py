"""The one place a config becomes a run; train, evaluate and aot all build here.

The config's sections build the small runtime dataclasses they describe (`Config.sampling`,
`Config.engine`, `Config.grpo`, `Optim.build`, `Mesh.build`). The `build_*` functions here make the
objects that hold arrays or files (policy, retriever, samplers, trainer), and one builder per
purpose puts a run's together from them (`build_train`, `build_evaluation`, `build_warm_start`,
`build_compile`).
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from sem_jax.checkpoint import Checkpointer, checkpoint_run_dir
from sem_jax.data.example import Example
from sem_jax.data.mix import process_share
from sem_jax.data.questions import load_questions
from sem_jax.errors import Refused
from sem_jax.hosts import CallLog, batch_shards, local_batch_multiple
from sem_jax.model import Qwen2, Qwen2Config, from_pretrained
from sem_jax.model import lora as lora_lib
from sem_jax.model.hf_io import read_config
from sem_jax.model.presets import preset
from sem_jax.model.tokenizer import load_tokenizer, train_bpe_tokenizer
from sem_jax.protocol import Protocol
from sem_jax.rl.trainer import Trainer
from sem_jax.sampling import Engine, Sampler, build_stop_automaton
from sem_jax.config import Config, ConfigError
from sem_jax.sharding import named_sharding, replicated, tensor_groups


def stop_ids(tokenizer) -> tuple[int, ...]:
    """The ids that end a response, for training and evaluation alike: the tokenizer's eos
    (`<|im_end|>` for Qwen2.5 instruct) and `<|endoftext|>` where the vocabulary has it."""
    ids = (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    return tuple(sorted({i for i in ids if isinstance(i, int) and i >= 0}))


def micro_batch(config: Config, processes: int = 1) -> int:
    """Rows per gradient micro-batch: `rl.micro_batch`, at most one step's rows."""
    micro = min(config.rl.micro_batch, config.data.prompts_per_step * config.rollout.group_size)
    if micro % processes:
        raise ValueError(f"rl.micro_batch={micro} must divide by the {processes} processes")
    return micro


# -- objects -----------------------------------------------------------------------------

def build_rollout_mesh(config: Config, mesh: Mesh) -> Mesh:
    """The sampler's mesh: `mesh` itself (rollout.tensor = 0) or its devices in tensor-parallel
    groups of rollout.tensor (`sharding.tensor_groups`; rollout.spread: the MLP and LM head over all of them)."""
    return tensor_groups(mesh, config.rollout.tensor, config.rollout.spread) if config.rollout.tensor else mesh


def init_model_config(config: Config, tokenizer=None) -> Qwen2Config:
    """The random-init architecture of `config.model.init`, its vocabulary `tokenizer`'s (default:
    the BPE's target size plus its 3 special tokens, as `train_bpe_tokenizer` makes it) padded to 64."""
    i = config.model.init
    vocab = len(tokenizer) if tokenizer is not None else i.tokenizer_vocab + 3
    return Qwen2Config(vocab_size=-(-vocab // 64) * 64, hidden_size=i.hidden_size,
                       intermediate_size=i.intermediate_size, num_layers=i.num_layers, num_heads=i.num_heads,
                       num_kv_heads=i.num_kv_heads, rope_theta=i.rope_theta,
                       tie_word_embeddings=i.tie_word_embeddings, bos_token_id=None,
                       eos_token_id=None if tokenizer is None else tokenizer.eos_token_id)


def model_config(config: Config) -> Qwen2Config:
    """The architecture without loading weights: `model.preset`, else the HF directory's
    config.json, else the random-init one."""
    m = config.model
    if m.preset:
        return preset(m.preset)
    if m.path and os.path.exists(os.path.join(m.path, "config.json")):
        return read_config(m.path)
    if m.path:
        raise ValueError(f"model.path {m.path!r} is not a local directory: set model.preset for a compile-only check")
    return init_model_config(config)


def new_model(config: Config, model_config: Qwen2Config, param_dtype: Any, *, scan_unroll: int = 1,
              seed: int = 0) -> Qwen2:
    """A Qwen2 of `model_config` as the config sets it up (compute dtype, remat, kernels)."""
    m = config.model
    return Qwen2(model_config, rngs=nnx.Rngs(seed), param_dtype=jnp.dtype(param_dtype), dtype=jnp.dtype(m.compute_dtype),
                 remat=m.remat, scan_unroll=scan_unroll, cache_kernel=m.kernels, attention_kernel=m.kernels,
                 decode_kernel=m.kernels)


def abstract_model(config: Config, model_config: Qwen2Config, mesh: Mesh, param_dtype: Any, scan_unroll: int = 1):
    """The model as abstract arrays (no memory) in `param_dtype`, sharded over `mesh`: the
    module, its graph definition and its parameters."""
    model = nnx.eval_shape(lambda: new_model(config, model_config, param_dtype, scan_unroll=scan_unroll))
    graphdef, state = nnx.split(model)
    params = jax.tree.map(
        lambda v: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype,
                                                 sharding=named_sharding(mesh, v.get_metadata()["axes"], v.shape))),
        state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return model, graphdef, params


def build_policy(config: Config, texts: Callable[[], list[str]] | None, run_dir: str,
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
    model = new_model(config, init_model_config(config, tokenizer), dtype, seed=config.seed)
    return model, tokenizer


def load_policy(config: Config, checkpoint: str | None, step: int | None, hf: str | None,
                mesh: Mesh | None = None) -> tuple[Qwen2, Any]:
    """(model, tokenizer) to evaluate: a HF directory `hf`, or a sem_jax checkpoint's parameters
    alone (`step`, default the latest), in `model.eval_dtype` (default `model.dtype`) and, with
    `mesh`, sharded as in training."""
    dtype = jnp.dtype(config.model.evaluated_dtype)
    if hf:
        return from_pretrained(hf, dtype=dtype, compute_dtype=jnp.dtype(config.model.compute_dtype), mesh=mesh,
                               kernels=config.model.kernels), load_tokenizer(hf)
    if not checkpoint:
        raise Refused("give --checkpoint RUN/ckpt or --hf DIR")
    ckpt = Checkpointer(checkpoint, read_only=True)
    model, tokenizer = build_policy(config, None, checkpoint_run_dir(checkpoint), mesh=mesh)
    got = restore_policy(config, ckpt, step, model)
    # Restored as trained (the checkpoint's dtype), then cast: the sharding stays.
    _, params = nnx.split(model)
    nnx.update(model, jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params))
    if jax.process_index() == 0:
        print(f"restored parameters of step {got} from {checkpoint} ({dtype.name})", flush=True)
    return model, tokenizer


def restore_policy(config: Config, ckpt: Checkpointer, step: int | None, model: Qwen2) -> int:
    """Put a checkpoint's policy (`step`, default the latest) into `model`: its parameters, or
    (a LoRA run) its adapters merged into `model`'s weights, which must be the base they were
    trained on (refused by fingerprint otherwise). Returns the step restored."""
    _, params = nnx.split(model)
    spec = lora_lib.spec_of(config.lora, model.config)
    if spec is None:
        params, got = ckpt.restore_params(step, params)
        nnx.update(model, params)
        return got
    like = lora_lib.abstract_adapters(spec, model.config, replicated(jax.tree.leaves(params)[0].sharding))
    adapters, got = ckpt.restore_params(step, like)
    lora_lib.check_base(ckpt.restore_meta(got).get("lora_base"), lora_lib.fingerprint(params), config.model.path,
                        f"{ckpt.directory} step {got}")
    nnx.update(model, lora_lib.merge(spec, params, adapters))
    return got


def build_retriever(config: Config):
    from sem_jax.retrieval import Retriever  # imports bm25s: only after the distributed runtime starts
    r = config.retrieval
    if r.index_dir:
        return Retriever.load(r.index_dir, threads=r.threads)
    return Retriever.from_jsonl(r.corpus, show_progress=False, threads=r.threads)


def build_sampler(model: Qwen2, tokenizer, config: Config, *, greedy: bool = False, mesh: Mesh | None = None,
                  calls: CallLog | None = None, resid_layer: int = -1) -> Sampler:
    """The sampler of `config.sampling` (`greedy`: evaluation's), stopping at the protocol's
    search tag and the tokenizer's end ids."""
    t, kv = config.rollout.tensor, model.config.num_kv_heads
    if t and kv % t:
        print(f"WARNING: rollout.tensor={t} does not divide the model's {kv} KV heads: each tensor-parallel "
              f"group holds every row's whole KV cache on each of its {t} devices", flush=True)
    m = model.config.intermediate_size
    if mesh is not None and config.rollout.spread and m % mesh.size:
        print(f"WARNING: rollout.spread: the model's {m} MLP columns do not divide over the {mesh.size} devices: "
              f"split over the largest run of the sampler's mesh axes that divides them (sharding.logical_to_spec)",
              flush=True)
    stop = build_stop_automaton(tokenizer, config.chat_protocol().stop_strings, vocab_size=model.config.vocab_size)
    return Sampler(model, stop, config.sampling(stop_ids(tokenizer), greedy=greedy), mesh=mesh, calls=calls,
                   window_steps=config.rollout.window_steps, max_prompt_tokens=config.data.max_prompt_tokens,
                   resid_layer=resid_layer)


def check_positions(config: Config, model_config: Qwen2Config) -> None:
    """The longest sequence a rollout can build must fit the model's positions (RoPE beyond them
    is untrained): refused at start, with the sum."""
    sampling = config.sampling()
    longest = config.data.max_prompt_tokens + sampling.max_new_tokens + sampling.max_inserted_tokens
    if longest > model_config.max_position_embeddings:
        raise ValueError(f"data.max_prompt_tokens={config.data.max_prompt_tokens} + rollout.max_new_tokens="
                         f"{sampling.max_new_tokens} + {sampling.max_inserted_tokens} inserted tokens (retrieval, "
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


def cap_config_prompts(examples: Sequence[Example], config: Config, tokenizer, where: str) -> list[Example]:
    """`cap_prompts` under the config's protocol, system prompt and data.max_prompt_tokens."""
    return cap_prompts(examples, config.chat_protocol(), config.prompt(), tokenizer, config.data.max_prompt_tokens,
                       where)


def build_trainer(config: Config, model: Qwen2, mesh: Mesh, *, processes: int = 1,
                  per_layer: bool | None = None, unroll_head: int = 1) -> Trainer:
    return Trainer(model, config.grpo(), config.optim.build(config.train.total_steps),
                   micro_batch=micro_batch(config, processes),
                   logprob_chunk=config.rl.logprob_chunk, per_layer=per_layer, group_size=config.rollout.group_size,
                   shards=batch_shards(mesh), unroll_head=unroll_head, lora=lora_lib.spec_of(config.lora, model.config))


# -- a run, built for its purpose: one builder each, sharing the named steps below ----------------

@dataclasses.dataclass(kw_only=True)
class Run:
    """What every purpose's run has: the config and its meshes."""
    config: Config
    run_dir: str
    mesh: Mesh                       # training's (evaluate: the sampler's, where the weights load)
    rollout_mesh: Mesh               # the sampler's (`rollout.tensor`)
    model_config: Qwen2Config


@dataclasses.dataclass(kw_only=True)
class CompileRun(Run):
    """`build_compile`: the abstract model (no memory) and the layer scan's trainer, as on the TPU."""
    model: Qwen2
    params: Any                      # the model's abstract parameters on `mesh`
    trainer: Trainer


@dataclasses.dataclass(kw_only=True)
class PolicyRun(Run):
    """A run with a loaded policy, its tokenizer and the retriever (`build_evaluation`)."""
    model: Qwen2
    tokenizer: Any
    retriever: Any
    greedy: Sampler | None           # greedy evaluation
    eval_batch: int                  # rows each process evaluates at a time (one per question)
    pad_id: int

    def cap(self, examples: Sequence[Example], where: str) -> list[Example]:
        """`examples` whose prompt fits data.max_prompt_tokens (`cap_prompts`)."""
        return cap_config_prompts(examples, self.config, self.tokenizer, where)


@dataclasses.dataclass(kw_only=True)
class WarmStartRun(PolicyRun):
    """`build_warm_start`: the training questions and, with sft.eval, the held-out share and `greedy`."""
    train_set: list[Example]
    eval_set: list[Example]          # this process's share
    eval_total: int                  # held-out questions over every process


@dataclasses.dataclass(kw_only=True)
class TrainRun(WarmStartRun):
    """`build_train`: the rollout engine, the trainer and every process's call log."""
    engine: Engine
    trainer: Trainer
    calls: CallLog
    per_host: int                    # questions each process rolls out per step
    row_multiple: int                # each process's training rows pad to a multiple of this


def _frame(config: Config, processes: int, devices: Sequence | None = None) -> dict[str, Any]:
    """Every run's first step: its meshes (a `Run`'s fields but the model's)."""
    mesh = config.mesh.build(devices)
    return dict(config=config, run_dir=os.path.abspath(config.run_dir), mesh=mesh,
                rollout_mesh=build_rollout_mesh(config, mesh),
                eval_batch=max(1, config.data.prompts_per_step // processes) * config.rollout.group_size)


def _with_policy(frame: dict[str, Any], model: Qwen2, tokenizer) -> dict[str, Any]:
    """The frame with its policy: positions checked, its pad id."""
    check_positions(frame["config"], model.config)
    return dict(frame, model=model, tokenizer=tokenizer, model_config=model.config,
                pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)


def _questions(run: dict[str, Any], processes: int, train_set: list[Example],
               eval_all: list[Example] | None) -> dict[str, Any]:
    """The run with the training questions and (`eval_all` given: the held-out ones) this process's
    share of the held-out ones, capped to data.max_prompt_tokens."""
    config = run["config"]
    cap = lambda examples, where: cap_config_prompts(examples, config, run["tokenizer"], where)
    train_set = cap(train_set, config.data.train_file)
    if not train_set:
        raise ValueError(f"{config.data.train_file}: no question's prompt fits data.max_prompt_tokens")
    eval_set = []
    if eval_all is not None:
        eval_all = cap(eval_all, config.data.eval_file)[:config.data.eval_questions]
        eval_set = process_share(eval_all, jax.process_index(), processes)  # each process evaluates its share
        if not eval_set:
            raise ValueError(f"{processes} processes need at least as many eval questions (data.eval_questions)")
    return dict(run, train_set=train_set, eval_set=eval_set, eval_total=len(eval_all or []))


def _greedy(run: dict[str, Any], calls: CallLog | None = None) -> Sampler:
    return build_sampler(run["model"], run["tokenizer"], run["config"], greedy=True, mesh=run["rollout_mesh"],
                         calls=calls)


def build_compile(config: Config, devices: Sequence | None = None) -> CompileRun:
    """For `devices` (a TPU topology's, say): the abstract model and trainer at the config's shapes,
    no data or weights (`sem_jax.aot`, `sem_jax.aot.roofline`)."""
    frame = _frame(config, 1, devices)
    frame.pop("eval_batch")
    mcfg = model_config(config)
    model, _, params = abstract_model(config, mcfg, frame["mesh"], config.model.dtype)
    trainer = build_trainer(config, model, frame["mesh"], per_layer=False)  # the layer scan
    return CompileRun(**frame, model_config=mcfg, model=model, params=params, trainer=trainer)


def build_evaluation(config: Config, *, checkpoint: str | None = None, step: int | None = None,
                     hf: str | None = None) -> PolicyRun:
    """The policy from `checkpoint` (at `step`) or the HF directory `hf`, loaded in the sampler's
    layout, the greedy sampler and the retriever (`sem_jax.evaluate`, which reads its own data
    sets: `PolicyRun.cap` caps them)."""
    frame = _frame(config, jax.process_count())
    frame["mesh"] = frame["rollout_mesh"]  # nothing trains: the weights load in the sampler's layout
    run = _with_policy(frame, *load_policy(config, checkpoint, step, hf, frame["rollout_mesh"]))
    return PolicyRun(**run, retriever=build_retriever(config), greedy=_greedy(run))


def build_warm_start(config: Config) -> WarmStartRun:
    """The pretrained policy, the training questions, the retriever and, with sft.eval, the
    held-out share and the greedy sampler (`sem_jax.sft`)."""
    if not config.model.path:
        raise ValueError("sem_jax.sft warm-starts a pretrained model: set --config.model.path (the demo's "
                         "random-init model has its own warm start, `make demo`)")
    nproc = jax.process_count()
    frame = _frame(config, nproc)
    run = _questions(_with_policy(frame, *build_policy(config, None, frame["run_dir"], frame["mesh"])), nproc,
                     load_questions(config.data.train_file),
                     load_questions(config.data.eval_file) if config.sft.eval else None)
    return WarmStartRun(**run, retriever=build_retriever(config), greedy=_greedy(run) if config.sft.eval else None)


def build_train(config: Config, *, resuming: bool = False) -> TrainRun:
    """Mesh, data, retriever, policy (`resuming`: nothing a checkpoint depends on built anew), the
    rollout engine, the greedy sampler and the trainer (`sem_jax.train`)."""
    nproc = jax.process_count()
    if config.rollout.group_size < 2:  # evaluation samples one row a question
        raise ConfigError(f"config.rollout.group_size={config.rollout.group_size}: training needs at least 2 (GRPO's "
                          "advantages compare a question's trajectories: with one, every group ties and no step "
                          "learns)")
    if config.data.prompts_per_step % nproc:  # each process rolls out its share of a step
        raise ValueError(f"data.prompts_per_step={config.data.prompts_per_step} must divide by the {nproc} processes")
    frame = _frame(config, nproc)
    mesh = frame["mesh"]
    retriever = build_retriever(config)
    train_set, eval_all = load_questions(config.data.train_file), load_questions(config.data.eval_file)
    # Text for a random-init model's BPE (only read when no model.path is given).
    texts = lambda: [config.prompt()] + [e.question + " " + " ".join(e.answers)
                                          for e in train_set + eval_all[:config.data.eval_questions]] + \
        [f"{d['title']} {d['text']}" for d in retriever.passages()]
    policy = build_policy(config, texts, frame["run_dir"], mesh, resuming=resuming)
    run = _questions(_with_policy(frame, *policy), nproc, train_set, eval_all)
    calls = CallLog(config.train.debug_hosts)  # every process's device calls, checked alike
    trainer = build_trainer(config, run["model"], mesh, processes=nproc)
    # LoRA on the top layers: the sampler keeps the residual stream entering the lowest adapted one,
    # and the update starts there (both per layer; the layer scan runs every layer).
    spec = trainer.lora
    resid_layer = spec.first if spec is not None and spec.first > 0 and trainer.per_layer else -1
    sampler = build_sampler(run["model"], run["tokenizer"], config, mesh=run["rollout_mesh"], calls=calls,
                            resid_layer=resid_layer)
    # Each process pads its rows so that the global batch splits into micro-batches and over the batch
    # shards, and its groups stay whole runs of the trainer's shared prompts.
    row_multiple = int(np.lcm.reduce([trainer.micro_batch // nproc, local_batch_multiple(mesh), trainer.share]))
    return TrainRun(**run, retriever=retriever, greedy=_greedy(run, calls),
                    engine=Engine(sampler, run["tokenizer"], retriever, config.engine(), config.chat_protocol()),
                    trainer=trainer,
                    calls=calls, per_host=max(1, config.data.prompts_per_step // nproc), row_multiple=row_multiple)
