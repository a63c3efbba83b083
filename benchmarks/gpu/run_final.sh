#!/usr/bin/env bash
# The third GPU session call (see README, "GPU measurements"): speed, then the whole-step memory with the default
# allocator and with expandable segments. Usage: bash benchmarks/gpu/run_final.sh OUT_DIR
set -u
out=${1:-benchmarks/results/gpu}; mkdir -p "$out/default" "$out/expandable"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/site PYTHONUNBUFFERED=1
timeout 200 python3 benchmarks/gpu/speed.py --out "$out" --lengths 128K,512K > "$out/speed.log" 2>&1; echo "speed rc $?"
timeout 195 python3 benchmarks/gpu/memory.py --out "$out/default" --sections step,calibration --lengths 256K,1M \
  --full-length 256K > "$out/default/memory.log" 2>&1; echo "memory default rc $?"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 150 python3 benchmarks/gpu/memory.py \
  --out "$out/expandable" --sections step,calibration --lengths 256K,512K,1M --full-length '' \
  > "$out/expandable/memory.log" 2>&1; echo "memory expandable rc $?"
grep -hE "^\| |calibration|ERROR" "$out/speed.log" "$out/default/memory.log" "$out/expandable/memory.log" | cut -c1-400
