#!/usr/bin/env bash
# The test command (README, and what .ci/run calls): install everything the suite needs, then run it.
# Installs Debian's chromium + chromium-driver for the dashboard test when they are missing (as root, or
# through sudo), torch first (a CPU build on these machines), then the project with its dev extras.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 && sudo="sudo" || {
      echo "the dashboard test needs chromium: install Debian's chromium and chromium-driver (as root)" >&2
      exit 1
    }
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q chromium chromium-driver >/dev/null || {
    echo "could not install chromium and chromium-driver (needed by tests/e2e/test_dashboard.py)" >&2
    exit 1
  }
fi

pip install -q torch==2.13.0
pip install -q -e '.[dev]'
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
