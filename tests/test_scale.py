"""Scale-out pieces checkable on a CPU host: the AOT fit check and the TPU pod scripts."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _aot(*args):
    # The TPU compiler at its own settings (not the tests' -O0 for the host's programs).
    return subprocess.run([sys.executable, "-m", "sem_jax.aot", *args], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=""))


def test_aot_check_small_topology():
    pytest.importorskip("libtpu", reason="jax[tpu] (libtpu) not installed: the compile-only TPU check is skipped")
    ok = _aot("--config", "configs/demo_cpu.py", "--topology", "v4:2x2x1", "--config.rl.beta=0.04",
              "--config.model.eval_dtype=bfloat16", "--config.rollout.tensor=2", "--config.rollout.slots=3")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "rollout in tensor-parallel groups of 2" in ok.stdout
    # The engine's own programs at its width (3 slots rounded up to the 2 groups' multiple);
    # narrowing does not apply to rows split over groups.
    for step in ("grpo update", "reference logprobs", "sampler prefill", "sampler decode loop",
                 "eval (bfloat16) prefill", "eval (bfloat16) decode loop", "engine, 4 slots: prompt cache",
                 "engine, 4 slots: empty slots", "engine, 4 slots: decode loop"):
        assert f"| {step} |" in ok.stdout
    assert "| engine, 4 slots: refill (" in ok.stdout and "narrowed" not in ok.stdout
    assert "| sampler insert (" in ok.stdout and "| eval (bfloat16) insert (" in ok.stdout
    assert ok.stdout.rstrip().endswith("fits")
    # 8 layers of width 8192, replicated (no FSDP): ~34 GB of f32 weights per device.
    big = _aot("--config", "configs/demo_cpu.py", "--topology", "v4:2x2x1", "--config.mesh.fsdp=1",
               "--config.mesh.data=-1", "--config.model.init.hidden_size=8192",
               "--config.model.init.intermediate_size=32768", "--config.model.init.num_layers=8",
               "--config.model.init.num_heads=64", "--config.model.init.num_kv_heads=8",
               "--config.rollout.max_searches=0")  # no insert to compile: the update alone cannot fit
    assert big.returncode == 1, big.stderr[-3000:]
    assert "DOES NOT FIT" in big.stderr and "| NO |" in big.stdout


def test_roofline_counts_every_layer_and_step_as_a_hand_count(tmp_path):
    """XLA's FLOPs per call, loops counted (4 layers, the decode loop, the head's chunks), against
    a count by hand of what each program computes: every weight twice per token, attention over
    every slot it reads (masked ones too), the head where it runs; the update 3x its forward
    plus the head's recompute (remat none). The sampler runs in tensor-parallel pairs
    (rollout.tensor=2): the per-device counts are the same shares of the work, the rows split over
    2 groups; beside it the trainer holds its parameters and AdamW's two moments."""
    pytest.importorskip("libtpu", reason="jax[tpu] (libtpu) not installed: the compile-only TPU check is skipped")
    out = tmp_path / "roofline.json"
    run = _aot("--config", "configs/cpu.py", "--topology", "v4:2x2x1", "--roofline", f"--json={out}",
               "--config.data.max_prompt_tokens=64", "--config.rollout.max_new_tokens=32",
               "--config.data.prompts_per_step=4", "--config.rollout.group_size=2", "--config.rl.micro_batch=8",
               "--config.retrieval.top_k=1", "--config.retrieval.max_tokens_per_passage=16",
               "--config.rollout.max_searches=1", "--config.model.remat=none", "--config.rollout.tensor=2")
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    sh, calls = data["shapes"], {c["name"].split(" (")[0]: c for c in data["calls"]}
    n, rows, tp, w, wi = sh["devices"], sh["rows"], sh["prompt"], sh["window"], sh["insert"]
    m, t, r, share = sh["micro_batch"], sh["inputs"], sh["head_positions"], sh["share"]
    L, E, M, H, K, V = 4, 128, 384, 4, 2, 1088  # configs/cpu.py's model (head_dim 32)
    D = E // H
    weights = E * H * D * 2 + 2 * E * K * D + 3 * E * M  # per layer: q, o; k, v; gate, up, down
    fwd = lambda b, new, seen, heads: (2 * L * weights * b * new + 4 * L * H * D * b * new * seen
                                       + 2 * E * V * heads)
    # The update's rows share their prompt in runs of 2 (G = 2, 2 rows per device): each run's
    # prefix once, then each row's window on top of it (token_logprobs(group=)).
    train = fwd(m // share, t - r, t - r, 0) + fwd(m, r, t, m * r)
    hand = {"prefill": fwd(4, tp, tp, 4), "decode step": fwd(rows, 1, w + 1, rows),
            "insert": fwd(rows, wi, w + wi, rows), "update": 3 * train + 2 * E * V * m * r}
    assert set(hand) == set(calls) and sh["micro_batches"] == rows // m and share == 2
    assert sh["rollout_mesh"] == {"data": 2, "fsdp": 1, "tensor": 2} and sh["rows_per_group"] == rows / 2
    # float32 over 4 devices by FSDP (the q/k/v biases replicated: 0.4% here), beta 0 (no reference):
    params = L * (weights + (H + 2 * K) * D + 2 * E) + 2 * V * E + E
    assert sh["resident"] == pytest.approx(3 * 4 * params / n, rel=0.01)
    # A decode step reads a group's half of the weights (all but the embedding table; the norms,
    # whole on every device, all of theirs) and a quarter of the KV window.
    norms = L * 2 * E + E
    floor = 4 * ((params - V * E - norms) / 2 + norms) + 2 * L * rows * K * D * w * 4 / n
    assert sh["decode_floor"] == pytest.approx(floor)
    # XLA's count of a decode step (its layer scan unrolled whole) moves at least what the layout must.
    assert calls["decode step"]["bytes"] >= floor
    # Its collectives send at least the tensor-parallel pairs' two all-reduces per layer (attention's
    # and the MLP's outputs, [rows / 2, E], at 2 bytes or more): 2 (n - 1) / n of each, n = 2.
    assert calls["decode step"]["ici"] >= L * 2 * (2 * 1 / 2) * rows / 2 * E * 2
    assert calls["update"]["ici"] > 0  # FSDP: the weights gathered, the gradients reduce-scattered
    # Its split, from compiles with 2 and 4 layers (4: this model's own program), into what a layer
    # and what the rest read, each beside its share of the floor.
    sp = sh["decode_split"]
    assert sp["rest_floor"] == pytest.approx(4 * (V * E / 2 + E))  # the head's half, the final norm
    assert L * sp["per_layer_floor"] + sp["rest_floor"] == pytest.approx(floor)
    assert L * sp["per_layer"] + sp["rest"] == pytest.approx(calls["decode step"]["bytes"])
    assert sp["per_layer"] >= sp["per_layer_floor"] and sp["rest"] >= sp["rest_floor"]
    for name, flops in hand.items():
        assert calls[name]["flops"] == pytest.approx(flops / n, rel=0.1), name
    assert calls["decode step"]["per_step"] == 32 and calls["insert"]["per_step"] == 1
    # Predictions: each call's time is its largest bound (compute, HBM, ICI), summed into the step.
    v4 = data["chips"]["v4"]
    for c in data["calls"]:
        assert v4["calls"][c["name"]]["ms"] == pytest.approx(
            1e3 * max(c["flops"] / 275e12, c["bytes"] / 1228e9, c["ici"] / 268e9))
    assert v4["step_s"] == pytest.approx(sum(c["per_step"] * v4["calls"][c["name"]]["ms"] / 1e3 for c in data["calls"]))
    assert "| decode step (window" in run.stdout and "decode batch:" in run.stdout
    # Beside a run's measured steps (scripts/roofline_vs_measured.py; the first step compiles).
    metrics = tmp_path / "metrics.jsonl"
    times = [(99.0, 9.0, 90.0), (2.0, 1.5, 0.5), (4.0, 2.5, 1.5), (3.0, 1.0, 2.0)]
    metrics.write_text("".join(json.dumps({"split": "train", "time/step": s, "time/rollout": r, "time/update": u})
                               + "\n" for s, r, u in times) + json.dumps({"split": "eval", "time/step": 7.0}) + "\n")
    cmp = subprocess.run([sys.executable, "scripts/roofline_vs_measured.py", str(out), str(metrics), "--chip", "v4"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert cmp.returncode == 0, cmp.stderr
    step = f"| step | 3.000 | {v4['step_s']:.3f} | {3.0 / v4['step_s']:.2f} |"
    assert f"| rollout | 1.500 | {v4['rollout_s']:.3f} |" in cmp.stdout and step in cmp.stdout


def test_aot_without_tpu_topology_names_the_cause():
    try:
        import libtpu  # noqa: F401
        pytest.skip("libtpu is installed: the missing-libtpu message cannot be shown")
    except ImportError:
        pass
    bad = _aot("--config", "configs/demo_cpu.py", "--topology", "v4:2x2x1")
    assert bad.returncode != 0 and "jax[tpu]" in bad.stderr


def _pod(*args, **env):
    return subprocess.run(["bash", "tpu/pod.sh", "--dry-run", *args], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env=dict(os.environ, **env))


def test_tpu_pod_script_dry_run():
    create = _pod("create", TPU_NAME="exp1", ZONE="us-central2-b", ACCELERATOR="v4-64", PROJECT="proj")
    assert create.returncode == 0, create.stderr
    assert create.stdout.split() == ("gcloud compute tpus queued-resources create exp1-qr --node-id exp1 --zone "
                                     "us-central2-b --project proj --accelerator-type v4-64 --runtime-version "
                                     "tpu-ubuntu2204-base --spot").split()
    assert "--reserved" in _pod("create", CAPACITY="reserved").stdout
    assert _pod("create", CAPACITY="cheap").returncode == 2
    setup = _pod("setup", TPU_NAME="exp1").stdout.splitlines()
    assert setup[0].startswith("git -C ") and "archive" in setup[0]
    assert "tpu-vm scp" in setup[1] and "--worker=all" in setup[1]
    assert "tpu-vm ssh exp1" in setup[2] and "pip\\ install" in setup[2] and "\\'.\\[tpu\\]\\'" in setup[2]
    launch = _pod("launch", "--config", "configs/tpu_v4.py", "--config.rl.beta=0.0").stdout
    assert "--worker=all" in launch and "sem_jax.train\\ --config\\ configs/tpu_v4.py\\ --config.rl.beta=0.0" in launch
    evaluate = _pod("evaluate", "--config", "configs/tpu_v4.py", "--checkpoint", "RUN/ckpt").stdout
    assert "--worker=all" in evaluate and "sem_jax.evaluate\\ --config\\ configs/tpu_v4.py\\ --checkpoint\\ RUN/ckpt" in evaluate
    stop = _pod("stop").stdout
    assert "--worker=all" in stop and "libtpu_lockfile" in stop and "pkill" in stop
    assert "--worker=2" in _pod("logs", "2").stdout
    assert _pod("delete").stdout.split()[:5] == ["gcloud", "compute", "tpus", "queued-resources", "delete"]
    mount = _pod("mount", BUCKET="my-runs", MOUNT="/mnt/r").stdout
    assert "--worker=all" in mount and "gcsfuse\\ --implicit-dirs\\ my-runs\\ /mnt/r" in mount
    assert _pod("mount").returncode == 2  # no BUCKET
    assert _pod("launch").returncode == 2
    assert _pod("nonsense").returncode == 2


def _tpu_script(code: str) -> dict:
    """Run `code` (a compile for a TPU topology) in a process of its own; its last line of output, as JSON."""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=""))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


KERNEL_COMPILE = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding
from sem_jax.kernels.cache_attention import cache_attention
from sem_jax.model.qwen2 import CACHE_AXES
from sem_jax.sharding import MESH_AXES, AXIS_TYPES, logical_to_spec
devices = topologies.get_topology_desc(platform="tpu", topology_name="v4:2x2x1").devices
mesh = Mesh(np.array(devices).reshape(-1, 1, 2), MESH_AXES, axis_types=AXIS_TYPES)
L, B, S, K, D, G, W = 2, 8, 256, 2, 128, 7, 192
def arg(shape, dtype, names):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, logical_to_spec(names, shape, dict(mesh.shape))))
with jax.set_mesh(mesh):
    args = (arg((B, K, G, D), jnp.bfloat16, ("batch", "act_kv_heads", None, None)),
            arg((L, B, S, K, D), jnp.bfloat16, CACHE_AXES), arg((L, B, S, K, D), jnp.bfloat16, CACHE_AXES),
            arg((), jnp.int32, ()), arg((B,), jnp.int32, ("batch",)))
    fn = jax.jit(lambda q, k, v, i, n: cache_attention(q, k, v, i, n, W, CACHE_AXES))
    compiled = fn.lower(*args).compile()
