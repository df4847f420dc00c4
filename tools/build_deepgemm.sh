#!/usr/bin/env bash
# Build DeepGEMM's host module against the torch installed here, for machines where no prebuilt
# wheel matches that torch (sgl-deep-gemm 0.2.2's _C.so needs a torch newer than 2.11).
#   bash tools/build_deepgemm.sh SRC TARGET [CUTLASS_INCLUDE]
# SRC: a DeepGEMM source tree (github.com/deepseek-ai/DeepGEMM; built and run here at 54e2261):
#      csrc/ and deep_gemm/. TARGET: where the package goes (then PYTHONPATH=TARGET).
# CUTLASS_INCLUDE: a directory holding cute/ and cutlass/ (default SRC/third-party/cutlass/include,
#      the submodule); the kernels DeepGEMM compiles at run time read them from TARGET/deep_gemm/include.
# With network access, `pip install --no-build-isolation git+https://github.com/deepseek-ai/DeepGEMM`
# does the same through its setup.py. Needs g++ (C++17), nvcc's CUDA_HOME and torch's headers.
set -euo pipefail
[[ $# -ge 2 ]] || { sed -n 2,10p "$0"; exit 2; }
src=$1 target=$2 cutlass=${3:-$1/third-party/cutlass/include}
for need in "$src/csrc/python_api.cpp" "$src/deep_gemm/__init__.py" "$cutlass/cute" "$cutlass/cutlass"; do
  [[ -e $need ]] || { echo "build_deepgemm: $need not found (see the usage above)" >&2; exit 2; }
done
cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
for header in cuda.h nvrtc.h cublasLt.h cusparse.h; do
  [[ -f $cuda_home/include/$header ]] || echo "build_deepgemm: $cuda_home/include/$header missing (torch's ATen/cuda headers include it): install it or point DEEPGEMM_EXTRA_INCLUDE at a directory holding it" >&2
done
read -r torch_dir py_include suffix abi < <(python3 -c "import os, sysconfig, torch
print(os.path.dirname(torch.__file__), sysconfig.get_path('include'), sysconfig.get_config_var('EXT_SUFFIX'), int(torch.compiled_with_cxx11_abi()))")
rm -rf "$target/deep_gemm" && mkdir -p "$target"
cp -r "$src/deep_gemm" "$target/" && cp -r "$cutlass/cute" "$cutlass/cutlass" "$target/deep_gemm/include/"
start=$(date +%s)
g++ -std=c++17 -O2 -fPIC -shared -Wno-psabi -Wno-deprecated-declarations -D_GLIBCXX_USE_CXX11_ABI="$abi" \
  -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H -DFMT_HEADER_ONLY \
  -I"$cuda_home/include" -I"$cuda_home/include/cccl" ${DEEPGEMM_EXTRA_INCLUDE:+-I"$DEEPGEMM_EXTRA_INCLUDE"} \
  -I"$target/deep_gemm/include" -I"$torch_dir/include" -I"$torch_dir/include/torch/csrc/api/include" -I"$py_include" \
  "$src/csrc/python_api.cpp" -o "$target/deep_gemm/_C$suffix" \
  -L"$cuda_home/lib64" -L"$torch_dir/lib" -Wl,-rpath,"$torch_dir/lib" -Wl,-rpath,"$cuda_home/lib64" \
  -lc10 -lc10_cuda -ltorch -ltorch_cpu -ltorch_cuda -ltorch_python -lcudart -lnvrtc -lcublasLt -lcublas -lcuda
echo "build_deepgemm: $target/deep_gemm/_C$suffix in $(( $(date +%s) - start )) s; use PYTHONPATH=$target"
