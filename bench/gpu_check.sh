#!/usr/bin/env bash
# The device check of issue #7 item 3, prepared for a session that is lent a GPU
# (`status`: can_start_another). About 3-5 minutes on one H200; run from the repo
# root on the device machine, where python3 already has torch, numpy, xxhash, pytest
# and prometheus-client (no venv, nothing installed):
#
#   run(command="bash bench/gpu_check.sh", timeout_s=540)   # then give_back
#
# 1. the gpu-marked tests of the device paths (Tier 1 on CUDA, the alg-2 device
#    digest equal to the CPU's, the content check's device fingerprints equal to the
#    host's and a stray write found, the GPU bench section at tiny sizes);
# 2. the GPU section of `make bench` at the reference shape (bench/gpu_bench.py):
#    Tier 1's step-time ratio (target <= 1.01), KVGUARD_GUARD=full's (gpu.guard_step_ratio,
#    issue #15), the content check's (issue #16) and the device digest per transfer.
# Results land in $OUT (the device tool brings them back) or ./gpu-check.
# NOT YET RUN ON A DEVICE: no session so far was lent one. If an import is missing
# there, carry its wheel (the device tool's README, "Notes").
set -uo pipefail
out="${OUT:-gpu-check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$out/device.txt"
import torch
assert torch.cuda.is_available(), "no CUDA device"
print("torch", torch.__version__, "device", torch.cuda.get_device_name(0))
PY
python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts= \
  tests/engine_side/test_tier1.py tests/engine_side/test_digest.py tests/engine_side/test_content.py tests/tools/test_bench_smoke.py 2>&1 | tee "$out/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
python3 - "$out/gpu-bench.json" <<'PY' 2>&1 | tee "$out/gpu-bench.log"
import json, sys
from bench import gpu_bench
r = gpu_bench.run("cuda")
json.dump(r, open(sys.argv[1], "w"), indent=1)
print(json.dumps(r, indent=1))
print(f"Tier 1 step-time ratio {r['tier1_step_ratio']:.4f} (target <= 1.01); "
      f"guard (full) {r['guard_step_ratio']:.4f} (target <= 1.01); "
      f"content check {r['content_step_ratio']:.4f} ({r['content_slots_changed']} changed, must be 0); "
      f"device digest {r['digest_ms_per_transfer']:.2f} ms per {r['digest_transfer_gb']:.2f} GB transfer")
PY
bench_rc=${PIPESTATUS[0]}
echo "gpu tests rc=$tests_rc, gpu bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
