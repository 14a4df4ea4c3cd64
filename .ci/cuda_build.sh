#!/usr/bin/env bash
# CUDA build check: build oases._C as the real CUDAExtension (csrc/*.cpp with OASES_WITH_CUDA and
# csrc/cuda/*.cu, for sm_80 and sm_90) against the CUDA build of the pinned torch, in a second
# virtual environment, then check that it loads there and reports CUDA.  `make cuda-build` runs it.
#
#   .venv-cuda/             torch==<pinned>+cu<NN> (the registry's default Linux wheel) and the
#                           build tools; the CPU build in .venv stays the default and is untouched
#   ~/.cache/oases/wheels   the wheels downloaded: torch and its CUDA libraries are fetched once
#   build/cuda/temp         ninja's objects: a warm rebuild recompiles only what changed
#   build/cuda/site         oases (links to python_api/oases) + the CUDA _C, on .venv-cuda's path
#
# This machine's pip settings (a find-links of local CPU wheels, a constraints file) would
# substitute the local CPU torch for the registry's, so the CUDA venv's pip runs with
# PIP_CONFIG_FILE=/dev/null and without PIP_FIND_LINKS.  Nothing built here runs without a GPU:
# the check is that the module links against libcudart / libc10_cuda and imports.
#
# Environment: OASES_CUDA_VENV (default .venv-cuda), OASES_WHEEL_CACHE (default
# ${XDG_CACHE_HOME:-~/.cache}/oases/wheels), CUDA_HOME (default: the toolkit holding nvcc),
# TORCH_CUDA_ARCH_LIST (default "8.0;9.0"), MAX_JOBS (default 2), PYTHON (default python3).
#
# With --test-deps it also installs the rest of requirements.txt into .venv-cuda (pytest, ...): what
# `make gpu-check` needs to run the test suite and the benchmarks there.
set -euo pipefail
test_deps=0
for arg in "$@"; do
  case "$arg" in
    --test-deps) test_deps=1 ;;
    *) echo "cuda-build: unknown argument $arg (expected: --test-deps)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
root="$PWD"
venv="${OASES_CUDA_VENV:-.venv-cuda}"
py="$venv/bin/python"
wheels="${OASES_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/oases/wheels}"
say() { echo "cuda-build: $*"; }
start=$(date +%s)

# --- The CUDA toolkit: CUDA_HOME, else the toolkit whose bin/ holds a real nvcc. -------------------
if [[ -z "${CUDA_HOME:-}" ]]; then
  for candidate in /usr/local/cuda "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /nonexistent)")")")"; do
    if [[ -x "$candidate/bin/nvcc" && -d "$candidate/include" ]]; then CUDA_HOME="$candidate"; break; fi
  done
fi
if [[ -z "${CUDA_HOME:-}" || ! -x "$CUDA_HOME/bin/nvcc" ]]; then
  echo "cuda-build: no CUDA toolkit found (set CUDA_HOME to the directory whose bin/ holds nvcc)" >&2
  exit 1
fi
export CUDA_HOME
nvcc_version="$("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
say "CUDA toolkit $nvcc_version at $CUDA_HOME"

# --- .venv-cuda: the registry's torch (a CUDA build), installed once, then reused. -------------------
torch_pin="$(grep -E '^torch==' requirements.txt)"
build_reqs=("$torch_pin" $(grep -E '^(numpy|pybind11|ninja)==' requirements.txt) setuptools==80.9.0 wheel==0.45.1)
stamp="$venv/.oases-cuda-deps"
wanted="${build_reqs[*]}"
registry_pip() {  # pip against the registry alone: no local CPU wheels, no constraints file
  env -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null "$py" -m pip "$@"
}
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$wanted" ]]; then
  test -x "$py" || "${PYTHON:-python3}" -m venv "$venv"
  mkdir -p "$wheels"
  # Wheels are kept in $wheels: a new venv installs from there without the network; only what
  # is missing there is downloaded (torch and its CUDA libraries: ~3 GB, once).
  if ! registry_pip install --quiet --no-index --find-links "$wheels" "${build_reqs[@]}" 2>/dev/null; then
    say "downloading ${build_reqs[*]} and their dependencies into $wheels"
    registry_pip download --quiet --dest "$wheels" "${build_reqs[@]}"
    registry_pip install --quiet --no-index --find-links "$wheels" "${build_reqs[@]}"
  fi
  echo "$wanted" > "$stamp"
