#!/usr/bin/env bash
# The real experiment (configs/real_experiment.py) on a lent GPU machine that reaches nothing, in
# calls of under 10 minutes that each carry at most 64 MiB. Here, once:
#
#   python scripts/fetch_real_model.py --out ~/.cache/sem_jax/qwen2.5-coder-0.5b-instruct
#   python scripts/fetch_real_data.py --out ~/.cache/sem_jax/data
#   python scripts/device_kit.py pack --out .kit          # (.gitignore holds .kit/: it travels only when carried)
#
# Then one call per part, each carrying its part (carry [".kit/p00"], then [".kit/p01"], ...),
# back to back so that the machine stays warm (what /tmp holds goes with it), every call the same
# command:
#
#   JAX_PLATFORMS=cuda bash scripts/gpu_experiment.sh
#
# Each call stages the parts it brought (scripts/device_kit.py stage: checked against the
# manifest) into $WORK/kit. Once every part is there, the same command installs the wheels,
# converts the checkpoint, and runs `sem_jax.experiment` until it finishes or LIMIT seconds pass;
# a call that finds the run unfinished resumes it (the experiment restarts where it stopped). What
# it wrote so far (report.md, report.json, curves.png, the log, each stage's metrics) lands in $OUT
# at the end of every call. Knobs: WORK (/tmp/sem_exp), LIMIT (530), CONFIG
# (configs/real_experiment.py; :smoke to rehearse on a CPU), PY (python3).
set -uo pipefail
WORK=${WORK:-/tmp/sem_exp}
LIMIT=${LIMIT:-530}
CONFIG=${CONFIG:-configs/real_experiment.py}
PY=${PY:-python3}
OUT=${OUT:-$WORK/out}
export PYTHONUNBUFFERED=1
mkdir -p "$WORK" "$OUT"
LOG="$OUT/gpu_experiment.log"
start=$(date +%s)

$PY scripts/device_kit.py stage --kit .kit --stage "$WORK/kit" 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
[ -f "$WORK/kit/complete" ] || exit 0  # the next call brings the next part
$PY scripts/device_kit.py unpack --stage "$WORK/kit" --model "$WORK/model" --data "$WORK/data" --site "$WORK/site" \
  2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
export PYTHONPATH="$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 || true
  $PY -c 'import jax; print("jax", jax.__version__, jax.devices())'; } | tee -a "$LOG"
left=$(( LIMIT - ($(date +%s) - start) ))
if [ "$left" -lt 60 ]; then  # (timeout 0 would mean no limit)
  echo "== ${left}s left of LIMIT=$LIMIT: the next call runs the experiment" | tee -a "$LOG"; exit 0
fi
echo "== sem_jax.experiment, $CONFIG, for at most ${left}s ($(date +%T))" | tee -a "$LOG"
SEM_JAX_REAL_MODEL="$WORK/model" SEM_JAX_REAL_DATA="$WORK/data" \
  timeout --signal=TERM --kill-after=20 "$left" $PY -m sem_jax.experiment --config "$CONFIG" --out "$WORK/experiment" \
  2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
[ "$rc" = 124 ] && echo "== stopped at the time limit: the next call resumes it" | tee -a "$LOG"
for f in report.md report.json curves.png; do
  [ -f "$WORK/experiment/$f" ] && cp "$WORK/experiment/$f" "$OUT/"
done
# Each stage's metrics and summaries, in one file (what comes back is at most 8 files).
(cd "$WORK/experiment" 2>/dev/null && find . \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' \) \
  -not -path './xla_cache/*' -not -path '*/ckpt/*' -not -name 'tokenizer*' | tar -czf "$OUT/stages.tar.gz" -T -) || true
exit "$rc"
