#!/bin/bash
# One device call for the CUDA attention kernel: build, a smoke run of each variant (each in its own process
# with a timeout, so that a hang costs one variant), the parity tests over the variants that passed, and the
# benchmark. Logs and JSON under $OUT. Run from the repository root:  OUT=/tmp/out bash kernels/cuda/run_gpu.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
OUT=${OUT:-/tmp/dsv4-cuda-out}
mkdir -p "$OUT"
date -u
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
t0=$(date +%s)
timeout "${BUILD_T:-200}" python -c "from kernels.cuda import attention as CA; CA.load_extension(verbose=True)" > "$OUT/build.log" 2>&1
echo "build rc=$? in $(( $(date +%s) - t0 )) s"
grep -E "error|registers|spill|C75|Compiling entry" "$OUT/build.log" | head -40
good=""
# all smoke runs at once (separate processes and CUDA contexts: a hang costs only its own variant)
for v in ${VARIANTS:-8 9 6 7 0 2 3 5 1 4}; do
  ( timeout "${SMOKE_T:-60}" python -m bench.kernels_cuda --smoke "$v" > "$OUT/smoke-$v.log" 2>&1; echo $? > "$OUT/smoke-$v.rc" ) &
done
wait
for v in ${VARIANTS:-8 9 6 7 0 2 3 5 1 4}; do
  rc=$(cat "$OUT/smoke-$v.rc")
  echo "smoke $v rc=$rc: $(tail -1 "$OUT/smoke-$v.log")"
  [ "$rc" = "0" ] && good="$good,$v"
done
good=${good#,}
echo "variants passing the smoke run: [$good]"
if [ -z "$good" ]; then  # nothing right: time them anyway (for the record), skip the tests
  timeout "${BENCH_T:-120}" python -m bench.kernels_cuda --variants 6,0,2 --time-wrong --ablations \
    --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  tail -32 "$OUT/bench.log"
  exit 1
fi
pick=""
for v in ${PREFER:-8 9 6 7 0 2 3 5 4 1}; do case ",$good," in *",$v,"*) pick=$v; break;; esac; done
echo "default variant for the tests: $pick"
t0=$(date +%s)
DSV4_CUDA_TEST_VARIANTS=$good DSV4_CUDA_ATTN_VARIANT=$pick timeout "${TEST_T:-150}" \
  python -m pytest -q -s -rf --tb=short -p no:cacheprovider tests/kernels/test_cuda_attention_gpu.py > "$OUT/test.log" 2>&1
echo "pytest rc=$? in $(( $(date +%s) - t0 )) s"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/test.log" | tail -25
t0=$(date +%s)
DSV4_CUDA_ATTN_VARIANT=$pick timeout "${BENCH_T:-120}" \
  python -m bench.kernels_cuda --variants "$good" ${BENCH_ARGS:---ablations} --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$? in $(( $(date +%s) - t0 )) s"
tail -32 "$OUT/bench.log"