cost = compiled.cost_analysis()
cost = cost[0] if isinstance(cost, list) else cost
print(json.dumps({"bytes": cost["bytes accessed"], "rows": B // mesh.shape["data"],
                  "hlo_has_kernel": "tpu_custom_call" in compiled.as_text()}))
"""


def test_kernel_compiles_for_tpu_and_reads_the_cache_in_place():
    """(Here, beside the other libtpu compiles: one process at a time holds libtpu's lockfile.)
    Mosaic compiles the kernel for a v4 topology inside shard_map (rows over data, one KV head
    per device), and XLA hands it the cache as stored: a layout the kernel could not read in place
    would make XLA copy both caches first (bytes > both local caches whole)."""
    pytest.importorskip("libtpu", reason="jax[tpu] (libtpu) not installed: the compile-only TPU check is skipped")
    got = _tpu_script(KERNEL_COMPILE)
    assert got["hlo_has_kernel"]
    window_bytes = 2 * got["rows"] * 192 * 128 * 2  # one layer's keys and values, per device
    caches = 2 * 2 * got["rows"] * 256 * 128 * 2  # both caches whole: what a copy would read
    assert window_bytes <= got["bytes"] < caches, got


FLASH_COMPILE = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from sem_jax.model import Qwen2, Qwen2Config
from sem_jax.aot.programs import cost
from sem_jax.sharding import MESH_AXES, AXIS_TYPES
devices = topologies.get_topology_desc(platform="tpu", topology_name="v4:2x2x1").devices
mesh = Mesh(np.array(devices).reshape(-1, 1, 2), MESH_AXES, axis_types=AXIS_TYPES)
cfg = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=128, rope_theta=1e6)
out = {}
for mode in ("auto", "xla"):
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(lambda: Qwen2(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, attention_kernel=mode))
        graph, params = nnx.split(model)
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())), params)
        loss = lambda p, tokens: (nnx.merge(graph, p).hidden_states(tokens)[0].astype(jnp.float32) ** 2).mean()
        tokens = jax.ShapeDtypeStruct((8, 1024), jnp.int32, sharding=NamedSharding(mesh, P("data")))
        compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    out[mode] = dict(cost(compiled), xla_flops=xla.get("flops", 0.0), xla_bytes=xla["bytes accessed"],
                     kernels=compiled.as_text().count("custom_call_target=\"tpu_custom_call\""),
                     rows=8 // mesh.shape["data"], heads=4 // mesh.shape["tensor"])
print(json.dumps(out))
"""


def test_flash_kernels_compile_for_tpu_and_the_roofline_counts_them():
    """A training forward and backward (1024 tokens, the layer scan) with the splash kernels
    compiles for a v4 topology (rows over data, heads over tensor 2); XLA counts no FLOPs for
    them and `programs.cost` (the roofline's and the fit check's count) adds a hand count's: per layer
    iteration (counted once, as XLA counts a loop's body) 3 of the 4 causal [512, 512] blocks per
    query head, 2 matmuls in the forward, 3 in dq, 4 in dkv. The kernels move fewer bytes than
    XLA's attention, which writes the scores."""
    pytest.importorskip("libtpu", reason="jax[tpu] (libtpu) not installed: the compile-only TPU check is skipped")
    got = _tpu_script(FLASH_COMPILE)
    kernel, xla = got["auto"], got["xla"]
    assert kernel["kernels"] == 3 and xla["kernels"] == 0
    heads = kernel["rows"] * kernel["heads"]
    assert kernel["flops"] - kernel["xla_flops"] == heads * 3 * (2 + 3 + 4) * 2 * 512 * 512 * 128
    assert xla["flops"] == xla["xla_flops"] and xla["bytes"] == xla["xla_bytes"]
    assert kernel["bytes"] < xla["bytes"]


DECODE_STEP = r"""
def decode_step(graphdef, params, mesh, rows):
    # One decode step of `rows` rows over a 256-slot cache (window 128), compiled on `mesh`.
    import jax, jax.numpy as jnp
    from flax import nnx
    from sem_jax.sharding import batch_sharding
    with jax.set_mesh(mesh):
        init = jax.jit(lambda p: nnx.merge(graphdef, p).init_cache(rows, 256)).lower(params).compile()
        cache = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                             init.out_info, init.output_shardings)
        tokens = jax.ShapeDtypeStruct((rows, 1), jnp.int32, sharding=batch_sharding(mesh, (rows, 1)))
        step = jax.jit(lambda p, t, c: nnx.merge(graphdef, p).extend(t, c, window=128))
        return step.lower(params, tokens, cache).compile()
"""


SPREAD_COMPILE = DECODE_STEP + r"""
import json
import jax, jax.numpy as jnp
from flax import nnx
from sem_jax.model import Qwen2Config
from sem_jax.assemble import abstract_model
from sem_jax.aot.programs import cost, target_devices
from sem_jax.config import base_config
from sem_jax.config import load
from sem_jax.aot.roofline import set_analysis_flags, weight_bytes, weight_shares
from sem_jax.sharding import make_mesh, tensor_groups
set_analysis_flags()  # CMEM staging off: the bytes counted are HBM bytes
devices = target_devices("v4:2x2x1")
cfg = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=2048, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=128, rope_theta=1e6)
config = load(base_config()).replace(**{"model.compute_dtype": "bfloat16", "model.remat": "none"})
out = {}
for spread in (False, True):
    mesh = tensor_groups(make_mesh(devices=devices), 2, spread)
    _, graphdef, params = abstract_model(config, cfg, mesh, jnp.bfloat16, scan_unroll=2)
    out[str(spread)] = dict(cost(decode_step(graphdef, params, mesh, 8)), mesh=dict(mesh.shape),
                            weights=weight_bytes(cfg, 2, weight_shares(params)))
print(json.dumps(out))
"""


def test_spread_layout_on_tpu_reads_its_share_of_the_mlp_and_sends_the_rows():
    """One decode step (8 rows, 2 layers, bf16) on 4 TPU devices in tensor-parallel pairs, the MLP
    and the LM head split over a pair or over all 4 (rollout.spread): the weights a device holds
    lose a quarter of theirs, XLA's count of the step's bytes nearly all of that, and its
    collectives carry the rows ([8, E], a few KB) and logits, not the 1.7 MB of weights a device
    no longer holds."""
    pytest.importorskip("libtpu", reason="jax[tpu] (libtpu) not installed: the compile-only TPU check is skipped")
    got = _tpu_script(SPREAD_COMPILE)
    group, spread = got["False"], got["True"]
    assert spread["mesh"] == {"groups": 2, "fsdp": 1, "tensor": 2} and group["mesh"]["data"] == 2
    L, E, M, V, rows = 2, 256, 2048, 512, 8
    wide = L * 3 * E * M * 2 + E * V * 2  # the MLP and the head
    assert group["weights"] - spread["weights"] == pytest.approx(wide * (1 / 2 - 1 / 4))
    assert group["bytes"] - spread["bytes"] >= 0.8 * wide * (1 / 2 - 1 / 4)
    # the rows into each MLP and the head; a device's share of the float32 logits
    assert 0 < spread["ici"] - group["ici"] <= (L + 1) * 4 * rows * E * 2 + rows * V * 4 / 2


DECODE_KERNELS_COMPILE = DECODE_STEP + r"""
import json, re
import jax, jax.numpy as jnp
from flax import nnx
from sem_jax.model import Qwen2Config
from sem_jax.kernels.tpu_layout import lanes_swapped, sublanes_moved
from sem_jax.assemble import abstract_model
from sem_jax.aot.programs import cost, target_devices
from sem_jax.config import base_config
from sem_jax.config import load
from sem_jax.aot.roofline import set_analysis_flags
from sem_jax.sharding import make_mesh, tensor_groups
set_analysis_flags()  # CMEM staging off: the bytes counted are HBM bytes
devices = target_devices("v4:2x2x1")
# The layout rules against the compiler's default layouts.
dev = jax.sharding.SingleDeviceSharding(devices[0])
rules = {}
for shape in [(3584, 1184), (1184, 3584), (3584, 1024), (512, 296), (2, 3584, 7, 128), (2, 3584, 1, 128),
              (2, 3584, 2, 128), (2, 3584, 4, 128), (2, 3584, 8, 128), (2, 3584, 10, 128), (2, 3584, 16, 128)]:
    c = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=dev)).compile()
    order = c.input_formats[0][0].layout.major_to_minor
    n = len(shape)
    rule = sublanes_moved(shape) if n == 4 else lanes_swapped(shape)
    want = (0, 2, 1, 3) if n == 4 and rule else (1, 0) if n == 2 and rule else tuple(range(n))
    rules[str(shape)] = [list(order), list(want), shape[-2] == 1]
# One decode step through the kernels and through XLA.
cfg = Qwen2Config(vocab_size=512, hidden_size=512, intermediate_size=4 * 296, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=128, rope_theta=1e6, model_type=MODEL_TYPE)
config = load(base_config()).replace(**{"model.compute_dtype": "bfloat16", "model.remat": "none"})
mesh = tensor_groups(make_mesh(devices=devices), 2, True)
model, _, params = abstract_model(config, cfg, mesh, jnp.bfloat16, scan_unroll=2)
out = {"rules": rules}
for mode in ("pallas", "xla"):
    model.decode_kernel = mode
    graphdef, _ = nnx.split(model)
    compiled = decode_step(graphdef, params, mesh, 32)
    text = compiled.as_text()
    dims = [[int(d) for d in m.group(1).split(",") if d]
            for m in re.finditer(r"= bf16\[([\d,]*)\]\S* (?:copy|transpose)\(", text)]
    copies = [2 * int(jnp.prod(jnp.array(d))) for d in dims if len(d) < 5]  # not the [L, B, S, K, D] cache
    out[mode] = dict(cost(compiled), kernels=[k for k in ("fused_qkv", "fused_mlp") if k in text],
                     largest_copy=max(copies, default=0))
print(json.dumps(out))
"""


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_decode_kernels_compile_for_tpu_and_read_the_stacked_weights_in_place(model_type):
    """A decode step on the spread mesh of 4 TPU devices (2 groups of 2): the TPU's default layouts
    are the ones `tpu_layout` says (a device's MLP slice [512, 296] stored transposed, 7 or 10 heads
    stored before the embedding); through `fused_qkv` (with Qwen3's per-head norms in it) and
    `fused_mlp` the step copies no weight (a layer's q kernel slice is 128 KB: a weight read in the
    wrong order would be copied whole), and reads fewer bytes than through XLA, by at least the
    activations the MLP's three dots write and read back."""
    pytest.importorskip("libtpu", reason="jax[tpu] (libtpu) not installed: the compile-only TPU check is skipped")
    got = _tpu_script(f"MODEL_TYPE = {model_type!r}\n" + DECODE_KERNELS_COMPILE)
    for shape, (order, want, single) in got["rules"].items():
        assert single or order == want, (shape, order, want)  # a dim of 1 lies anywhere
    assert got["pallas"]["kernels"] == ["fused_qkv", "fused_mlp"] and not got["xla"]["kernels"]
    assert got["pallas"]["largest_copy"] < 64 * 1024, got["pallas"]["largest_copy"]
    n, e, m, layers = 32, 512, 296, 2  # all the rows gathered; a device's intermediate slice
    activations = layers * (n * e + 4 * n * m) * 2  # the h read again, gate and act written and read
    assert got["xla"]["bytes"] - got["pallas"]["bytes"] >= 0.5 * activations


DENSE_COMPILE = r"""
import json
import jax, jax.numpy as jnp
from jax.experimental import topologies
from sem_jax.model.qwen2 import _dense
from sem_jax.aot.roofline import set_analysis_flags
set_analysis_flags()  # CMEM staging off: the bytes counted are HBM bytes
dev = topologies.get_topology_desc(platform="tpu", topology_name="v4:2x2x1").devices[0]
arg = lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=jax.sharding.SingleDeviceSharding(dev))
out = {}
for name, x, w in (("q_kernel", (80, 3584), (3584, 7, 128)), ("o_kernel", (80, 7, 128), (7, 128, 3584))):
    compiled = jax.jit(lambda x, w: _dense(x, {name: w}, name)).lower(arg(x), arg(w)).compile()
    cost = compiled.cost_analysis()
    out[name] = (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]
print(json.dumps(out))
"""


def test_projections_read_their_kernels_in_place_on_tpu():
    """A decode step's q and o projections with 7 heads per device (the 7B over tensor 4): the
    kernel [E, 7, 128] is contracted as stored; reshaped to [E, 896] first, the TPU compiler
    copied it (its (8, 128) tiles pad 7 heads to 8), 2.8x the bytes."""
    pytest.importorskip("libtpu", reason="jax[tpu] (libtpu) not installed: the compile-only TPU check is skipped")
    got = _tpu_script(DENSE_COMPILE)
    # the kernel read once (padded to 8 heads in its tiles), the activations in and out
    weight, io = 3584 * 8 * 128 * 2, 2 * 80 * (3584 + 8 * 128) * 2
    for name, nbytes in got.items():
        assert nbytes <= 1.05 * (weight + io), (name, nbytes)


def test_roofline_rollout_at_a_measured_occupancy():
    """The engine's rollout replaces the decode step's max_new_tokens calls by mean_tokens /
    occupancy of them, and leaves every other call as it was: a hand count."""
    from sem_jax.aot.roofline import CHIPS, Call, engine_rollout, summary

    calls = [Call("prefill", 1, 4e12, 1e9, 4e12, 1e9), Call("decode step (window 512)", 128, 1e11, 2e10, 1e11, 2e10),
             Call("update (8 rows)", 4, 8e13, 1e10, 8e13, 1e10, part="update")]
    data = summary(calls, {})
    out = engine_rollout(data, calls, occupancy=0.5, mean_tokens=40)
    assert out["decode_steps"] == 80
    for name, chip in CHIPS.items():
        decode = max(1e11 / chip.flops, 2e10 / chip.hbm)
        prefill = max(4e12 / chip.flops, 1e9 / chip.hbm)
        update = 4 * max(8e13 / chip.flops, 1e10 / chip.hbm)
        assert out["chips"][name]["rollout_s"] == pytest.approx(prefill + 80 * decode)
        assert out["chips"][name]["step_s"] == pytest.approx(prefill + 80 * decode + update)


def test_a_call_too_big_unrolled_whole_is_counted_from_two_unrolls():
    """Where the compiler refuses a sampler call unrolled whole for lack of HBM, its cost is the
    base compile plus (layers - 1) times what one more unrolled layer adds (a hand count on fakes);
    any other compile error is not swallowed."""
    import jax

    from sem_jax.aot.roofline import whole_or_counted

    class Compiled:
        def __init__(self, unroll):
            self.unroll = unroll

        def cost_analysis(self):
            return {"flops": 10.0 + 4.0 * self.unroll, "bytes accessed": 100.0 + 7.0 * self.unroll}

        def as_text(self):
            return ""

    def lowered(fail_at, message):
        class Lowered:  # lowered with `layers` layers per iteration of the scan
            def __init__(self, layers):
                self.unroll = layers

            def compile(self):
                if self.unroll == fail_at:
                    raise jax.errors.JaxRuntimeError(message)
                return Compiled(self.unroll)
        return Lowered

    assert whole_or_counted(lowered(None, ""), 6) == {"flops": 34.0, "bytes": 142.0, "ici": 0.0}
    counted = whole_or_counted(lowered(6, "RESOURCE_EXHAUSTED: Ran out of memory on HBM"), 6)
    assert counted == {"flops": 14.0 + 5 * 4.0, "bytes": 107.0 + 5 * 7.0, "ici": 0.0}
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        whole_or_counted(lowered(6, "INTERNAL: something else"), 6)
