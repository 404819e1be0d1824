"""A roofline of one GRPO step from the compiled programs: XLA's counts beside the ideal, and
predicted times on each chip.

    python -m sem_jax.aot --config configs/tpu_v4.py --topology v4:2x2x4 --roofline [--json FILE]

For every call a step makes (the prefill, one decode step, one insert, the reference pass and the
update, the last two for one micro-batch), at the config's shapes, for the target, the sampler's
calls on the sampler's mesh (`rollout.tensor`) and the trainer's on the training mesh:

- XLA's own cost analysis of the compiled program: FLOPs and HBM bytes per device. XLA counts a
  loop's body once. The sampler's calls are counted on a compile with the layer scan unrolled
  whole (no loop left, the same ops as the program that runs); a decode step is the difference
  between a loop of the sampler's decode step running two and one of them per iteration (counted
  again with 2 and 4 layers, it splits into one layer's bytes and the rest's: `decode_split`). The
  update and the reference pass (one micro-batch each) do not compile unrolled whole (for the 7B
  reference pass the TPU compiler refused 45.6 GB of temporaries), so they are compiled twice per
  loop, the loop running one and then two iterations at a time: one iteration's cost is the
  difference, the call's the first count plus (iterations - 1) differences, for the layer scan and
  the loop over the LM head's chunks. That difference is exact for FLOPs but not always for
  bytes: the TPU compiler lays a partly unrolled loop out differently (the 7B decode step,
  counted so, copied every layer's KV window at each step: 3.8x the program unrolled whole).
  The TPU compiler's windowed einsums (loops of its own) and its staging in v4's CMEM (counted
  beside the HBM traffic) are turned off (`TPU_ANALYSIS_FLAGS`). Memory figures come from the
  programs as they run (loops rolled). XLA cannot see into a Pallas kernel: for the decode
  step's and the insert's `cache_attention` it counts the kernel's own estimate, the blocks its
  grid fetches, an upper bound (a block past the longest row of its rows is not fetched); for the
  splash kernels of `flash_attention` (the prefill, the reference pass, the update) it counts
  nothing, and `programs.cost` adds their estimate (`flash_attention.hlo_cost`).
- the ideal: the model's FLOPs (2 per weight per token, causal attention, the head where it runs;
  3x for the update, plus what the remat policy recomputes) and the bytes that must move (the
  weights once in the compute dtype, the KV window read, this call's keys and values written),
  divided evenly over the devices (a decode step in the sampler's layout reads at least the
  share of each weight that layout puts on a device: `decode_floor`).
- the interconnect: the bytes each device sends in the program's collectives, as a ring sends
  them (`sem_jax.aot.collectives`), counted across loops as the FLOPs are.
- the predicted time per call on each chip of CHIPS: the largest of FLOPs / peak, bytes / HBM
  bandwidth and bytes sent / ICI bandwidth, the others overlapped (each chip's time for the
  target's per-device program), and from them the step: one
  prefill, `max_new_tokens` decode steps at the full window, `max_searches` inserts, and a
  reference pass and an update per micro-batch (an upper bound for the rollout: every row
  sampling its whole budget).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from sem_jax.assemble import CompileRun, abstract_model, build_compile, build_trainer, micro_batch
from sem_jax.hosts import batch_shards
from sem_jax.errors import Refused
from sem_jax.aot.programs import (Filled, Program, cost, device_bytes, narrower, placed, rows_on, sampler_layers,
                              trainer_bytes)
from sem_jax.model import Qwen2Config, param_shapes
from sem_jax.rl.loss import head_chunk
from sem_jax.rl.batch import widest_batch
from sem_jax.rl.trainer import LOGPROB_KEYS
from sem_jax.sampling.sampler import (SamplingConfig, bucket_length, decode_loop, decode_step, insert_step,
                                     prefill_step)
from sem_jax.sampling.stop import trie_states
from sem_jax.config import Config
from sem_jax.sharding import match_param_shardings


# The SPMD partitioner turns a matmul with an FSDP-sharded weight into a loop over the shards
# (a windowed einsum: collective-permutes beside partial matmuls), whose body XLA's cost analysis
# counts once. Turned off for the analysis: the same FLOPs, the gathered weight then written
# once more than with the overlap.
# The v4 compiler also stages operands in CMEM, the chip's on-die memory (memory space 3 in the
# HLO), and the cost analysis counts every memory alike: a weight prefetched to CMEM counted
# three times (the HBM read, the CMEM write, the dot's CMEM read). Off for the analysis: every
# byte counted is then an HBM byte, the count of a chip without CMEM (v5e, v6e, the GPUs), and an
# upper bound for v4.
TPU_ANALYSIS_FLAGS = ("--xla_tpu_enable_windowed_einsum_for_all_gather=false",
                      "--xla_tpu_enable_windowed_einsum_for_reduce_scatter=false",
                      "--xla_tpu_cmem_memory_space_assignment=false")


def set_analysis_flags() -> None:
    """Add TPU_ANALYSIS_FLAGS to LIBTPU_INIT_ARGS: before libtpu starts (the first TPU topology)."""
    args = os.environ.get("LIBTPU_INIT_ARGS", "")
    os.environ["LIBTPU_INIT_ARGS"] = " ".join([args, *(f for f in TPU_ANALYSIS_FLAGS if f not in args)]).strip()


@dataclasses.dataclass(frozen=True)
class Chip:
    flops: float  # dense bf16 FLOP/s per device
    hbm: float    # HBM bytes/s per device
    ici: float    # bytes/s one device sends into a collective (one direction of its links)


# Per device as jax sees it: a chip (v4 and v5p run their two TensorCores as one device). ICI: v4
# the published all-reduce bandwidth per pod over its 4096 chips, the other TPUs their published
# interchip bandwidth (one direction: half the bidirectional figure), the GPUs NVLink 4's 900 GB/s
# bidirectional.
CHIPS = {
    "v4": Chip(275e12, 1228e9, 268e9),
    "v5e": Chip(197e12, 819e9, 200e9),
    "v5p": Chip(459e12, 2765e9, 600e9),
    "v6e": Chip(918e12, 1640e9, 448e9),
    "H100": Chip(989e12, 3350e9, 450e9),  # SXM
    "H200": Chip(989e12, 4800e9, 450e9),
}


@dataclasses.dataclass
class Call:
    name: str
    per_step: int             # how often a GRPO step makes this call
    flops: float              # XLA's count, per device
    bytes: float
    ideal_flops: float        # the model's FLOPs, per device
    ideal_bytes: float
    remat_flops: float = 0.0  # the update's ideal plus the remat policy's recompute
    part: str = "rollout"     # rollout or update (the reference pass counts with the update)
    ici: float = 0.0          # bytes each device sends in the call's collectives (`sem_jax.aot.collectives`)

    def times(self, chip: Chip) -> dict[str, float]:
        return {"compute": self.flops / chip.flops, "memory": self.bytes / chip.hbm, "interconnect": self.ici / chip.ici}

    def seconds(self, chip: Chip) -> float:
        """The roofline: the slowest of compute, HBM and the interconnect, the others overlapped."""
        return max(self.times(chip).values())

    def bound(self, chip: Chip) -> str:
        times = self.times(chip)
        return max(times, key=times.get)

    def floor(self, chip: Chip) -> float:
        """The least time the ideal counts allow (the model's FLOPs, remat included, and the bytes
        that must move, at the chip's peaks), whatever XLA counted."""
        return max((self.remat_flops or self.ideal_flops) / chip.flops, self.ideal_bytes / chip.hbm)

    @property
    def undercounted(self) -> bool:
        """XLA's FLOPs under half the model's: its count misses work (a call into a library, as
        XLA:GPU's cost analysis counts no cuBLAS gemm), and times predicted from it are no bound."""
        return self.flops < 0.5 * self.ideal_flops


def counted(lower, loops: dict[str, int]) -> dict[str, float]:
    """A call's cost with each loop of `loops` (name -> trip count) counted that many times.
    `lower(**unrolls)` lowers the call with `unrolls[name]` iterations
    of each loop per iteration of its `lax.scan`: the base compile runs one of each, and one
    iteration of a loop costs the difference made by unrolling it by 2 (halved for an odd count:
    the scan then runs its remainder beside the loop)."""
    c0 = cost(lower(**{k: 1 for k in loops}).compile())
    total = dict(c0)
    for name, n in loops.items():
        if n < 2:
            continue
        c = cost(lower(**{k: 2 if k == name else 1 for k in loops}).compile())
        for k in total:
            total[k] += (n - 1) * (c[k] - c0[k]) / (2 if n % 2 else 1)
    return total


def whole_or_counted(lower, layers: int) -> dict[str, float]:
    """A sampler call's cost compiled with its layer scan unrolled whole, or where the compiler
    refuses that for lack of HBM (the Qwen3-8B insert: every layer's temporaries at once), as
    `counted` counts the update: FLOPs exact, bytes an upper bound."""
    try:
        return cost(lower(layers).compile())
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        print(f"roofline: unrolled whole it does not fit ({str(e).splitlines()[0][:160]}); counted from the "
              "layer scan unrolled by 1 and by 2 instead (bytes an upper bound)", flush=True)
        return counted(lower, {"layers": layers})


@partial(jax.jit, static_argnums=0, static_argnames=("cfg", "window", "steps"), donate_argnums=2)
def decode_steps(graphdef, params, state, stop_table, eos_ids, *, cfg, window: int, steps: int):
    """The sampler's decode loop with `steps` decode steps per iteration (and a fixed trip count):
    one step's cost is the difference of 2 and 1, its carry laid out as the real loop's is."""
    model = nnx.merge(graphdef, params)

    def body(carry):
        i, s = carry
        for _ in range(steps):
            s = decode_step(model, None, s, stop_table, eos_ids, cfg=cfg, window=window)
        return i + 1, s
    return jax.lax.while_loop(lambda c: c[0] < 8, body, (jnp.int32(0), state))[1]


# -- the ideal --------------------------------------------------------------------------------

def layer_flops(c: Qwen2Config, rows: int, new: int, past: int) -> tuple[float, float]:
    """(matmul, causal attention) FLOPs of the layers for `rows` rows appending `new` tokens
    after `past` cached ones."""
    matmul = 2 * (c.matmul_params - c.vocab_size * c.hidden_size) * rows * new
    attention = 4 * c.num_layers * c.num_heads * c.head_dim * rows * new * (past + (new + 1) / 2)
    return matmul, attention


def forward_flops(c: Qwen2Config, rows: int, new: int, past: int, head_rows: int) -> float:
    """The layers' FLOPs (`layer_flops`) and the LM head's on `head_rows` positions in all."""
    return sum(layer_flops(c, rows, new, past)) + 2 * c.vocab_size * c.hidden_size * head_rows


def weight_bytes(c: Qwen2Config, itemsize: int, share: dict[str, float] | None = None) -> float:
    """Every weight a forward pass reads, once: the layers, the final norm and the head (the
    embedding table only where it is the head); `share`: the fraction of each weight (by its
    `param_shapes` name) that one device holds, else all of it."""
    read = {name: shape for name, (shape, _) in param_shapes(c).items() if name != "embed" or c.tie_word_embeddings}
    return itemsize * sum(math.prod(shape) * (share or {}).get(name, 1.0) for name, shape in read.items())


def weight_shares(params) -> dict[str, float]:
    """The fraction of each parameter (by its `param_shapes` name) one device holds."""
    return {".".join(str(k) for k in path): math.prod(v.sharding.shard_shape(v.shape)) / math.prod(v.shape)
            for path, v in ((path, v.get_value()) for path, v in nnx.to_flat_state(params))}


def kv_bytes(c: Qwen2Config, rows: int, slots: int, itemsize: int) -> float:
    return 2 * c.num_layers * rows * c.num_kv_heads * c.head_dim * slots * itemsize


def training_parts(c: Qwen2Config, rows: int, t: int, w: int, share: int) -> tuple[float, float, float]:
    """(matmul, attention, head) FLOPs of one `token_logprobs` forward over rows of `t` inputs,
    the head on `w` positions; runs of `share` rows compute their prefix (t - w) once."""
    if share == 1:
        matmul, attention = layer_flops(c, rows, t, 0)
    else:
        m1, a1 = layer_flops(c, rows // share, t - w, 0)
        m2, a2 = layer_flops(c, rows, w, t - w)
        matmul, attention = m1 + m2, a1 + a2
    return matmul, attention, 2 * c.vocab_size * c.hidden_size * rows * w


def recomputed(parts: tuple[float, float, float], remat: str) -> float:
    """What the backward pass recomputes: the head's chunks always (they run under
    jax.checkpoint); the layers' forward under "full"; their attention under "dots_no_batch"."""
    matmul, attention, head = parts
    return head + {"full": matmul + attention, "dots_no_batch": attention}.get(remat, 0.0)


# -- the calls --------------------------------------------------------------------------------

# Decode steps the measured decode loop runs (`sem_jax.aot.measure`): one call per 32 steps.
MEASURED_STEPS = 32


@dataclasses.dataclass(frozen=True)
class _Step:
    """A step's shapes, as the roofline counts them."""
    config: Config
    sampling: SamplingConfig  # training's (no tokenizer: no end ids)
    mcfg: Qwen2Config
    devices: int
    dtype: jnp.dtype    # training's
    compute: jnp.dtype  # the sampler's and the passes' (compute_weights)
    prompts: int
    rows: int
    prompt: int         # the prompt bucket
    response: int
    insert: int         # an insert's width bucket
    micro: int

    @property
    def window(self) -> int:
        return self.prompt + self.response

    @property
    def item(self) -> int:
        return self.compute.itemsize


def analyse(config: Config, devices: list) -> tuple[list[Call], dict, dict[str, Program]]:
    """Compile every call of a step for `devices` (see the module docstring). Returns the calls,
    the step's shapes, and each call's program as the step runs it (`sem_jax.aot.measure`)."""
    if config.lora.rank:
        raise Refused("sem_jax.aot.roofline counts a full fine-tune's calls; for a LoRA config (lora.rank > 0) "
                      "check the fit with sem_jax.aot")
    run = build_compile(config, devices)
    mcfg = run.model_config
    if mcfg.num_layers < 2:
        raise ValueError("the roofline counts one layer as the difference of two compiles: it needs >= 2 layers")
    sampling = config.sampling()
    step = _Step(config=config, sampling=sampling, mcfg=mcfg, devices=len(devices), dtype=jnp.dtype(config.model.dtype),
                 compute=jnp.dtype(config.model.compute_dtype), prompts=config.data.prompts_per_step,
                 rows=config.data.prompts_per_step * config.rollout.group_size,
                 prompt=bucket_length(config.data.max_prompt_tokens), response=sampling.response_tokens,
                 insert=bucket_length(config.inserted_tokens()[0], minimum=8), micro=micro_batch(config))
    calls: list[Call] = []
    programs: dict[str, Program] = {}
    decode, sampler_state, sampler_params, few = _sampler_calls(step, run, devices, calls, programs)
    params, opt, share, t, w = _trainer_calls(step, run, calls, programs)
    n, rows, window, kv = step.devices, step.rows, step.window, sampler_state.cache
    m = decode.memory_analysis()
    shards = batch_shards(run.rollout_mesh)
    floor = partial(decode_floor, rows=rows, window=window, item=step.item, share=weight_shares(sampler_params), n=n)
    per_group = rows // shards  # rows split evenly over the batch shards (hosts.to_global)
    resident = trainer_bytes(params, opt, config)  # held while the sampler runs
    shapes = dict(devices=n, device_kind=devices[0].device_kind, rollout_mesh=dict(run.rollout_mesh.shape), rows=rows,
                  rows_per_group=per_group, group_devices=n // shards,  # a data group: the devices sharing rows
                  prompt=step.prompt, response=step.response, window=window, micro_batch=step.micro,
                  micro_batches=rows // step.micro, share=share, inputs=t, head_positions=w, insert=step.insert,
                  resident=resident,
                  # what a decode step must read in this layout: each device's share of the
                  # weights (all of them under FSDP, gathered at every step) and of the KV window
                  decode_floor=floor(mcfg), decode_split=decode_split(few, mcfg, floor),
                  decode_peak=m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                  - m.alias_size_in_bytes + resident,
                  # per device, from the compiled state's shards (KV heads split over a group, buffers not)
                  decode_state_per_row=device_bytes(sampler_state) / per_group,
                  kv_per_row=device_bytes((kv.k, kv.v)) / per_group * window / kv.max_length)
    return calls, shapes, programs


def _sampler_calls(step: _Step, run: CompileRun, devices: list, calls: list[Call], programs: dict[str, Program]):
    """The rollout's calls (prefill, decode, insert) on the sampler's mesh, counted and measured;
    returns the compiled decode step, the sampler's state and weights, and the decode step's bytes
    at 2 and 4 layers."""
    config, sampling, mcfg, n, item = step.config, step.sampling, step.mcfg, step.devices, step.item
    rollout_mesh, L = run.rollout_mesh, mcfg.num_layers
    g, p, rows, tp, resp, window, wi = (config.rollout.group_size, step.prompts, step.rows, step.prompt,
                                        step.response, step.window, step.insert)
    sampler_dtype = narrower(step.dtype, step.compute)  # the sampler's weights cast to the compute dtype
    # The sampler's layer scan rolled (the program that runs: memory) and unrolled whole (counted).
    sampled = {u: abstract_model(config, mcfg, rollout_mesh, sampler_dtype, scan_unroll=u) for u in (1, L)}
    graphs, sampler_params = {u: m[1] for u, m in sampled.items()}, sampled[1][2]

    def graph(unroll: int):
        """The sampler's graph with its layer scan unrolled `unroll` times (made when first asked)."""
        if unroll not in graphs:
            graphs[unroll] = abstract_model(config, mcfg, rollout_mesh, sampler_dtype, scan_unroll=unroll)[1]
        return graphs[unroll]

    arr = rows_on(rollout_mesh)
    with jax.set_mesh(rollout_mesh):
        key = jax.eval_shape(lambda: jax.random.key(0))
        static = dict(group_size=g, cache_len=window, resp_len=resp, cache_dtype=step.compute)
        prompts, lengths = arr((p, tp), jnp.int32), arr((p,), jnp.int32)
        lower = lambda layers: prefill_step.lower(graph(layers), sampler_params, None, prompts, lengths, key, **static)
        prefill = lower(1).compile()
        calls.append(Call("prefill", 1, **whole_or_counted(lower, L),
                          ideal_flops=forward_flops(mcfg, p, tp, 0, p) / n,
                          ideal_bytes=(weight_bytes(mcfg, item) + kv_bytes(mcfg, p, tp, item)) / n))
        # Measured as the sampler runs them on these devices: with its per-layer weights where it
        # keeps them (CPUs, GPUs: `per_layer_default`); counted above and below as a TPU runs them.
        copies = sampler_layers(graphs[1], sampler_params, devices[0].platform)
        programs["prefill"] = Program(
            prefill_step, (graphs[1], sampler_params, copies, prompts, Filled(lengths, tp), key), static, rollout_mesh)
        sampler_state = jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
            jax.eval_shape(lambda *a: prefill_step(graphs[1], *a, **static), sampler_params, None, prompts, lengths,
                           key),
            prefill.output_shardings)
        table = jax.ShapeDtypeStruct((mcfg.vocab_size, trie_states(config.chat_protocol().stop_strings)), jnp.int32)
        eos = jax.ShapeDtypeStruct((2,), jnp.int32)
        decode = decode_steps.lower(graphs[1], sampler_params, sampler_state, table, eos, cfg=sampling,
                                    window=window, steps=1).compile()
        counts = decode_count(graphs[L], sampler_params, sampler_state, table, eos, sampling, window)
        # The same step with 2 and 4 layers: what one layer and the rest (the head, sampling) read.
        few, kv = {}, sampler_state.cache
        for layers in (2, 4):
            small = dataclasses.replace(mcfg, num_layers=layers)
            _, small_graph, weights = abstract_model(config, small, rollout_mesh, sampler_dtype, scan_unroll=layers)
            stacked = lambda x: jax.ShapeDtypeStruct((layers, *x.shape[1:]), x.dtype, sharding=x.sharding)
            state = dataclasses.replace(sampler_state, cache=dataclasses.replace(kv, k=stacked(kv.k), v=stacked(kv.v)))
            few[layers] = decode_count(small_graph, weights, state, table, eos, sampling, window)["bytes"]
        calls.append(Call(f"decode step (window {window})", sampling.max_new_tokens, **counts,
                          ideal_flops=forward_flops(mcfg, rows, 1, window, rows) / n,
                          ideal_bytes=(weight_bytes(mcfg, item) + kv_bytes(mcfg, rows, window, item)) / n))
        # The sampler's own decode loop: no row stops (the stop table's codes 0, no EOS id).
        steps = min(MEASURED_STEPS, sampling.max_new_tokens)
        ran = lambda out: None if int(out[1][0]) == steps else f"the decode loop ran {int(out[1][0])} of {steps} steps"
        programs[calls[-1].name] = Program(
            decode_loop, (graphs[1], sampler_params, copies, None, Filled(table, 0), Filled(eos, -1),
                          Filled(jax.ShapeDtypeStruct((), jnp.int32), steps)),
            dict(cfg=sampling, window=window), rollout_mesh, state_from={3: "prefill"}, donated=(3,),
            steps=steps, check=ran)
        if config.rollout.max_searches:
            ids, nn, end = arr((rows, wi), jnp.int32), arr((rows,), jnp.int32), arr((rows,), jnp.bool_)
            lower = lambda layers: insert_step.lower(graph(layers), sampler_params, None, sampler_state, ids, nn, end,
                                                     window=window)
            calls.append(Call(f"insert ({wi} tokens)", config.rollout.max_searches, **whole_or_counted(lower, L),
                              ideal_flops=forward_flops(mcfg, rows, wi, window, rows) / n,
                              ideal_bytes=(weight_bytes(mcfg, item) + kv_bytes(mcfg, rows, window + wi, item)) / n))
            programs[calls[-1].name] = Program(
                insert_step, (graphs[1], sampler_params, copies, None, ids, Filled(nn, wi), end), dict(window=window),
                rollout_mesh, state_from={3: "prefill"}, donated=(3,))
    return decode, sampler_state, sampler_params, few


def _trainer_calls(step: _Step, run: CompileRun, calls: list[Call], programs: dict[str, Program]):
    """The update's calls (the reference pass, the update) on the training mesh, counted and
    measured; returns the parameters, the optimizer state, the shared-prompt group, and the
    batch's input and head widths."""
    config, mcfg, n, item, micro = step.config, step.mcfg, step.devices, step.item, step.micro
    mesh, L, resp, steps_m = run.mesh, mcfg.num_layers, step.response, step.rows // step.micro
    models = {1: run.model, 2: abstract_model(config, mcfg, mesh, step.dtype, scan_unroll=2)[0]}
    params = run.params
    arr = rows_on(mesh)
    with jax.set_mesh(mesh):
        trainers = {(1, 1): run.trainer, **{(u, h): build_trainer(config, models[u], mesh, per_layer=False,
                                                                  unroll_head=h) for u, h in ((2, 1), (1, 2))}}
        share = trainers[1, 1].share
        opt_shapes = jax.eval_shape(trainers[1, 1].tx.init, params)
        opt = placed(opt_shapes, match_param_shardings(opt_shapes, params, mesh))
        batch = {k: arr(shape, dt) for k, (shape, dt) in
                 widest_batch(micro, config.data.max_prompt_tokens, resp).items()}
        t, w = batch["inputs"].shape[1], batch["targets"].shape[1]
        loops = {"layers": L, "head": w // head_chunk(w, config.rl.logprob_chunk)}
        parts = training_parts(mcfg, micro, t, w, share)
        start = Filled(batch["start"], t - w)  # each row's response window ends its inputs
        fwd = sum(parts)
        ref = arr((micro, w), jnp.float32) if config.rl.beta > 0 else None
        if ref is not None:
            lp_in = {k: batch[k] for k in LOGPROB_KEYS if k in batch}
            ref_params = abstract_model(config, mcfg, mesh, narrower(step.dtype, step.compute))[2]  # train.reference_weights
            lower = lambda layers, head: trainers[layers, head].logprobs_fn.lower(ref_params, lp_in)
            calls.append(Call(f"reference pass ({micro} rows)", steps_m, **counted(lower, loops),
                              ideal_flops=fwd / n, ideal_bytes=weight_bytes(mcfg, item) / n, part="update"))
            programs[calls[-1].name] = Program(trainers[1, 1].logprobs_fn, (ref_params, dict(lp_in, start=start)),
                                               {}, mesh)
        lower = lambda layers, head: trainers[layers, head].update_fn.lower(params, opt, batch, ref)
        calls.append(Call(f"update ({micro} rows)", steps_m, **counted(lower, loops),
                          ideal_flops=3 * fwd / n, ideal_bytes=0.0, part="update",
                          remat_flops=(3 * fwd + recomputed(parts, config.model.remat)) / n))
        programs[calls[-1].name] = Program(trainers[1, 1].update_fn, (params, opt, dict(batch, start=start), ref), {},
                                           mesh, donated=(0, 1))
    return params, opt, share, t, w


def decode_count(graphdef, params, state, stop_table, eos_ids, cfg, window: int) -> dict[str, float]:
    """One decode step's cost: a loop of two steps per iteration less a loop of one (the layer
    scan unrolled whole in `graphdef`)."""
    one, two = (cost(decode_steps.lower(graphdef, params, state, stop_table, eos_ids, cfg=cfg, window=window,
                                        steps=k).compile()) for k in (1, 2))
    return {k: two[k] - one[k] for k in one}


def decode_floor(c: Qwen2Config, *, rows: int, window: int, item: int, share: dict[str, float], n: int) -> float:
    """What a decode step must read per device: its `share` of each weight (`weight_shares`) and
    of the KV window (the window's rows and KV heads split over all `n` devices)."""
    return weight_bytes(c, item, share) + kv_bytes(c, rows, window, item) / n


def decode_split(few: dict[int, float], c: Qwen2Config, floor) -> dict[str, float]:
    """A decode step's bytes per layer and for the rest (embedding, final norm, LM head, sampling)
    from its counts with 2 and 4 layers, each beside its part of `floor(config)`."""
    per_layer = (few[4] - few[2]) / 2
    rest_floor = floor(dataclasses.replace(c, num_layers=0))
    return dict(per_layer=per_layer, per_layer_floor=floor(dataclasses.replace(c, num_layers=1)) - rest_floor,
                rest=few[2] - 2 * per_layer, rest_floor=rest_floor)


# -- the report -------------------------------------------------------------------------------

def step_seconds(calls: list[Call], chip: Chip, time=Call.seconds) -> dict[str, float]:
    """Seconds per step of the rollout's and the update's calls, each call taking `time(call, chip)`
    (`Call.seconds`: the prediction; `Call.floor`)."""
    out = {"rollout": 0.0, "update": 0.0}
    for c in calls:
        out[c.part] += c.per_step * time(c, chip)
    return out


def decode_batch(calls: list[Call], shapes: dict, hbm: float) -> dict:
    """How many rollout rows per data group (the devices that share a row) the decode step should
    run: as many as the HBM left beside its peak holds (each row's sampler state: KV cache and
    buffers), and no more than the row count at which it turns compute-bound on each chip (the
    ridge: FLOPs grow with the rows, the bytes of the weights do not). Tokens/s per device."""
    d = next(c for c in calls if c.name.startswith("decode step"))
    now, group = shapes["rows_per_group"], shapes["group_devices"]
    fit = now + max(0, int((hbm - shapes["decode_peak"]) // shapes["decode_state_per_row"]))
    f_row, kv_row = d.flops / now, shapes["kv_per_row"]
    fixed = max(d.bytes - kv_row * now, 0.0)
    out = dict(now=now, fit=fit, hbm=hbm, chips={})
    for name, chip in CHIPS.items():
        slope = f_row * chip.hbm / chip.flops - kv_row
        ridge = fixed / slope if slope > 0 else math.inf
        rows = max(now, fit if math.isinf(ridge) else min(fit, math.floor(ridge)))
        sec = lambda b: max(f_row * b / chip.flops, (fixed + kv_row * b) / chip.hbm)
        out["chips"][name] = dict(ridge=ridge, rows=rows, tokens_per_s_now=now / sec(now) / group,
                                  tokens_per_s=rows / sec(rows) / group)
    return out


def summary(calls: list[Call], shapes: dict) -> dict:
    """Everything `report` prints, as plain data (`--json`)."""
    chips = {}
    for name, chip in CHIPS.items():
        t = step_seconds(calls, chip)
        per_call = {}
        for c in calls:
            sec = c.seconds(chip)
            per_call[c.name] = dict(ms=1e3 * sec, mfu=c.ideal_flops / (sec * chip.flops) if sec else 0.0,
                                    bandwidth=c.ideal_bytes / (sec * chip.hbm) if sec else 0.0,
                                    bound=c.bound(chip), ici_ms=1e3 * c.ici / chip.ici)
        chips[name] = dict(calls=per_call, rollout_s=t["rollout"], update_s=t["update"],
                           step_s=t["rollout"] + t["update"])
    return dict(shapes=shapes, calls=[dataclasses.asdict(c) for c in calls], chips=chips)


def report(calls: list[Call], shapes: dict, label: str, hbm: float, group_size: int) -> dict:
    data = summary(calls, shapes)
    print(f"{label}: roofline per device ({shapes['devices']} devices; the sampler's mesh {shapes['rollout_mesh']}, "
          f"{shapes['rows_per_group']:g} rollout rows per data group of {shapes['group_devices']}; "
          f"{shapes['micro_batches']} micro-batches of {shapes['micro_batch']})")
    print("| call | per step | GFLOP (XLA) | ideal | XLA / ideal | GB (XLA) | ideal | XLA / ideal | GB sent (ICI) |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratio = lambda a, b: f"{a / b:.2f}" if b else "-"
    for c in calls:
        ideal = c.remat_flops or c.ideal_flops
        note = " (with remat)" if c.remat_flops else ""
        mark = " *" if c.undercounted else ""
        print(f"| {c.name} | {c.per_step} | {c.flops / 1e9:.1f}{mark} | {ideal / 1e9:.1f}{note} | "
              f"{ratio(c.flops, ideal)} | {c.bytes / 1e9:.2f} | {c.ideal_bytes / 1e9:.2f} | "
              f"{ratio(c.bytes, c.ideal_bytes)} | {c.ici / 1e9:.3f} |")
    if any(c.undercounted for c in calls):
        print("* under half the model's FLOPs: XLA's count misses work handed to libraries (XLA:GPU counts no cuBLAS "
              "gemm), so the times predicted from it below are no bound for those calls")
    d = next(c for c in calls if c.name.startswith("decode step"))
    print(f"\nthe decode step in the sampler's layout reads at least {shapes['decode_floor'] / 1e9:.2f} GB per device "
          f"(its share of each weight as the sampler's mesh places them, of the KV window over all devices): XLA's count "
          f"is {d.bytes / shapes['decode_floor']:.2f}x that")
    sp = shapes["decode_split"]
    print(f"counted with 2 and 4 layers: {sp['per_layer'] / 1e6:.0f} MB per layer (floor {sp['per_layer_floor'] / 1e6:.0f}), "
          f"{sp['rest'] / 1e6:.0f} MB for the embedding, final norm, LM head and sampling (floor "
          f"{sp['rest_floor'] / 1e6:.0f})")
    names = list(CHIPS)
    print("\npredicted ms per call, the largest of FLOPs / peak, bytes / HBM bandwidth and bytes sent / ICI "
          "bandwidth (MFU: the model's FLOPs; BW: the ideal bytes)")
    print("| call | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for c in calls:
        cells = []
        for name in names:
            x = data["chips"][name]["calls"][c.name]
            util = f"MFU {x['mfu']:.0%}" if c.part == "update" else f"BW {x['bandwidth']:.0%}"
            cells.append(f"{x['ms']:.2f} ({util})")
        print(f"| {c.name} | " + " | ".join(cells) + " |")
    for part in ("rollout", "update", "step"):
        print(f"| {part} (s) | " + " | ".join(f"{data['chips'][n][part + '_s']:.1f}" for n in names) + " |")
    print("\nthe decode step's collectives (each waits on the matmul before it, so they are not hidden) add "
          + ", ".join(f"{n} {data['chips'][n]['calls'][d.name]['ici_ms']:.2f}" for n in names)
          + " ms to it if none overlaps")
    b = data["decode_batch"] = decode_batch(calls, shapes, hbm)
    shards = shapes["rows"] / shapes["rows_per_group"]
    print(f"\ndecode batch: {b['now']:g} rows per data group now; the {hbm / 2**30:.1f} GiB HBM holds about {b['fit']} "
          f"(the decode step peaks at {shapes['decode_peak'] / 2**30:.2f} GiB with the trainer's "
          f"{shapes['resident'] / 2**30:.2f} GiB beside it, "
          f"{shapes['decode_state_per_row'] / 2**20:.1f} MiB of sampler state per row)")
    for name, x in b["chips"].items():
        ridge = "never (the KV window's bytes grow as fast)" if math.isinf(x["ridge"]) else f"{x['ridge']:.0f} rows"
        prompts = math.ceil(x["rows"] * shards / group_size)
        print(f"  {name}: compute-bound from {ridge}; {x['rows']} rows per group (data.prompts_per_step "
              f"~{prompts}) -> {x['tokens_per_s']:.0f} tokens/s per device, against {x['tokens_per_s_now']:.0f} now")
    return data


def engine_rollout(data: dict, calls: list[Call], occupancy: float, mean_tokens: float) -> dict:
    """The rollout's seconds per chip with the rollout engine's decode steps in place of
    `max_new_tokens`: rows of `mean_tokens` sampled tokens each, in slots that decode a row
    `occupancy` of the time (both measured: `scripts/bench_rollout.py`), take mean_tokens /
    occupancy decode steps per slot's worth of rows. Each step still costs the full-window decode
    step, so it is an upper bound for the decode part."""
    d = next(c for c in calls if c.name.startswith("decode step"))
    steps = mean_tokens / occupancy
    out = dict(occupancy=occupancy, mean_tokens=mean_tokens, decode_steps=steps, chips={})
    print(f"\nwith the rollout engine at a measured occupancy of {occupancy:.0%} and {mean_tokens:g} sampled tokens a "
          f"row: {steps:.0f} decode steps a step, not {d.per_step}")
    for name, chip in CHIPS.items():
        sec = data["chips"][name]["rollout_s"] + (steps - d.per_step) * d.seconds(chip)
        out["chips"][name] = dict(rollout_s=sec, step_s=sec + data["chips"][name]["update_s"])
        print(f"  {name}: rollout {data['chips'][name]['rollout_s']:.1f} s -> {sec:.1f} s, step "
              f"{data['chips'][name]['step_s']:.1f} s -> {sec + data['chips'][name]['update_s']:.1f} s")
    return out


def write_json(data: dict, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(data, fh, indent=2, default=lambda x: x if math.isfinite(x) else None)
        fh.write("\n")
