#!/usr/bin/env bash
# DeepGEMM probe: why sgl-deep-gemm 0.2.2 fails on torch 2.11, and whether DeepGEMM built here runs.
set -u
out="${OUT:-/tmp/out}"; mkdir -p "$out"
exec > >(tee -a "$out/probe.log") 2>&1
bash tools/gpu_session.sh none >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import torch,sys;print(torch.__version__, torch.version.cuda, sys.version.split()[0])"
CUDA_HOME=${CUDA_HOME:-$(dirname $(dirname $(which nvcc)))}; echo "CUDA_HOME=$CUDA_HOME"; nvcc --version | tail -2
echo "== A. skipped (seen: undefined symbol c10::cuda::CUDAErrorLogCapture)"
echo "== B. sgl-deep-gemm 0.2.2: one fp8_gemm_nt"
python3 .dg_src/probe_sgl.py 2>&1 | tail -8
echo "== C. build DeepGEMM (upstream 54e2261) against this torch"
rm -rf /tmp/dgpkg && mkdir -p /tmp/dgpkg && cp -r .dg_src/src/deep_gemm /tmp/dgpkg/ && cp -r /tmp/site/deep_gemm/include/cute /tmp/site/deep_gemm/include/cutlass /tmp/dgpkg/deep_gemm/include/
TD=$(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")
PI=$(python3 -c "import sysconfig;print(sysconfig.get_path('include'))")
SUF=$(python3 -c "import sysconfig;print(sysconfig.get_config_var('EXT_SUFFIX'))")
EXTRA=""; [[ -f $CUDA_HOME/include/cusparse.h ]] || EXTRA="-I$PWD/.dg_src/stub"
t0=$(date +%s)
g++ -std=c++17 -O2 -fPIC -shared -Wno-psabi -Wno-deprecated-declarations -D_GLIBCXX_USE_CXX11_ABI=1 \
  -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H -DFMT_HEADER_ONLY \
  -I$CUDA_HOME/include -I$CUDA_HOME/include/cccl $EXTRA -I/tmp/dgpkg/deep_gemm/include -I$TD/include -I$TD/include/torch/csrc/api/include -I$PI \
  .dg_src/src/csrc/python_api.cpp -o /tmp/dgpkg/deep_gemm/_C$SUF \
  -L$CUDA_HOME/lib64 -L$TD/lib -Wl,-rpath,$TD/lib -Wl,-rpath,$CUDA_HOME/lib64 \
  -lc10 -lc10_cuda -ltorch -ltorch_cpu -ltorch_cuda -ltorch_python -lcudart -lnvrtc -lcublasLt -lcublas -lcuda 2>&1 | grep -E "error|warning: unused" | head -20
echo "build rc=${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s"; ls -la /tmp/dgpkg/deep_gemm/_C*.so
echo "== D. the build: GEMMs at V3 shapes"
PYTHONPATH=/tmp/dgpkg:$PYTHONPATH timeout 400 python3 .dg_src/probe_dg.py "$out" 2>&1 | tail -60
