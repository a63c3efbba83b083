#!/usr/bin/env bash
# The GPU's word in one call (benchmarks/gpu/verify.py says what and why, with its device-time plan).
# Usage: bash benchmarks/gpu/verify.sh [OUT] [--cpu-dry-run] [--budget SECONDS] [--stages a,b,c,d,e]
#   OUT: where verify.json and verify.log go (default benchmarks/results/gpu/verify; $OUT on the device machine).
# First installs the wheels carried in .whl/ (docs/gpu-verify.md says how to download them on CPU), then runs
# verify.py under its own budget (default 480 s from the start of this script, install included), with a hard
# stop a little after it. The JSON is rewritten after every stage.
set -u
started=$(date +%s)
out=""
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then out=$1; shift; fi
args=("$@")
out=${out:-benchmarks/results/gpu/verify}
cd "$(dirname "$0")/../.." || exit 1
mkdir -p "$out"
budget=480
for ((i = 0; i < ${#args[@]}; i++)); do [ "${args[$i]}" = "--budget" ] && budget=${args[$((i + 1))]}; done
dry=0; for a in "${args[@]}"; do [ "$a" = "--cpu-dry-run" ] && dry=1; done
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ "$dry" = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "verify.sh: installing .whl/ failed; running with the machine's packages" >&2
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
py=python3; command -v python3 >/dev/null || py=python
set -o pipefail
timeout -k 5 $((budget + 20)) "$py" benchmarks/gpu/verify.py --out "$out" --started "$started" "${args[@]}" 2>&1 \
  | tee "$out/verify.log"
