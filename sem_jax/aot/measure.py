"""The roofline's calls run on the local devices and timed: measured beside predicted.

    python -m sem_jax.aot --config configs/gpu.py --roofline --measure [--chip H200] [--json FILE]

`sem_jax.aot.roofline.analyse` names, for each call it counts, the program a step runs (loops rolled)
and its abstract arguments (`Program`). Here every argument gets a value on the devices it is
placed on (the weights random, token ids random, lengths full: shapes are static, so the work
done does not depend on the values), each program runs once to compile, then `repeats` times,
and the median wall time (to `block_until_ready`) is the measurement. The decode step is timed
as the sampler's own decode loop running `Program.steps` steps, divided by them.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from sem_jax.aot.programs import Filled, Program
from sem_jax.aot.roofline import Call, step_seconds


def _leaf_value(leaf, key, vocab: int):
    value = None
    if isinstance(leaf, Filled):
        leaf, value = leaf.like, leaf.value
    if not isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    shape, dtype, sharding = leaf.shape, leaf.dtype, leaf.sharding
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        make = lambda k: k  # noqa: E731
    elif jnp.issubdtype(dtype, jnp.floating):  # |N(0, 0.02)|: weights, moments (>= 0), masks, log-probs alike
        make = lambda k: jnp.abs(0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)  # noqa: E731
    elif jnp.issubdtype(dtype, jnp.integer):
        make = ((lambda k: jnp.full(shape, value, dtype)) if value is not None  # noqa: E731
                else (lambda k: jax.random.randint(k, shape, 0, vocab, dtype)))
    elif dtype == jnp.bool_:
        make = lambda k: jnp.zeros(shape, bool)  # noqa: E731
    else:
        raise TypeError(f"no value for an argument of dtype {dtype}")
    return jax.jit(make, out_shardings=sharding)(key)


def concrete(tree, key, vocab: int = 1):
    """`tree` with every ShapeDtypeStruct (or `Filled`) replaced by an array of its shape, dtype
    and sharding: floats |N(0, 0.02)|, integers token ids below `vocab` (or the `Filled` value),
    booleans False."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, Filled))
    keys = jax.random.split(key, max(len(leaves), 1))
    return jax.tree.unflatten(treedef, [_leaf_value(x, k, vocab) for x, k in zip(leaves, keys)])


def _copy(tree):
    return jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, tree)