fi
if [[ $test_deps == 1 ]]; then
  test_stamp="$venv/.oases-cuda-test-deps"
  if [[ ! -f "$test_stamp" || "$(cat "$test_stamp")" != "$(cat requirements.txt)" ]]; then
    say "installing requirements.txt into $venv (torch stays the CUDA build)"
    registry_pip download --quiet --dest "$wheels" -r requirements.txt
    registry_pip install --quiet --no-index --find-links "$wheels" -r requirements.txt
    cp requirements.txt "$test_stamp"
  fi
fi
torch_cuda="$("$py" -c 'import torch; print(torch.version.cuda or "")')"
if [[ -z "$torch_cuda" ]]; then
  echo "cuda-build: $venv has a torch without CUDA ($("$py" -c 'import torch; print(torch.__version__)'));" \
       "remove $venv and retry (was the local CPU wheel substituted?)" >&2
  exit 1
fi
if [[ "${torch_cuda%%.*}" != "${nvcc_version%%.*}" ]]; then
  echo "cuda-build: torch was built with CUDA $torch_cuda but nvcc is $nvcc_version: the major versions must match" >&2
  exit 1
fi
say "torch $("$py" -c 'import torch; print(torch.__version__)') (CUDA $torch_cuda), $(( $(date +%s) - start )) s so far"

# --- Build: csrc/*.cpp with OASES_WITH_CUDA + csrc/cuda/*.cu, out of tree (the CPU build keeps
#     python_api/oases/_C*.so). Torch's CUDA headers include cusparse.h etc., which come with
#     torch's nvidia-* wheels, not with this toolkit: put those on the include path. ----------------
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
include_path="$site/nvidia/cu${torch_cuda%%.*}/include:$site/nvidia/cudnn/include:$site/nvidia/nccl/include"
export CPATH="$include_path${CPATH:+:$CPATH}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0}"
export MAX_JOBS="${MAX_JOBS:-2}"
build_start=$(date +%s)
OASES_BUILD_CUDA=1 "$py" setup.py --quiet build_ext --build-lib build/cuda/lib --build-temp build/cuda/temp
so="$(ls build/cuda/lib/oases/_C*.so)"
say "built $so in $(( $(date +%s) - build_start )) s (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
for arch in 80 90; do
  if [[ "$TORCH_CUDA_ARCH_LIST" == *"${arch:0:1}.${arch:1:1}"* ]] && \
     ! grep -q "code=sm_$arch" build/cuda/temp/build.ninja; then
    echo "cuda-build: build/cuda/temp/build.ninja has no code=sm_$arch: the arch list was not applied" >&2
    exit 1
  fi
done

# --- Stage `oases` for .venv-cuda: the sources by link, the CUDA extension beside them. ------------
stage="build/cuda/site"
rm -rf "$stage" && mkdir -p "$stage/oases"
for entry in python_api/oases/*; do
  case "$(basename "$entry")" in _C*.so|__pycache__) continue ;; esac
  ln -s "$root/$entry" "$stage/oases/$(basename "$entry")"
done
ln -s "$root/$so" "$stage/oases/$(basename "$so")"
ln -s "$root/oases_kernels" "$stage/oases_kernels"
echo "$root/$stage" > "$site/oases-cuda-build.pth"

# --- Check: the module imports beside the CUDA torch and says it was built with CUDA. --------------
(cd /tmp && "$root/$py" - "$root/$so" <<'EOF'
import subprocess, sys
import torch
import oases
from oases import _C

info = _C.build_info()
assert info["cuda"] is True, f"build_info() = {info}: built without OASES_WITH_CUDA"
assert info["torch"] == torch.__version__.split("+")[0], f"built for torch {info['torch']}, running {torch.__version__}"
assert _C.__file__ == sys.argv[1] or _C.__file__.endswith(sys.argv[1].rsplit("/", 1)[1]), _C.__file__
linked = subprocess.run(["ldd", _C.__file__], capture_output=True, text=True).stdout
for lib in ("libcudart", "libc10_cuda"):
    assert lib in linked, f"{_C.__file__} does not link {lib}:\n{linked}"
ops = sorted(name for name in dir(_C) if not name.startswith("_"))
print(f"cuda-build: import oases._C ok: build_info()={info}, ops={ops}, "
      f"torch {torch.__version__}, torch.cuda.is_available()={torch.cuda.is_available()}")
EOF
)
say "done in $(( $(date +%s) - start )) s"
