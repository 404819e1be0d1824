#!/usr/bin/env bash
# The GPU path, proved and measured in one script (for a lent accelerator; never part of CI).
#
#   JAX_PLATFORMS=cuda OUT=/tmp/gpu_check bash scripts/gpu_check.sh
#
# 1. environment: nvidia-smi, jax devices, package versions;
# 2. scripts/bench_sampler.py at Qwen2.5-1.5B's shape in bf16, against HF `generate` on the same
#    GPU (one rollout batch of configs/gpu.py: 80 rows), keeping the random-weight checkpoint;
# 3. `python -m sem_jax.train --config configs/gpu.py` on that checkpoint with the real Qwen2.5
#    tokenizer (built offline), the demo questions and a bm25s index built by scripts/build_index.py:
#    a few GRPO steps at the config's real sizes (1024-token budget, G=5, 16 prompts, remat dots),
#    a checkpoint, and greedy evaluation; then an HF export of the trained checkpoint;
# 4. `sem_jax.aot --roofline` for that config on this GPU: XLA's counts per call and the predicted
#    step, beside the measured one (scripts/roofline_vs_measured.py).
# Knobs (for a CPU rehearsal): SHAPE, DTYPE, STEPS, TRAIN_ARGS, REPEATS, CHIP, HBM_GIB.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
SHAPE=${SHAPE:-qwen2.5-1.5b}
DTYPE=${DTYPE:-bfloat16}
STEPS=${STEPS:-3}
REPEATS=${REPEATS:-2}
TRAIN_ARGS=${TRAIN_ARGS:-}
WORK=${WORK:-/tmp/sem_gpu}
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
mkdir -p "$OUT" "$WORK"
DEMO=$($PY -c 'from sem_jax.data.questions import DEMO_DIR; print(DEMO_DIR)')

echo "== environment" | tee "$OUT/env.txt"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 || true
  $PY - <<'EOF'
import importlib.metadata as md, jax
print("jax devices:", jax.devices())
for p in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "torch", "bm25s"):
    try:
        print(p, md.version(p))
    except md.PackageNotFoundError:
        print(p, "missing")
EOF
} 2>&1 | tee -a "$OUT/env.txt"

echo "== sampler vs HF generate ($SHAPE, $DTYPE)"
timeout ${BENCH_TIMEOUT:-200} $PY scripts/bench_sampler.py --shapes "$SHAPE" --dtype "$DTYPE" --repeats "$REPEATS" \
    --save-model "$WORK/model" --out "$OUT/bench_sampler.json" 2>&1 | tee "$OUT/bench_sampler.log"

echo "== train configs/gpu.py ($STEPS steps)"
$PY -c "from sem_jax.model.tokenizer import build_qwen25_tokenizer as b; b().save_pretrained('$WORK/model')"
$PY scripts/build_index.py --corpus "$DEMO/corpus.jsonl" --out "$WORK/index" 2>&1 | tail -2
rm -rf "$WORK/run"
timeout ${TRAIN_TIMEOUT:-270} $PY -m sem_jax.train --config configs/gpu.py --config.run_dir="$WORK/run" \
    --config.model.path="$WORK/model" --config.retrieval.index_dir="$WORK/index" \
    --config.data.train_file="$DEMO/train.jsonl" --config.data.eval_file="$DEMO/eval.jsonl" \
    --config.train.total_steps="$STEPS" --config.train.ckpt_every="$STEPS" $TRAIN_ARGS 2>&1 | tee "$OUT/train.log"
cp "$WORK/run/metrics.jsonl" "$OUT/train_metrics.jsonl" 2>/dev/null || true

echo "== roofline: the same config's calls compiled for this GPU, predicted beside the steps measured above"
timeout ${ROOFLINE_TIMEOUT:-300} $PY -m sem_jax.aot --config configs/gpu.py --roofline --hbm_gib "${HBM_GIB:-141}" \
    --json "$OUT/roofline.json" --config.model.path="$WORK/model" $TRAIN_ARGS 2>&1 | tee "$OUT/roofline.log"
$PY scripts/roofline_vs_measured.py "$OUT/roofline.json" "$OUT/train_metrics.jsonl" --chip "${CHIP:-H200}" \
    --out "$OUT/measured_vs_predicted.md" 2>&1 | tee -a "$OUT/roofline.log"

echo "== export"
timeout 90 $PY -m sem_jax.export --checkpoint "$WORK/run/ckpt" --out "$WORK/export" 2>&1 | tail -3 | tee "$OUT/export.log"
ls -la "$WORK/export" 2>&1 | tee -a "$OUT/export.log"
