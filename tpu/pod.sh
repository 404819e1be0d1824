#!/usr/bin/env bash
# Cloud TPU pod lifecycle for sem_jax. Every setting comes from the environment:
#
#   TPU_NAME (sem-jax)  ZONE (us-central2-b)  PROJECT (gcloud default)  ACCELERATOR (v4-32)
#   RUNTIME (tpu-ubuntu2204-base)  CAPACITY (spot | reserved | on-demand; spot)
#   QR_ID (<TPU_NAME>-qr)  REMOTE_DIR (sem_jax)  LOG (sem_jax.log)
#   BUCKET (for mount)  MOUNT (/mnt/sem_jax)
#
#   tpu/pod.sh create            queued resource for the pod (spot or reserved)
#   tpu/pod.sh setup             copy this checkout to every worker and pip install -e '.[tpu]'
#   tpu/pod.sh mount             mount gs://BUCKET at MOUNT on every worker (gcsfuse): a run_dir
#                                that all hosts share, as multi-host checkpoints need
#   tpu/pod.sh launch ARGS...    the same `python -m sem_jax.train ARGS` on all workers, in the background
#   tpu/pod.sh evaluate ARGS...  the same `python -m sem_jax.evaluate ARGS` on all workers (each its share)
#   tpu/pod.sh logs [WORKER]     tail the log of one worker (0)
#   tpu/pod.sh stop              kill sem_jax on all workers and clear a stale TPU lock
#   tpu/pod.sh delete            delete the queued resource and its pod
#
# --dry-run (first argument) prints the gcloud commands instead of running them.
set -euo pipefail

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
CMD="${1:-}"; shift || true

TPU_NAME="${TPU_NAME:-sem-jax}"
ZONE="${ZONE:-us-central2-b}"
ACCELERATOR="${ACCELERATOR:-v4-32}"
RUNTIME="${RUNTIME:-tpu-ubuntu2204-base}"
CAPACITY="${CAPACITY:-spot}"
QR_ID="${QR_ID:-${TPU_NAME}-qr}"
REMOTE_DIR="${REMOTE_DIR:-sem_jax}"
LOG="${LOG:-sem_jax.log}"
PROJECT_FLAG=()
if [[ -n "${PROJECT:-}" ]]; then PROJECT_FLAG=(--project "$PROJECT"); fi

run() {
  if [[ "$DRY_RUN" == 1 ]]; then printf '%q ' "$@"; printf '\n'; else "$@"; fi
}

ssh_all() {  # ssh_all WORKER COMMAND
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" "${PROJECT_FLAG[@]}" --worker="$1" --command "$2"
}

case "$CMD" in
  create)
    case "$CAPACITY" in
      spot) cap=(--spot) ;;
      reserved) cap=(--reserved) ;;
      on-demand) cap=() ;;
      *) echo "CAPACITY must be spot, reserved or on-demand, got '$CAPACITY'" >&2; exit 2 ;;
    esac
    run gcloud compute tpus queued-resources create "$QR_ID" --node-id "$TPU_NAME" --zone "$ZONE" \
      "${PROJECT_FLAG[@]}" --accelerator-type "$ACCELERATOR" --runtime-version "$RUNTIME" "${cap[@]}"
    ;;
  setup)
    top="$(cd "$(dirname "$0")/.." && pwd)"
    tarball="/tmp/${TPU_NAME}-sem_jax.tar.gz"
    run git -C "$top" archive --format=tar.gz -o "$tarball" HEAD
    run gcloud compute tpus tpu-vm scp "$tarball" "$TPU_NAME:~/sem_jax.tar.gz" --zone "$ZONE" \
      "${PROJECT_FLAG[@]}" --worker=all
    ssh_all all "mkdir -p ~/$REMOTE_DIR && tar -xzf ~/sem_jax.tar.gz -C ~/$REMOTE_DIR && cd ~/$REMOTE_DIR && python3 -m venv .venv && .venv/bin/pip install -q -e '.[tpu]'"
    ;;
  mount)
    [[ -n "${BUCKET:-}" ]] || { echo "set BUCKET (a gs:// bucket name, without gs://)" >&2; exit 2; }
    MOUNT="${MOUNT:-/mnt/sem_jax}"
    ssh_all all "command -v gcsfuse >/dev/null || { curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo gpg --dearmor -o /usr/share/keyrings/gcsfuse.gpg && echo 'deb [signed-by=/usr/share/keyrings/gcsfuse.gpg] https://packages.cloud.google.com/apt gcsfuse-jammy main' | sudo tee /etc/apt/sources.list.d/gcsfuse.list && sudo apt-get update -q && sudo apt-get install -yq gcsfuse; }; sudo mkdir -p $MOUNT && sudo chown \$USER $MOUNT && (mountpoint -q $MOUNT || gcsfuse --implicit-dirs $BUCKET $MOUNT)"
    ;;
  launch|evaluate)
    module=$([[ "$CMD" == launch ]] && echo train || echo evaluate)
    [[ $# -gt 0 ]] || { echo "usage: tpu/pod.sh $CMD --config configs/tpu_v4.py [--config.x=y ...]" >&2; exit 2; }
    args="$(printf '%q ' "$@")"
    ssh_all all "cd ~/$REMOTE_DIR && nohup .venv/bin/python -m sem_jax.$module $args > ~/$LOG 2>&1 &"
    ;;
  logs)
    ssh_all "${1:-0}" "tail -n 200 -f ~/$LOG"
    ;;
  stop)
    ssh_all all "pkill -f 'sem_jax[.](train|evaluate)' || true; sudo rm -f /tmp/libtpu_lockfile; sudo lsof -t /dev/accel* 2>/dev/null | xargs -r sudo kill -9 || true"
    ;;
  delete)
    run gcloud compute tpus queued-resources delete "$QR_ID" --zone "$ZONE" "${PROJECT_FLAG[@]}" --force --quiet
    ;;
  *)
    sed -n '2,19p' "$0" >&2
    exit 2
    ;;
esac
