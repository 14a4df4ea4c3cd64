#!/usr/bin/env bash
# CUDA compile check: every csrc/**/*.cu must compile with nvcc for sm_80 and sm_90.
#
# Compiles without OASES_WITH_CUDA (the torch-free kernel and launcher; a CPU-only torch has no
# c10/cuda headers), into a temporary directory that is removed afterwards. Runs every compile,
# then fails if any failed. Uses `nvcc` from PATH, else $CUDA_HOME/bin/nvcc (CUDA_HOME defaults
# to /usr/local/cuda); where neither exists it prints that the check is skipped and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."

ARCHS=(sm_80 sm_90)

nvcc="$(command -v nvcc || true)"
if [[ -z "$nvcc" && -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]]; then
  nvcc="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
fi
if [[ -z "$nvcc" ]]; then
  echo "compile_cuda: nvcc not found (PATH, \${CUDA_HOME:-/usr/local/cuda}/bin): CUDA compile check skipped"
  exit 0
fi

mapfile -t sources < <(find csrc -name '*.cu' -type f | sort)
if [[ ${#sources[@]} -eq 0 ]]; then
  echo "compile_cuda: no .cu files under csrc/" >&2
  exit 1
fi

out="$(mktemp -d "${TMPDIR:-/tmp}/oases-nvcc.XXXXXX")"
trap 'rm -rf "$out"' EXIT

echo "compile_cuda: CUDA $("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p') ($nvcc)"
failed=0
for src in "${sources[@]}"; do
  for arch in "${ARCHS[@]}"; do
    obj="$out/$(echo "$src" | tr / _).$arch.o"
    start=$(date +%s%N)
    if "$nvcc" -c -Xcompiler -fPIC -std=c++17 -arch="$arch" "$src" -o "$obj"; then
      status=ok
    else
      status=FAILED
      failed=$((failed + 1))
    fi
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    echo "compile_cuda: $src -arch=$arch: $status (${ms} ms)"
  done
done

if [[ $failed -gt 0 ]]; then
  echo "compile_cuda: $failed of $(( ${#sources[@]} * ${#ARCHS[@]} )) compiles failed" >&2
  exit 1
fi
