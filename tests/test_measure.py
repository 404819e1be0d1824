"""Measured beside predicted (`sem_jax.aot.measure`, `sem_jax.aot --roofline --measure`)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from sem_jax.aot.measure import chip_of, compare, concrete, run
from sem_jax.aot.programs import Filled, Program
from sem_jax.aot.roofline import CHIPS, Call
from sem_jax.sharding import make_mesh
from subprocs import cpu_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_concrete_values_keep_shape_dtype_and_sharding():
    mesh = make_mesh(data=1, fsdp=-1, tensor=1)
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    tree = {"w": jax.ShapeDtypeStruct((16, 4), jnp.bfloat16, sharding=rows),
            "tokens": jax.ShapeDtypeStruct((16, 3), jnp.int32, sharding=rows),
            "lengths": Filled(jax.ShapeDtypeStruct((16,), jnp.int32, sharding=rows), 7),
            "done": jax.ShapeDtypeStruct((16,), jnp.bool_, sharding=rows), "graph": "static", "none": None}
    got = concrete(tree, jax.random.key(0), vocab=50)
    for name in ("w", "tokens", "done"):
        assert got[name].shape == tree[name].shape and got[name].dtype == tree[name].dtype
        assert got[name].sharding.is_equivalent_to(rows, got[name].ndim), name
    w = np.asarray(got["w"], np.float32)
    assert (w >= 0).all() and w.std() > 0 and w.max() < 0.2  # |N(0, 0.02)|
    tokens = np.asarray(got["tokens"])
    assert tokens.min() >= 0 and tokens.max() < 50 and len(np.unique(tokens)) > 10
    assert (np.asarray(got["lengths"]) == 7).all() and got["lengths"].sharding.is_equivalent_to(rows, 1)
    assert not np.asarray(got["done"]).any()
    assert got["graph"] == "static" and got["none"] is None


def test_run_times_each_program_with_fresh_donated_arguments_and_checks_it():
    mesh = make_mesh(data=1, fsdp=-1, tensor=1)
    a = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    first = jax.jit(lambda x, n: (x * 2, n))
    # Consumes its first argument: every timed run needs a copy of its own (a donated buffer
    # cannot be passed twice), and takes it from `first`'s output.
    second = jax.jit(lambda s, y: (s[0] @ y, s[1] + 1), donate_argnums=0)
    counts = Filled(jax.ShapeDtypeStruct((), jnp.int32), 4)
    programs = {"first": Program(first, (a, counts), {}, mesh),
                "second": Program(second, (None, a), {}, mesh, state_from={0: "first"}, donated=(0,), steps=4,
                                  check=lambda out: None if int(out[1]) == 5 else f"counted {int(out[1])}")}
    lines = []
    got = run(programs, vocab=1, repeats=3, log=lines.append)
    assert set(got) == {"first", "second"} and len(lines) == 2
    for name, steps in (("first", 1), ("second", 4)):
        r = got[name]
        assert r["steps"] == steps and len(r["runs_ms"]) == 3 and min(r["runs_ms"]) > 0
        assert r["ms"] == pytest.approx(sorted(r["runs_ms"])[1])  # the median, per step
    bad = dict(programs, second=Program(second, (None, a), {}, mesh, state_from={0: "first"}, donated=(0,),
                                        check=lambda out: "stopped early"))
    with pytest.raises(RuntimeError, match="second: stopped early"):
        run(bad, vocab=1, repeats=1, log=lambda _: None)


def test_compare_against_a_hand_computed_table():
    chip = CHIPS["H200"]
    calls = [Call("decode", 100, flops=1e9, bytes=4.8e9, ideal_flops=0.5e9, ideal_bytes=2.4e9),
             Call("update", 2, flops=989e12, bytes=1e9, ideal_flops=400e12, ideal_bytes=0.0, part="update",
                  remat_flops=494.5e12),
             # XLA counted a tenth of the model's FLOPs (a GPU program's cuBLAS gemms are not in it)
             Call("prefill", 1, flops=98.9e12, bytes=0.0, ideal_flops=989e12, ideal_bytes=4.8e9)]
    measured = {"decode": {"ms": 2.0}, "update": {"ms": 4000.0}, "prefill": {"ms": 2000.0}}
    cmp = compare(calls, measured, "H200", chip)
    d, u, p = (cmp["calls"][k] for k in ("decode", "update", "prefill"))
    # decode: XLA's 4.8 GB at 4.8 TB/s is 1 ms predicted (memory-bound); the ideal 2.4 GB, 0.5 ms
    assert d["predicted_ms"] == pytest.approx(1.0) and d["ratio"] == pytest.approx(2.0) and d["bound"] == "memory"
    assert d["floor_ms"] == pytest.approx(0.5) and d["over_floor"] == pytest.approx(4.0)
    assert d["bandwidth"] == pytest.approx(2.4e9 / 2e-3 / 4.8e12) and d["xla_gbps"] == pytest.approx(2400)
    # update: 989 TFLOP counted is 1 s predicted; the floor is the remat policy's 494.5 TFLOP, 0.5 s;
    # MFU by the model's 400 TFLOP in 4 s
    assert u["predicted_ms"] == pytest.approx(1000) and u["ratio"] == pytest.approx(4.0)
    assert u["floor_ms"] == pytest.approx(500) and u["over_floor"] == pytest.approx(8.0)
    assert u["mfu"] == pytest.approx(400 / 989 / 4) and u["xla_tflops"] == pytest.approx(989 / 4)
    assert d["xla_counts_all"] and u["xla_counts_all"] and not p["xla_counts_all"]
    assert p["predicted_ms"] == pytest.approx(100) and p["floor_ms"] == pytest.approx(1000)
    assert cmp["step"] == pytest.approx({"measured_s": 100 * 2e-3 + 2 * 4.0 + 2.0,
                                         "predicted_s": 100 * 1e-3 + 2 * 1.0 + 0.1,
                                         "floor_s": 100 * 0.5e-3 + 2 * 0.5 + 1.0})
    bare = compare(calls, measured, None)
    assert "predicted_ms" not in bare["calls"]["decode"] and bare["step"]["measured_s"] == cmp["step"]["measured_s"]


def test_chip_of_device_kinds():
    assert [chip_of(k) for k in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "TPU v4", "TPU v5 lite", "TPU v5",
                                 "TPU v6 lite", "cpu")] == ["H200", "H100", "v4", "v5e", "v5p", "v6e", None]


def test_aot_measure_runs_every_call_of_the_roofline(tmp_path):
    """The CLI path scripts/gpu_check.sh runs on a GPU, here on 2 CPU devices: each call the
    roofline counts is run and timed (the decode loop for all its steps), set beside a chip's
    prediction and floor."""
    out = tmp_path / "roofline.json"
    run_ = subprocess.run(
        [sys.executable, "-m", "sem_jax.aot", "--config", "configs/cpu.py", "--roofline", "--measure",
         "--repeats=2", "--chip=v4", "--hbm_gib=16", f"--json={out}", "--config.data.max_prompt_tokens=64",
         "--config.rollout.max_new_tokens=16", "--config.data.prompts_per_step=2", "--config.rollout.group_size=2",
         "--config.rl.micro_batch=4", "--config.retrieval.top_k=1", "--config.retrieval.max_tokens_per_passage=16",
         "--config.rollout.max_searches=1", "--config.rl.beta=0.01", f"--hlo_dir={tmp_path / 'hlo'}",
         f"--profile_dir={tmp_path / 'profile'}"],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=cpu_env(2))  # FSDP over 2 devices
    assert run_.returncode == 0, run_.stderr[-3000:]
    data = json.loads(out.read_text())
    m, v4 = data["measured"], data["chips"]["v4"]["calls"]
    names = [c["name"] for c in data["calls"]]
    assert [n.split(" (")[0] for n in names] == ["prefill", "decode step", "insert", "reference pass", "update"]
    assert set(m["calls"]) == set(names) == set(m["runs"]) and m["chip"] == "v4"
    assert m["runs"][names[1]]["steps"] == 16  # every step of the budget (fewer than MEASURED_STEPS)
    for c in data["calls"]:
        r = m["calls"][c["name"]]
        assert r["ms"] > 0 and r["predicted_ms"] == pytest.approx(v4[c["name"]]["ms"])
        assert r["ratio"] == pytest.approx(r["ms"] / r["predicted_ms"])
        assert r["over_floor"] == pytest.approx(r["ms"] / r["floor_ms"]) and r["floor_ms"] > 0
    assert m["step"]["measured_s"] == pytest.approx(sum(c["per_step"] * m["calls"][c["name"]]["ms"] / 1e3
                                                        for c in data["calls"]))
    # Each program as the backend compiled it, for reading offline (what a GPU run brings back).
    hlo = {f.name: f.read_text() for f in (tmp_path / "hlo").iterdir()}
    assert sorted(hlo) == sorted(["prefill.hlo.txt", "decode_step_window_160.hlo.txt", "insert_48_tokens.hlo.txt",
                                  "reference_pass_4_rows.hlo.txt", "update_4_rows.hlo.txt"])
    assert all("ENTRY" in text for text in hlo.values()) and "while" in hlo["decode_step_window_160.hlo.txt"]
    assert "measured on cpu" in run_.stdout and "| decode step (window" in run_.stdout.split("measured on cpu")[1]
    # One profiled run of each: its time by XLA op (XLA:CPU's thunks), the decode's per step.
    for name in names:
        ops = m["runs"][name]["ops_ms"]
        assert ops and all(ms > 0 for ms in ops.values()) and list(ops.values()) == sorted(ops.values(), reverse=True)
        assert f"{name}: " in run_.stdout and "ms of XLA ops per" in run_.stdout


def test_op_times_reads_a_device_trace(tmp_path):
    """A GPU-style trace: the device's "XLA Ops" line is summed by op (its kernels on the stream
    line and the host's events are not counted twice); without that line, the device's kernels."""
    import gzip

    from sem_jax.aot.measure import op_times

    def trace(events, where):
        path = tmp_path / where / "plugins" / "profile" / "run"
        path.mkdir(parents=True)
        meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
                {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
                {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #13(Compute)"}},
                {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
                {"ph": "M", "name": "thread_name", "pid": 1, "tid": 9, "args": {"name": "XLA Modules"}},
                {"ph": "M", "name": "thread_name", "pid": 2, "tid": 1, "args": {"name": "python"}}]
        with gzip.open(path / "host.trace.json.gz", "wt") as fh:
            json.dump({"traceEvents": meta + events}, fh)
        return str(tmp_path / where)

    x = lambda pid, tid, name, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": 0, "dur": dur}
    kernels = [x(1, 7, "gemm_kernel", 30.0), x(1, 7, "loop_fusion", 5.0), x(1, 7, "gemm_kernel", 10.0),
               x(1, 9, "jit_decode_loop", 60.0), x(2, 1, "PjitFunction", 90.0)]
    ops = [x(1, 8, "fusion.3", 5.0), x(1, 8, "dot.1", 30.0), x(1, 8, "dot.1", 10.0)]
    assert op_times(trace(kernels + ops, "with_ops")) == {"dot.1": 40.0, "fusion.3": 5.0}
    assert op_times(trace(kernels, "kernels")) == {"gemm_kernel": 40.0, "loop_fusion": 5.0}
    with pytest.raises(FileNotFoundError, match="create_perfetto_trace"):
        op_times(str(tmp_path / "nothing"))
