#!/usr/bin/env bash
# One machine (CPU or GPUs): Ray starts inside the job (no cluster address).
#   launch/single_node.sh configs/tiny_cpu.yaml [key=value ...]
# DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
CONFIG=${1:?usage: launch/single_node.sh CONFIG [key=value ...]}
shift
GPUS=${GPUS:-$( (nvidia-smi -L 2>/dev/null || true) | grep -c GPU || true)}
CMD=(moe-rl train --config "$CONFIG" cluster.num_nodes=1 cluster.gpus_per_node="$GPUS" "$@")
if [[ "${DRY_RUN:-0}" == 1 ]]; then echo "+ ${CMD[*]}"; else exec "${CMD[@]}"; fi