def run(programs: dict[str, Program], vocab: int, repeats: int = 3, log: Callable[[str], None] = print,
        hlo_dir: str | None = None, profile_dir: str | None = None) -> dict[str, dict]:
    """Each program compiled once, then timed `repeats` times: {name: {ms (per unit), runs_ms, compile_s}}.
    Integer arguments not `Filled` are token ids below `vocab`. With `hlo_dir`, each program's
    optimized HLO as this backend compiled it goes there (`<call>.hlo.txt`). With `profile_dir`, one
    more run of each under the profiler (`<profile_dir>/<call>/`, not timed) and its time by XLA
    op, per unit (`ops`: `op_times`)."""
    if jax.process_count() > 1:
        raise ValueError("measuring runs the calls on this process's devices alone: run it with one process")
    outputs, out, made = {}, {}, {}  # made: one value per abstract argument (the weights shared by calls)
    needed = {src for p in programs.values() for src in p.state_from.values()}
    key = jax.random.key(0)
    for name, p in programs.items():
        with jax.set_mesh(p.mesh):
            args = []
            for i, a in enumerate(p.args):
                if i in p.state_from:
                    args.append(outputs[p.state_from[i]])
                    continue
                if id(a) not in made:
                    key, sub = jax.random.split(key)
                    made[id(a)] = (a, concrete(a, sub, vocab))  # `a` kept: its id stays its own
                args.append(made[id(a)][1])
            # A donated argument is consumed by the call: each run gets a copy of its own (not timed).
            fresh = lambda: [_copy(a) if i in p.donated else a for i, a in enumerate(args)]  # noqa: E731
            t0 = time.perf_counter()
            result = jax.block_until_ready(p.fn(*fresh(), **p.kwargs))
            compile_s = time.perf_counter() - t0
            if p.check and (err := p.check(result)):
                raise RuntimeError(f"{name}: {err}")
            if name in needed:  # others' outputs are dropped: device memory for the calls after
                outputs[name] = result
            del result
            file = re.sub(r"\W+", "_", name).strip("_")
            if hlo_dir:
                os.makedirs(hlo_dir, exist_ok=True)
                with open(os.path.join(hlo_dir, file + ".hlo.txt"), "w") as fh:
                    fh.write(p.fn.lower(*args, **p.kwargs).compile().as_text())
            ops = None
            if profile_dir:
                run_args = jax.block_until_ready(fresh())
                try:  # a profiler that cannot start (no CUPTI) costs the breakdown, not the timings
                    with jax.profiler.trace(os.path.join(profile_dir, file), create_perfetto_trace=True):
                        jax.block_until_ready(p.fn(*run_args, **p.kwargs))
                    ops = {op: us / 1e3 / p.steps for op, us in op_times(os.path.join(profile_dir, file)).items()}
                except Exception as e:  # noqa: BLE001 - reported, and the measurement goes on
                    log(f"  profiling {name} failed ({type(e).__name__}: {e}); its time by op is left out")
                del run_args
            runs = []
            for _ in range(repeats):
                run_args = jax.block_until_ready(fresh())
                t0 = time.perf_counter()
                jax.block_until_ready(p.fn(*run_args, **p.kwargs))
                runs.append(time.perf_counter() - t0)
                del run_args
        ms = 1e3 * statistics.median(runs) / p.steps
        out[name] = dict(ms=ms, runs_ms=[1e3 * r / p.steps for r in runs], compile_s=compile_s, steps=p.steps)
        if ops is not None:
            out[name]["ops_ms"] = ops
        log(f"  measured {name}: {ms:.3f} ms per {'step' if p.steps > 1 else 'call'} "
            f"(median of {repeats}; compile and first run {compile_s:.1f} s)")
    return out


