#!/usr/bin/env bash
# One machine (CPU or GPUs): Ray starts inside the job (no cluster address).
#   launch/single_node.sh configs/tiny_cpu.yaml [key=value ...]
# moe-rl is taken from PATH, else from the checkout's .venv (what `make` creates); MOE_RL=path
# names another. DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
CONFIG=${1:?usage: launch/single_node.sh CONFIG [key=value ...]}
shift
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z "${MOE_RL:-}" ]]; then
  if command -v moe-rl >/dev/null; then MOE_RL=moe-rl
  elif [[ -x "$HERE/.venv/bin/moe-rl" ]]; then MOE_RL="$HERE/.venv/bin/moe-rl"
  else echo "moe-rl not found: run make (it creates .venv), then source .venv/bin/activate" >&2
       exit 127; fi
fi
GPUS=${GPUS:-$( (nvidia-smi -L 2>/dev/null || true) | grep -c GPU || true)}
CMD=("$MOE_RL" train --config "$CONFIG" cluster.num_nodes=1 cluster.gpus_per_node="$GPUS" "$@")
if [[ "${DRY_RUN:-0}" == 1 ]]; then echo "+ ${CMD[*]}"; else exec "${CMD[@]}"; fi
