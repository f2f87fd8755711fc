#!/usr/bin/env bash
# The canary's smoke (`make test-newest`), in VENV: the newest versions setup.py allows. The
# config, contract and shadowing tests, two demo steps on the reference engine, check-model on
# the demo's tiny model with a reference engine it starts. It always prints the packages at
# another version than LOCK; when a step fails it names them as the suspects.
set -uo pipefail
VENV=$1
LOCK=$2
PY=$VENV/bin/python
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
failed=()
step() {
  local name=$1
  shift
  echo "== canary: $name"
  "$@" || failed+=("$name")
}
step "config, contract and shadowing tests" "$PY" -m pytest -q -p no:cacheprovider -n 2 \
  --dist loadfile -m "not slow and not loop and not sglang and not contract" \
  tests/config tests/rollout/test_contract.py tests/toplevel/test_safe_path.py
step "two demo steps on the reference engine" "$VENV/bin/moe-rl" demo trainer.steps=2 \
  "logging.dir=$WORK/run" "model.path=$WORK/model" logging.progress=false
step "check-model on the tiny model" "$VENV/bin/moe-rl" check-model "$WORK/model" \
  --start-engine reference
newer=$("$PY" .ci/lock.py newer "$PY" "$LOCK")
if [ ${#failed[@]} -gt 0 ]; then
  echo "canary FAILED on the newest versions setup.py allows: ${failed[*]}"
  echo "the suspects, packages at another version than $LOCK: $newer"
  exit 1
fi
echo "canary passed on the newest versions setup.py allows; beyond $LOCK: $newer"
