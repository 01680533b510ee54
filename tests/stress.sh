#!/usr/bin/env bash
# The suite on a busy machine: keep every core busy with a background load, run the whole test suite
# PASSES times in a row (default 3), stop at the first failing pass. A user's laptop is never quiet.
#   bash tests/stress.sh [PASSES] [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
passes="${1:-3}"
shift || true
cores="$(nproc)"
load_pids=()
stop_load() { for p in "${load_pids[@]}"; do kill "$p" 2>/dev/null; done; }
trap stop_load EXIT INT TERM
for _ in $(seq "$cores"); do
  ( while :; do :; done ) &
  load_pids+=("$!")
done
echo "background load: ${#load_pids[@]} busy loop(s) on $cores core(s)"
for i in $(seq "$passes"); do
  start=$(date +%s)
  python -m pytest -q -p no:cacheprovider "$@"
  rc=$?
  echo "pass $i/$passes: exit $rc in $(( $(date +%s) - start )) s"
  if [ "$rc" -ne 0 ]; then
    exit "$rc"
  fi
done
echo "all $passes passes green under load"