def op_times(trace_dir: str) -> dict[str, float]:
    """Microseconds by XLA op (or kernel) in the newest profiler trace under `trace_dir`
    (`jax.profiler.trace(create_perfetto_trace=True)`), largest first: a device's "XLA Ops" line
    where the trace has one (GPU, TPU), else its kernels; on a CPU host, the XLA client's threads."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
    if not paths:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}: was it traced with create_perfetto_trace=True?")
    with gzip.open(paths[-1]) as fh:
        data = json.load(fh)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {}  # (pid, tid or None) -> process or thread name
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e["pid"], e.get("tid") if e["name"] == "thread_name" else None)] = e.get("args", {}).get("name", "")
    devices = {pid for (pid, tid), n in names.items() if tid is None and n.startswith("/device:")}
    busy = {(e["pid"], e.get("tid")) for e in events if e.get("ph") == "X"}
    ops_lines = {key for key, n in names.items() if key[0] in devices and n == "XLA Ops" and key in busy}
    skip = ("XLA Modules", "Steps", "XLA TraceMe", "Framework Name Scope", "Framework Ops", "Source code")

    def counted(e) -> bool:
        key = (e["pid"], e.get("tid"))
        if ops_lines:
            return key in ops_lines
        if devices:
            return e["pid"] in devices and not names.get(key, "").startswith(skip)
        return names.get(key, "").startswith("tf_XLA")  # XLA:CPU's client and its thread pool
    total = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and counted(e):
            total[e["name"]] += float(e.get("dur", 0.0))
    return dict(total.most_common())


# jax's device kinds, by the CHIPS entry each is (the longest name that a kind holds wins).
KINDS = {"tpu v4": "v4", "tpu v5 lite": "v5e", "tpu v5": "v5p", "tpu v6 lite": "v6e", "h100": "H100", "h200": "H200"}


def chip_of(device_kind: str) -> str | None:
    """The CHIPS entry for a jax device kind ('NVIDIA H200', 'TPU v5 lite', ...), or None."""
    kind = device_kind.lower()
    hits = [k for k in KINDS if k in kind]
    return KINDS[max(hits, key=len)] if hits else None


def compare(calls: list, measured: dict[str, dict], chip_name: str | None, chip=None) -> dict:
    """Per call (`roofline.Call`): measured ms and the FLOP/s and bytes/s XLA's counts imply; with a
    chip (`roofline.Chip`) the prediction from XLA's counts and the floor from the ideal ones (the
    model's FLOPs and bytes at the chip's peaks), each against the measurement, and the MFU and
    bandwidth utilisation measured; the step from its calls."""

    seconds = lambda c, _: measured[c.name]["ms"] / 1e3  # noqa: E731
    step = {"measured_s": sum(step_seconds(calls, chip, seconds).values()), "predicted_s": 0.0, "floor_s": 0.0}
    if chip:
        step.update(predicted_s=sum(step_seconds(calls, chip, Call.seconds).values()),
                    floor_s=sum(step_seconds(calls, chip, Call.floor).values()))
    rows = {}
    for c in calls:
        sec = seconds(c, chip)
        row = dict(ms=1e3 * sec, xla_tflops=c.flops / sec / 1e12, xla_gbps=c.bytes / sec / 1e9,
                   xla_counts_all=not c.undercounted)
        if chip:
            pred, floor = c.seconds(chip), c.floor(chip)
            row.update(predicted_ms=1e3 * pred, ratio=sec / pred if pred else float("nan"), bound=c.bound(chip),
                       floor_ms=1e3 * floor, over_floor=sec / floor if floor else float("nan"),
                       mfu=c.ideal_flops / (sec * chip.flops), bandwidth=c.ideal_bytes / (sec * chip.hbm))
        rows[c.name] = row
    return dict(chip=chip_name, calls=rows, step=step)


def report(calls: list, cmp: dict, device: str) -> None:
    """Print `compare`'s table for calls measured on `device` (words)."""
    chip = cmp["chip"]
    print(f"\nmeasured on {device}, beside the roofline"
          + (f" for {chip}" if chip else " (no chip in the roofline's table for this device: pass --chip)"))
    head = "| call | per step | measured ms |"
    if chip:
        head += (f" predicted ms ({chip}, XLA's counts) | measured / predicted | floor ms (ideal counts) |"
                 " measured / floor | MFU | BW |")
    else:
        head += " XLA's TFLOP/s | XLA's GB/s |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for c in calls:
        r = cmp["calls"][c.name]
        line = f"| {c.name} | {c.per_step} | {r['ms']:.3f} |"
        if chip:
            mark = "" if r["xla_counts_all"] else " *"
            line += (f" {r['predicted_ms']:.3f}{mark} | {r['ratio']:.2f} | {r['floor_ms']:.3f} |"
                     f" {r['over_floor']:.2f} | {r['mfu']:.0%} | {r['bandwidth']:.0%} |")
        else:
            line += f" {r['xla_tflops']:.1f} | {r['xla_gbps']:.0f} |"
        print(line)
    s = cmp["step"]
    text = f"step from its calls: {s['measured_s']:.2f} s measured"
    if chip:
        text += (f", {s['predicted_s']:.2f} s predicted ({s['measured_s'] / s['predicted_s']:.2f}x), "
                 f"{s['floor_s']:.2f} s at the floor ({s['measured_s'] / s['floor_s']:.2f}x)")
    print(text + " (every row sampling its whole budget at the full window, every search inserting; no host work)")
    if chip and not all(r["xla_counts_all"] for r in cmp["calls"].values()):
        print("* XLA's FLOP count for this program is under half the model's: it misses work handed to libraries "
              "(XLA:GPU counts no cuBLAS gemm), so the prediction from it is no bound; the floor is one")


def report_ops(measured: dict[str, dict], top: int = 12) -> None:
    """Print each profiled call's `top` XLA ops by time (`run(profile_dir=...)`)."""
    for name, r in measured.items():
        ops = r.get("ops_ms")
        if not ops:
            continue
        unit = "step" if r["steps"] > 1 else "call"
        total = sum(ops.values())
        print(f"\n{name}: {total:.3f} ms of XLA ops per {unit} in one profiled run ({r['ms']:.3f} ms timed)")
        print("| op | ms | share |\n|---|---|---|")
        for op, ms in list(ops.items())[:top]:
            print(f"| {op} | {ms:.3f} | {ms / total:.0%} |")
