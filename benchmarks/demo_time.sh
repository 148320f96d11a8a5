#!/usr/bin/env bash
# `make demo` timed from a fresh clone of REPO (default: this checkout), in a venv over the installed environment
# (set-up re-runs pip, downloads nothing large), with an empty QUANTKIT_CACHE; every output line time-stamped.
#   bash benchmarks/demo_time.sh [REPO] [WORK]      -> WORK/setup.log, WORK/demo.log (default WORK /tmp/demo-time)
set -u
REPO=$(realpath "${1:-$(dirname "$0")/..}") WORK=${2:-/tmp/demo-time}
rm -rf "$WORK" && mkdir -p "$WORK"
git clone -q "$REPO" "$WORK/clone" && cd "$WORK/clone" || exit 1
python -m venv --system-site-packages "$WORK/venv"
export PATH="$WORK/venv/bin:$PATH" QUANTKIT_CACHE="$WORK/cache"
echo "commit $(git rev-parse --short HEAD); load $(cut -d' ' -f1-3 /proc/loadavg)"
t0=$(date +%s)
make setup PY=python > "$WORK/setup.log" 2>&1; echo "setup rc=$? $(( $(date +%s) - t0 )) s"
make demo PY=python 2>&1 | while IFS= read -r line; do echo "[$(( $(date +%s) - t0 ))s] $line"; done > "$WORK/demo.log"
echo "total $(( $(date +%s) - t0 )) s (from the clone); load $(cut -d' ' -f1-3 /proc/loadavg)"
grep -E "wrote gptq|report:" "$WORK/demo.log"
