#!/usr/bin/env bash
# `make coverage`: line coverage of moe_rl/ by everything `.ci/run` runs (subprocesses, Ray
# actors and engine servers included) and by `make test` alone, plus every test's duration.
#   .ci/coverage.sh            run .ci/run under coverage, then report
#   .ci/coverage.sh instrument TARGET   (called by .ci/run) put coverage into TARGET's environment
#   .ci/coverage.sh report DIR          combine and report DIR's data
# How: coverage.py's documented subprocess recipe. A `.pth` file in each environment's
# site-packages calls coverage.process_startup(), which starts measuring in any Python process
# whose environment has COVERAGE_PROCESS_START (set by .ci/run to .coveragerc): pytest, every
# `moe-rl train` it starts, the Ray workers (they inherit the raylet's environment), the
# reference engine servers, the Slurm job steps. `sigterm` and `patch = _exit` save the data of
# processes ended by SIGTERM or os._exit. Not measured: the SGLang environment (moe_rl is not
# installed there; its CPU shims are a copy) and processes killed with SIGKILL.
set -euo pipefail
cd "$(dirname "$0")/.."
COVERAGE_PIN="coverage==7.17.5"
venv_of() {
  case "$1" in
    test-upstream) echo .venv-upstream ;;
    *) echo .venv ;;
  esac
}
instrument() {
  local target=$1 venv
  venv=$(venv_of "$target")
  # the environment the target builds: made here so coverage can go into it
  case "$target" in
    test-upstream) make .venv-upstream/.installed ;;
    *) make setup ;;
  esac
  PIP_CONFIG_FILE=$([ "$venv" = .venv-upstream ] && echo /dev/null || echo "${PIP_CONFIG_FILE:-}") \
    "$venv/bin/python" -m pip install --quiet "$COVERAGE_PIN"
  local site
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "import coverage; coverage.process_startup()" > "$site/moe_rl_coverage.pth"
}
report() {
  local dir=$1 py=.venv/bin/python
  "$py" -m coverage combine --quiet --keep --data-file="$dir/test.combined" "$dir"/test/.coverage.*
  "$py" -m coverage combine --quiet --keep --data-file="$dir/all.combined" "$dir"/*/.coverage.*
  {
    echo "line coverage of moe_rl/ by make test alone: $("$py" -m coverage report \
      --format=total --precision=2 --data-file="$dir/test.combined") %"
    echo "line coverage of moe_rl/ by everything .ci/run runs: $("$py" -m coverage report \
      --format=total --precision=2 --data-file="$dir/all.combined") %"
  } | tee "$dir/summary.txt"
  "$py" -m coverage json --quiet --data-file="$dir/all.combined" -o "$dir/all.json"
  "$py" -m coverage json --quiet --data-file="$dir/test.combined" -o "$dir/test.json"
  "$py" .ci/suite_report.py "$dir"
}
case "${1:-run}" in
  instrument) instrument "$2" ;;
  report) report "$2" ;;
  run)
    dir=$PWD/.coverage-data
    rm -rf "$dir"
    mkdir -p "$dir"
    set +e
    MOE_RL_COVERAGE=$dir bash .ci/run 2>&1 | tee "$dir/ci.log"
    status=${PIPESTATUS[0]}
    set -e
    report "$dir"
    exit "$status"
    ;;
esac
