#!/usr/bin/env bash
# Runs the three GPU benchmarks in one go (each under its own time limit, each writing its JSON as it goes) and
# prints their summaries. Usage: bash benchmarks/gpu/run_all.sh OUT_DIR [KERNELS_S SPEED_S MEMORY_S]
# Extra wheels (exact versions of transformers/peft/deepspeed's needs) in .whl/ and packages in .whl/site/ are
# installed first when present (a machine without network; see the device notes in README).
set -u
out=${1:-benchmarks/results/gpu}; mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD/.whl/site
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,temperature.gpu --format=csv | tee "$out/nvidia-smi.txt"
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
timeout "${2:-150}" python3 benchmarks/gpu/kernel_parity.py --out "$out" > "$out/kernels.log" 2>&1; echo "kernels rc $?"
timeout "${3:-190}" python3 benchmarks/gpu/speed.py --out "$out" > "$out/speed.log" 2>&1; echo "speed rc $?"
timeout "${4:-250}" python3 benchmarks/gpu/memory.py --out "$out" > "$out/memory.log" 2>&1; echo "memory rc $?"
for f in kernels speed memory; do echo "== $f"; grep -vE "Warning|warn\(|^  " "$out/$f.log" | tail -n 25; done
