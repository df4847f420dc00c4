#!/usr/bin/env bash
# One call on a lent GPU machine (the `device` tool): install the carried wheels and this repo,
# run the GPU tests, then the benchmarks; everything lands in $OUT.
#   bash tools/gpu_session.sh [tests|kernels|e2e|tune|profile|conformance|invariant|structured|all|none ...]
#   (default: all = tests kernels e2e; conformance: the op suite per dtype, the pytest plugin, the e2e
#   baselines recorded and re-checked; invariant: benchmarks/batch_invariant.py; structured:
#   benchmarks/structured.py; serve: benchmarks/serve.py (SERVE_ARGS); multi: the multi-GPU run (NCCL tests, then
#   benchmarks/all_to_all.py and benchmarks/scale_out.py over every GPU of the host, SCALE_ARGS; NVLink multicast off);
#   v4: benchmarks/v4_slice.py over V4_RUNS (default "fp4:fp8 fp4:auto bf16:auto:peer": experts:kv[:transformers]);
#   pd: prefill/decode over NIXL on this GPU (tests/test_pd.py's gpu tests, then benchmarks/serve.py --launch one and pd
#   at PD_RATES; carry nixl-cu13's cp312 wheel in .whl: 59 MB, with little else beside it);
#   none: only install, for a command of your own after it).
#   TEST_PATHS narrows the tests part (default: tests/nvidia tests/test_gpu.py); TUNE_ARGS the tune part
#   (e.g. "--only mxfp4 --only indexer_select").
#   DEEPGEMM_SRC=DIR builds DeepGEMM from that source tree first (DEEPGEMM_CUTLASS: its cute/ and
#   cutlass/ headers, default the carried sgl-deep-gemm wheel's) and puts it first on PYTHONPATH.
#   DEEPEP_SRC=DIR builds DeepEP from that source tree with its own setup.py (v1.2.1: the Buffer API
#   benchmarks/all_to_all.py calls; intranode kernels only where NVSHMEM is absent; log in $OUT/deepep_build.log)
#   and puts it first on PYTHONPATH: no DeepEP wheel loads on torch 2.11.
set -uo pipefail
out="${OUT:-/tmp/out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/nvidia_sm100 -e plugins/ascend_950 >/dev/null || exit 1
if [[ -n "${DEEPGEMM_SRC:-}" ]]; then  # DeepGEMM's source, built here against this torch (tools/build_deepgemm.sh)
  bash tools/build_deepgemm.sh "$DEEPGEMM_SRC" /tmp/dgpkg "${DEEPGEMM_CUTLASS:-/tmp/site/deep_gemm/include}" || exit 1
  export PYTHONPATH=/tmp/dgpkg${PYTHONPATH:+:$PYTHONPATH}
fi
if [[ -n "${DEEPEP_SRC:-}" ]]; then  # DeepEP's source, built here against this torch for sm_90
  # it finds the image's pip NVSHMEM and builds the internode kernels too, whose headers want CUDA 13's libcu++
  # (cuda/std/...) from include/cccl: without it the first compile stops; with it 50 s (H200, 2026-12-05)
  cccl="$(dirname "$(dirname "$(command -v nvcc)")")/include/cccl"
  (cd "$DEEPEP_SRC" && NVCC_APPEND_FLAGS="-I$cccl" CPLUS_INCLUDE_PATH="$cccl" TORCH_CUDA_ARCH_LIST=9.0 \
    python3 setup.py build_ext --inplace) >"$out/deepep_build.log" 2>&1 \
    || { tail -30 "$out/deepep_build.log"; exit 1; }
  export PYTHONPATH=$DEEPEP_SRC${PYTHONPATH:+:$PYTHONPATH}
