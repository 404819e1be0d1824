"""Compile-only check that a config fits its target, before anyone pays for a pod.

    python -m sem_jax.aot --config configs/tpu_v4.py --topology v4:2x2x4
    python -m sem_jax.aot --config configs/tpu_v4.py:14b --topology v4:4x4x4

With `jax[tpu]` installed on a CPU host (no TPU needed), builds the topology's devices,
the config's mesh and shardings, and compiles the GRPO update, the reference log-prob pass
and the sampler's prefill, decode and insert (on the sampler's own mesh, `rollout.tensor`) with
abstract inputs at the config's real shapes, with `rollout.slots` the continuous engine's own
programs (prompt cache, empty slots, decode loop at the slots' width, refill with admissions,
narrowing), and the sampler again as `sem_jax.evaluate` runs it (greedy, one row per question, the
parameters in `model.eval_dtype`).
Prints per-device memory (arguments, outputs, temporaries, and beside the training rollout the
trainer's parameters, optimizer state and reference weights: `resident`) against HBM and FLOPs per call
(XLA counts every loop body once, the layer scan too: they only compare configs); exits 1
when something does not fit, including when the TPU compiler itself refuses for lack of HBM.
Without --topology it compiles for the local devices. `--roofline` prints XLA's FLOPs and bytes
per call against the ideal and predicted times per chip instead (`sem_jax.aot.roofline`).
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from sem_jax.aot import measure, roofline
from sem_jax.assemble import abstract_model, build_compile, model_config
from sem_jax.config import parse_flags
from sem_jax.model import Qwen2Config
from sem_jax.model import lora as lora_lib
from sem_jax.aot.programs import (cost, device_bytes, hbm_per_device, narrower, placed, rows_on, sampler_layers,
                                  target_devices, trainer_bytes)
from sem_jax.rl.batch import widest_batch
from sem_jax.rl.trainer import LOGPROB_KEYS
from sem_jax.hosts import batch_shards, local_batch_multiple
from sem_jax.sampling.sampler import (bucket_length, decode_loop, empty_state, insert_step, prefill_step, prompt_cache,
                                      refill_step, take_slots)
from sem_jax.sampling.rollout import can_halve
from sem_jax.sampling.stop import trie_states
from sem_jax.config import Config, load
from sem_jax.sharding import match_param_shardings


@dataclasses.dataclass
class Row:
    name: str
    argument: int
    output: int
    temp: int
    alias: int
    flops: float
    error: str = ""  # the compiler refused (e.g. RESOURCE_EXHAUSTED: out of HBM)
    resident: int = 0  # held by others while this call runs (the trainer's state during the rollout)

    @property
    def peak(self) -> int:
        return self.argument + self.output + self.temp - self.alias + self.resident


def _compile(name: str, lowered) -> tuple[Row, object | None]:
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return Row(name, 0, 0, 0, 0, 0.0, error=str(e).split("\n")[0]), None
    return _row(name, compiled), compiled


def _row(name: str, compiled) -> Row:
    m = compiled.memory_analysis()
    return Row(name, m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes,
               m.alias_size_in_bytes, cost(compiled)["flops"])


def check(config: Config, topology: str | None = None, hbm_gib: float | None = None) -> tuple[list[Row], float]:
    """Compile every step function for the target; returns the rows and HBM bytes per device."""
    devices = target_devices(topology)
    hbm = hbm_per_device(devices, hbm_gib)
    run = build_compile(config, devices)
    mesh, rollout_mesh, mcfg, params, trainer = run.mesh, run.rollout_mesh, run.model_config, run.params, run.trainer
    dtype, compute = jnp.dtype(config.model.dtype), jnp.dtype(config.model.compute_dtype)
    g = config.rollout.group_size
    rows_n = config.data.prompts_per_step * g
    out: list[Row] = []
    with jax.set_mesh(mesh):
        base = None
        if trainer.lora is not None:  # the adapters train, whole on every device; the base is frozen
            base, params = params, lora_lib.abstract_adapters(trainer.lora, mcfg, NamedSharding(mesh, PartitionSpec()))
        opt_shapes = jax.eval_shape(trainer.tx.init, params)
        opt = placed(opt_shapes, match_param_shardings(opt_shapes, params, mesh))
        # The widest batch `build_batch` makes: the prompts' cap, the sampled budget and the room for
        # every search's inserted results.
        arr = rows_on(mesh)
        batch = {k: arr(shape, dt) for k, (shape, dt) in
                 widest_batch(rows_n, config.data.max_prompt_tokens, config.sampling().response_tokens).items()}
        ref = arr(batch["targets"].shape, jnp.float32) if config.rl.beta > 0 else None
        out.append(_compile("grpo update", trainer.update_fn.lower(params, opt, batch, ref, base))[0])
        if ref is not None:
            lp_in = {k: batch[k] for k in LOGPROB_KEYS if k in batch}  # no packed rows in GRPO
            # train.reference_weights; with LoRA the base itself
            ref_params = base if base is not None else abstract_model(config, mcfg, mesh, narrower(dtype, compute))[2]
            out.append(_compile("reference logprobs", trainer.logprobs_fn.lower(ref_params, lp_in))[0])
    # The rollout runs beside the trainer's state; sem_jax.evaluate holds nothing but the sampler's
    # own arguments.
    trainer_state = trainer_bytes(params, opt, config, base)
    p = config.data.prompts_per_step
    # The sampler casts the weights to the compute dtype (`compute_weights`) in its own layout
    # (`build_rollout_mesh`); sem_jax.evaluate samples greedily, one row per question, from
    # parameters in model.eval_dtype.
    evaluated = jnp.dtype(config.model.evaluated_dtype)
    with jax.set_mesh(rollout_mesh):
        for label, prompts_n, group, param_dtype, resident in (
                ("sampler", p, g, dtype, trainer_state), (f"eval ({evaluated.name})", p * g, 1, evaluated, 0)):
            _, sampler_graph, sampler_params = abstract_model(config, mcfg, rollout_mesh,
                                                              narrower(param_dtype, compute))
            layers = sampler_layers(sampler_graph, sampler_params, devices[0].platform)
            rows = sampler_rows(label, sampler_graph, sampler_params, layers, prompts_n, group, config, mcfg,
                                rows_on(rollout_mesh))
            out += [dataclasses.replace(r, resident=resident) for r in rows]
            if group > 1:  # training's rollout: the continuous engine's own programs, with rollout.slots
                out += engine_rows(sampler_graph, sampler_params, layers, prompts_n, group, config, mcfg,
                                   rollout_mesh, resident)
    return out, hbm


@dataclasses.dataclass(frozen=True)
class _SamplerShapes:
    """What every sampler program is compiled at: the prompt bucket, the response buffer, the
    cache dtype, the widest insert, and the abstract key and stop table."""
    prompt: int
    resp: int
    compute: jnp.dtype
    insert: int
    key: jax.ShapeDtypeStruct
    table: jax.ShapeDtypeStruct

    @classmethod
    def of(cls, config: Config, mcfg: Qwen2Config) -> "_SamplerShapes":
        return cls(prompt=bucket_length(config.data.max_prompt_tokens), resp=config.sampling().response_tokens,
                   compute=jnp.dtype(config.model.compute_dtype),
                   insert=bucket_length(config.inserted_tokens()[0], minimum=8),
                   key=jax.eval_shape(lambda: jax.random.key(0)),
                   table=jax.ShapeDtypeStruct((mcfg.vocab_size, trie_states(config.chat_protocol().stop_strings)), jnp.int32))


def sampler_rows(label: str, graphdef, params, layers, prompts_n: int, group: int, config: Config,
                 mcfg: Qwen2Config, arr) -> list[Row]:
    """The sampler's prefill, decode loop and (with searches) insert for `prompts_n` prompts x
    `group` rows each, with its per-layer weights `layers` (`sampler_layers`) or the layer scan."""
    sh = _SamplerShapes.of(config, mcfg)
    tp, resp, compute, key, table, wi = sh.prompt, sh.resp, sh.compute, sh.key, sh.table, sh.insert
    static = dict(group_size=group, cache_len=tp + resp, resp_len=resp, cache_dtype=compute)
    prompts, lengths = arr((prompts_n, tp), jnp.int32), arr((prompts_n,), jnp.int32)
    row, prefill = _compile(f"{label} prefill", prefill_step.lower(graphdef, params, layers, prompts, lengths, key,
                                                                   **static))
    if prefill is None:  # the decode loop's input state comes from the prefill
        return [row]
    state = placed(jax.eval_shape(lambda *a: prefill_step(graphdef, *a, **static), params, layers, prompts,
                                     lengths, key), prefill.output_shardings)
    rows = [row, _compile(f"{label} decode loop", decode_loop.lower(
        graphdef, params, layers, state, table, jax.ShapeDtypeStruct((2,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32), cfg=config.sampling(), window=tp + resp))[0]]
    if config.rollout.max_searches:  # a search's results, the widest block, into the full cache
        b = prompts_n * group
        rows.append(_compile(f"{label} insert ({wi} tokens)", insert_step.lower(
            graphdef, params, layers, state, arr((b, wi), jnp.int32), arr((b,), jnp.int32), arr((b,), jnp.bool_),
            window=tp + resp))[0])
    return rows


def engine_rows(graphdef, params, layers, prompts_n: int, group: int, config: Config, mcfg: Qwen2Config,
                mesh, resident: int) -> list[Row]:
    """With rollout.slots under the step's rows: the programs the continuous engine runs besides
    `sampler_rows`' prefill (`sampling/rollout.py`): the prompt cache (held through the rollout,
    so counted as resident beside the others), the empty slots, the decode loop at the slots'
    width, a refill that appends to every slot and admits a row into each, and (rollout.narrow,
    an unsplit batch, slots at least twice rollout.narrow_floor) the halving of the slots."""
    rows_n, multiple = prompts_n * group, local_batch_multiple(mesh)
    if not config.rollout.slots or config.rollout.slots >= rows_n:
        return []
    width = -(-config.rollout.slots // multiple) * multiple  # as `Engine.run` rounds it
    arr = rows_on(mesh)
    sh = _SamplerShapes.of(config, mcfg)
    tp, resp, compute, key, table, wi = sh.prompt, sh.resp, sh.compute, sh.key, sh.table, sh.insert
    per = -(-prompts_n // multiple) * multiple  # `Sampler.prefill_prompts` pads the prompts so
    prompts, lengths = arr((per, tp), jnp.int32), arr((per,), jnp.int32)
    label = f"engine, {width} slots"
    row, cache = _compile(f"{label}: prompt cache", prompt_cache.lower(graphdef, params, layers, prompts, lengths,
                                                                       cache_dtype=compute))
    if cache is None:
        return [row]
    prompt_kv = placed(jax.eval_shape(lambda *a: prompt_cache(graphdef, *a, cache_dtype=compute), params, layers,
                                      prompts, lengths), cache.output_shardings)
    resident += device_bytes(prompt_kv)
    static = dict(slots=width, cache_len=tp + resp, resp_len=resp, cache_dtype=compute, per_layer=layers is not None)
    row_e, empty = _compile(f"{label}: empty slots", empty_state.lower(graphdef, params, key, **static))
    out = [row, row_e]
    if empty is None:
        return [dataclasses.replace(r, resident=resident) for r in out]
    state = placed(jax.eval_shape(lambda *a: empty_state(graphdef, *a, **static), params, key), empty.output_shardings)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    out.append(_compile(f"{label}: decode loop", decode_loop.lower(
        graphdef, params, layers, state, table, jax.ShapeDtypeStruct((2,), jnp.int32), scalar, None,
        jax.ShapeDtypeStruct((2,), jnp.int32), cfg=config.sampling(), window=tp + resp))[0])
    admit = (*prompt_kv, arr((width,), jnp.int32), arr((width,), jnp.int32))
    out.append(_compile(f"{label}: refill ({wi} tokens, admissions)", refill_step.lower(
        graphdef, params, layers, state, None, arr((width, wi), jnp.int32), arr((width,), jnp.int32),
        arr((width,), jnp.bool_), arr((width,), jnp.bool_), admit, window=tp + resp))[0])
    # `Sampler.can_narrow` (one process), and a halving above the floor.
    if config.rollout.narrow and batch_shards(mesh) == 1 and can_halve(width, config.rollout.narrow_floor):
        half = jax.ShapeDtypeStruct((width // 2,), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))
        out.append(_compile(f"{label}: narrowed to {width // 2}", take_slots.lower(state, half))[0])
    return [dataclasses.replace(r, resident=resident) for r in out]


def report(rows: list[Row], hbm: float, label: str) -> bool:
    gib = lambda b: b / 2**30
    print(f"{label}: per-device memory (GiB) against {gib(hbm):.1f} GiB HBM")
    print("| step | arguments | outputs | temporaries | aliased | resident | peak | fits | GFLOPs/device |")
    print("|---|---|---|---|---|---|---|---|---|")
    ok = True
    for r in rows:
        if r.error:
            ok = False
            print(f"| {r.name} | compiler: {r.error} | | | | | | NO | |")
            continue
        fits = r.peak <= hbm
        ok &= fits
        print(f"| {r.name} | {gib(r.argument):.2f} | {gib(r.output):.2f} | {gib(r.temp):.2f} | {gib(r.alias):.2f} | "
              f"{gib(r.resident):.2f} | {gib(r.peak):.2f} | {'yes' if fits else 'NO'} | {r.flops / 1e9:.1f} |")
    return ok


def define_flags():
    """Flags exist only when run as a program (importing this module registers none)."""
    global _CONFIG
    _CONFIG = config_flags.DEFINE_config_file("config", None, "Training config to check.")
    flags.DEFINE_string("topology", None, "TPU topology, e.g. v4:2x2x4 (needs jax[tpu]); default: local devices")
    flags.DEFINE_float("hbm_gib", None, "HBM per device in GiB (default: from the device kind)")
    flags.DEFINE_bool("roofline", False, "Instead of the fit check: XLA's FLOPs and bytes per call against the "
                      "ideal, and predicted times per chip (sem_jax.aot.roofline)")
    flags.DEFINE_string("json", None, "With --roofline: also write its figures to this JSON file")
    flags.DEFINE_float("occupancy", 0.0, "With --roofline: the rollout engine's measured slot occupancy "
                       "(scripts/bench_rollout.py); the rollout predicted at it, with --mean_tokens a row")
    flags.DEFINE_float("mean_tokens", 0.0, "With --occupancy: sampled tokens per row")
    flags.DEFINE_bool("measure", False, "With --roofline: also run each call on the local devices and time it, "
                      "beside the prediction (sem_jax.aot.measure)")
    flags.DEFINE_integer("repeats", 3, "With --measure: timed runs per call (after one that compiles)")
    flags.DEFINE_string("hlo_dir", None, "With --measure: write each call's optimized HLO, as this backend "
                        "compiled it, to this directory")
    flags.DEFINE_string("profile_dir", None, "With --measure: run each call once more under the profiler (traces "
                        "there) and print its time by XLA op")
    flags.DEFINE_string("chip", None, "With --measure: the roofline's chip to set the times beside (default: "
                        "from the device kind)")


FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.ERROR)
    if _CONFIG.value is None:
        raise app.UsageError("--config is required")
    config = load(_CONFIG.value)
    label = f"{FLAGS.topology or jax.devices()[0].device_kind} mesh {dataclasses.asdict(config.mesh)}"
    if config.rollout.tensor:
        label += f", rollout in tensor-parallel groups of {config.rollout.tensor}"
        if config.rollout.spread:
            label += " (the MLP and LM head split over all of them)"
    if FLAGS.roofline:
        roofline.set_analysis_flags()
        devices = target_devices(FLAGS.topology)
        calls, shapes, programs = roofline.analyse(config, devices)
        mcfg = model_config(config)
        data = roofline.report(calls, shapes, label, hbm_per_device(devices, FLAGS.hbm_gib),
                               config.rollout.group_size)
        if FLAGS.occupancy:
            data["engine"] = roofline.engine_rollout(data, calls, FLAGS.occupancy, FLAGS.mean_tokens)
        if FLAGS.measure:
            if FLAGS.topology:
                raise app.UsageError("--measure runs the calls on the local devices: drop --topology")
            chip = FLAGS.chip or measure.chip_of(devices[0].device_kind)
            if chip is not None and chip not in roofline.CHIPS:
                raise app.UsageError(f"--chip {chip!r}: the roofline knows {sorted(roofline.CHIPS)}")
            print(f"\nrunning each call on {devices[0].device_kind}: one run to compile, then {FLAGS.repeats} timed")
            runs = measure.run(programs, mcfg.vocab_size, FLAGS.repeats, hlo_dir=FLAGS.hlo_dir,
                               profile_dir=FLAGS.profile_dir)
            data["measured"] = measure.compare(calls, runs, chip, roofline.CHIPS.get(chip))
            data["measured"].update(device_kind=devices[0].device_kind, devices=len(devices), runs=runs)
            measure.report(calls, data["measured"], f"{devices[0].device_kind} ({len(devices)} device(s))")
            measure.report_ops(runs)
        if FLAGS.json:
            roofline.write_json(data, FLAGS.json)
        return
    rows, hbm = check(config, FLAGS.topology, FLAGS.hbm_gib)
    ok = report(rows, hbm, label)
    if not ok:
        print("DOES NOT FIT: shrink micro_batch / max_new_tokens, add remat, or use more devices", file=sys.stderr)
        sys.exit(1)
    print("fits")


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
