#!/usr/bin/env bash
# The GPU path, proved and measured in one script (for a lent accelerator; never part of CI).
#
#   JAX_PLATFORMS=cuda OUT=/tmp/gpu_check bash scripts/gpu_check.sh
#
# In order of what it is for, each part under a time limit of its own (a part cut short leaves
# what it printed in the log):
# 1. environment: nvidia-smi, jax devices, package versions;
# 2. `sem_jax.aot --roofline --measure` for configs/gpu.py (Qwen2.5-1.5B's shape, random weights):
#    every call of a GRPO step compiled for this GPU, XLA's counts and the predicted times, then
#    each call run and timed here, measured beside the prediction and the floor (roofline.json, the
#    table in the log), then run once more under the profiler: each call's time by XLA op (the
#    tables in the log, `ops_ms` in roofline.json);
# 3. `python -m sem_jax.train --config configs/gpu.py` on a random-weight 1.5B checkpoint with the
#    real Qwen2.5 tokenizer (built offline), the demo questions and a bm25s index built by
#    scripts/build_index.py: STEPS GRPO steps at the config's sizes and a checkpoint; the measured
#    steps beside the predicted ones (scripts/roofline_vs_measured.py);
# 4. scripts/bench_sampler.py --quick at Qwen2.5-1.5B's shape in bf16 against HF `generate` on the
#    same GPU (one rollout batch of configs/gpu.py: 80 rows);
# 5. an HF export of the trained checkpoint.
# Everything lands in $OUT: gpu_check.log, roofline.json, hlo.tar.gz (each measured call's
# optimized HLO), train_metrics.jsonl, measured_vs_predicted.md, bench_sampler.json.
# Knobs: SHAPE, PRESET, DTYPE, STEPS, REPEATS, TRAIN_ARGS, CHIP, HBM_GIB, *_TIMEOUT (a CPU rehearsal:
# PRESET=qwen2.5-0.5b SHAPE=tiny and a TRAIN_ARGS of small sizes), and PARTS (default "env roofline
# train bench export"; a subset runs those alone, appending to the log). On an H200 the first two
# parts took 4.3 minutes and the other three 5.7: where one command may run 10 minutes, run
# PARTS="env roofline", then PARTS="train bench export" with the same OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
SHAPE=${SHAPE:-qwen2.5-1.5b}
PRESET=${PRESET:-qwen2.5-1.5b}  # the architecture trained and measured (configs/gpu.py's)
DTYPE=${DTYPE:-bfloat16}
STEPS=${STEPS:-3}
REPEATS=${REPEATS:-3}
TRAIN_ARGS=${TRAIN_ARGS:-}
WORK=${WORK:-/tmp/sem_gpu}
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
mkdir -p "$OUT" "$WORK"
PARTS=${PARTS:-env roofline train bench export}
LOG="$OUT/gpu_check.log"
log() { tee -a "$LOG"; }
part() { echo "== $* ($(date +%T))" | log; }
wants() { [[ " $PARTS " == *" $1 "* ]]; }
DEMO=$($PY -c 'from sem_jax.data.questions import DEMO_DIR; print(DEMO_DIR)')

if wants env; then
part environment
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 || true
  $PY - <<'EOF'
import importlib.metadata as md, jax
print("jax devices:", jax.devices())
for p in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "torch", "bm25s", "ml_collections"):
    try:
        print(p, md.version(p))
    except md.PackageNotFoundError:
        print(p, "missing")
EOF
} 2>&1 | log
fi

if wants roofline; then
part "roofline: every call of configs/gpu.py compiled for this device, then run and timed"
rm -rf "$WORK/hlo" "$WORK/profile"
timeout "${ROOFLINE_TIMEOUT:-420}" $PY -m sem_jax.aot --config configs/gpu.py --roofline --measure \
    --repeats "$REPEATS" --hbm_gib "${HBM_GIB:-141}" ${CHIP:+--chip "$CHIP"} --json "$OUT/roofline.json" \
    --hlo_dir "$WORK/hlo" --profile_dir "$WORK/profile" --config.model.preset="$PRESET" $TRAIN_ARGS 2>&1 | log
tar czf "$OUT/hlo.tar.gz" -C "$WORK" hlo 2>&1 | log  # each call as this backend compiled it, to read offline
fi

if wants train; then
part "train configs/gpu.py ($STEPS steps) on random weights"
$PY - "$WORK/model" "$PRESET" "$DTYPE" <<'EOF' 2>&1 | log
import sys
import jax.numpy as jnp
from flax import nnx
from sem_jax.model import Qwen2, save_pretrained
from sem_jax.model.presets import preset
from sem_jax.model.tokenizer import build_qwen25_tokenizer
path, name, dtype = sys.argv[1], sys.argv[2], jnp.dtype(sys.argv[3])
model = Qwen2(preset(name), rngs=nnx.Rngs(0), param_dtype=dtype, dtype=dtype)
save_pretrained(model, path, dtype=dtype)
build_qwen25_tokenizer().save_pretrained(path)
print(f"random-weight {name} and the real tokenizer in {path}")
EOF
$PY scripts/build_index.py --corpus "$DEMO/corpus.jsonl" --out "$WORK/index" 2>&1 | tail -2 | log
rm -rf "$WORK/run"
timeout "${TRAIN_TIMEOUT:-240}" $PY -m sem_jax.train --config configs/gpu.py --config.run_dir="$WORK/run" \
    --config.model.path="$WORK/model" --config.retrieval.index_dir="$WORK/index" \
    --config.data.train_file="$DEMO/train.jsonl" --config.data.eval_file="$DEMO/eval.jsonl" \
    --config.train.total_steps="$STEPS" --config.train.ckpt_every="$STEPS" --config.train.eval_at_start=False \
    --config.model.preset="$PRESET" $TRAIN_ARGS 2>&1 | log
cp "$WORK/run/metrics.jsonl" "$OUT/train_metrics.jsonl" 2>/dev/null || true
$PY scripts/roofline_vs_measured.py "$OUT/roofline.json" "$OUT/train_metrics.jsonl" --chip "${CHIP:-H200}" \
    --out "$OUT/measured_vs_predicted.md" 2>&1 | log
fi

if wants bench; then
part "sampler vs HF generate ($SHAPE, $DTYPE)"
timeout "${BENCH_TIMEOUT:-150}" $PY scripts/bench_sampler.py --quick --shapes "$SHAPE" --dtype "$DTYPE" \
    --repeats 2 --out "$OUT/bench_sampler.json" 2>&1 | log
fi

if wants export; then
part export
timeout "${EXPORT_TIMEOUT:-60}" $PY -m sem_jax.export --checkpoint "$WORK/run/ckpt" --out "$WORK/export" 2>&1 \
    | tail -3 | log
ls -la "$WORK/export" 2>&1 | log
fi
part done