fi
exec > >(tee -a "$out/session.log") 2>&1  # one log comes back (the tool returns at most 8 files)
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
parts=("$@")
[[ ${#parts[@]} -eq 0 ]] && parts=(all)
for part in "${parts[@]}"; do
  case "$part" in
    tests|all)
      deepinfer backends 2>&1
      # each failure's traceback lands in failures.txt as it happens: a cut-off run still says why
      DEEPINFER_FAILURES_FILE="$out/failures.txt" timeout "${TESTS_TIMEOUT:-330}" python3 -m pytest -q -p no:cacheprovider \
        -n "${TEST_WORKERS:-4}" -rfE ${TEST_PATHS:-tests/nvidia tests/test_gpu.py} >"$out/tests.log" 2>&1
      tail -40 "$out/tests.log"
      [[ -f "$out/failures.txt" ]] && grep -c '^=== ' "$out/failures.txt" | sed 's/^/failures recorded: /' ;;&
    kernels|all)
      timeout "${KERNELS_TIMEOUT:-230}" python3 -m benchmarks.kernels --out "$out" ${KERNELS_ONLY:+$KERNELS_ONLY} 2>&1 ;;&
    tune)
      timeout "${TUNE_TIMEOUT:-300}" python3 -m benchmarks.tune --out "$out" ${TUNE_ARGS:-} 2>&1 ;;
    profile)
      timeout "${PROFILE_TIMEOUT:-200}" python3 -m benchmarks.profile_step --model v2-lite --model v3-slice \
        --point 1x1024 --point 32x1024 --point 64x4096 --out "$out" 2>&1 ;;
    conformance)
      for dt in ${CONF_DTYPES:-bfloat16 float32 float16}; do
        timeout "${CONF_TIMEOUT:-170}" deepinfer conformance --backend nvidia --dtype "$dt" --quiet \
          --explore-max-elements "${CONF_EXPLORE:-67108864}" --json "$out/conformance_nvidia_$dt.json" 2>&1
      done
      timeout 120 python3 -m pytest -p no:cacheprovider -q --deepinfer-backend nvidia --deepinfer-ops rms_norm,sample_tokens \
        --deepinfer-dtype bf16 --deepinfer-examples 2 2>&1 | tail -3
      timeout 150 deepinfer conformance --e2e --refresh --backend nvidia 2>&1
      timeout 150 deepinfer conformance --e2e --backend nvidia --json "$out/e2e_nvidia.json" 2>&1
      cp specs/baselines/offline_decode_ppl.json "$out/" ;;
    invariant)
      timeout "${INVARIANT_TIMEOUT:-300}" python3 -m benchmarks.batch_invariant --out "$out" ${INVARIANT_ARGS:-} 2>&1 ;;
    structured)
      timeout "${STRUCTURED_TIMEOUT:-120}" python3 -m benchmarks.structured --out "$out" ${STRUCTURED_ARGS:-} 2>&1 ;;
    serve)
      timeout "${SERVE_TIMEOUT:-240}" python3 -m benchmarks.serve --out "$out" ${SERVE_ARGS:---model v2-lite --rates 2,8,32,128} 2>&1 ;;
    multi)
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # multicast can take a shared host's GPUs out of service
      gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
      timeout "${MULTI_TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rfE tests/nvidia/test_multi_gpu.py \
        >"$out/multi_tests.log" 2>&1
      tail -20 "$out/multi_tests.log"
      if (( gpus >= 2 )); then
        timeout "${A2A_TIMEOUT:-200}" python3 -m benchmarks.all_to_all --ranks "$gpus" --out "$out" 2>&1
      fi
      timeout "${SCALE_TIMEOUT:-540}" python3 -m benchmarks.scale_out --out "$out" ${SCALE_ARGS:-} 2>&1 ;;
    pd)  # issue 51: a prefill/decode pair on one GPU (two engines sharing it) against one engine
      python3 -m pytest -q -m gpu tests/test_pd.py -p no:cacheprovider 2>&1 | tail -15
      for launch in one pd; do
        timeout "${PD_TIMEOUT:-300}" python3 -m benchmarks.serve --launch "$launch" --rates "${PD_RATES:-2,8,32}" --requests 64 \
          --max-tokens 64 --accelerator nvidia --out "$out/pd_$launch" 2>&1 | grep '\[serve\]'
      done ;;
    v4)  # issue 47's matrix on the V4-Flash slice: experts x KV dtype in V4_RUNS (EXPERTS:KV[:peer]),
      # transformers beside the bf16-expert runs (it cannot share packed MXFP4 experts)
      # V4_BATCHES (default "1 8"), V4_PROMPT (2048), V4_MODEL (v4-flash-slice | v4-pro-slice)
      batches=""; for b in ${V4_BATCHES:-1 8}; do batches+=" --batch $b"; done
      for run in ${V4_RUNS:-fp4:fp8 fp4:auto bf16:auto:peer}; do
        IFS=: read -r experts kv peer <<<"$run"
        timeout "${V4_TIMEOUT:-200}" python3 -m benchmarks.v4_slice $batches --prompt-len "${V4_PROMPT:-2048}" \
          --model "${V4_MODEL:-v4-flash-slice}" \
          --new-tokens 17 --cadence --profile "1x${V4_PROMPT:-2048}" --expert-dtype "$experts" --kv-cache-dtype "$kv" \
          ${peer:+--hf-peer 1x${V4_PROMPT:-2048} --hf-peer 8x${V4_PROMPT:-2048}} --out "$out/v4_${experts}_${kv}" \
          >"$out/v4_${experts}_${kv}.log" 2>&1
        grep -v -i warn "$out/v4_${experts}_${kv}.log" | grep -E "^generate|^cadence|^decode|^transformers|^summary|^    |Error" | cut -c1-200
      done ;;
    e2e|all)
      timeout "${E2E_TIMEOUT:-540}" python3 -m benchmarks.e2e --model v2-lite --model v3-slice --hf-peer --out "$out" ${QUICK:+--quick} 2>&1
      python3 -m benchmarks.plots "$out" ;;
  esac
done
