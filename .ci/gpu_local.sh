#!/usr/bin/env bash
# `make gpu-check-local`: the GPU check on a machine with one GPU and no package registry, with the
# interpreter's own packages (torch, triton, transformers, pytest, pytest-xdist already installed).
#
#   1. env        nvidia-smi, the versions, nvcc, whether `ip netns` / `tc` work (the link emulator)
#   2. build      oases._C as a CUDAExtension for this GPU, against this torch, with the system's g++
#                 (setup.py build_ext --inplace; its .so is copied to $out)
#   2b. oases-env `python -m oases.env` (`oases env`), the report a user pastes, with that build
#   3. gpu-tests  OASES_TEST_DEVICE=cuda: tests/test_cuda.py (copies, streams, offload, bf16 schedules),
#                 tests/test_kernels.py (the Triton kernels compiled for the GPU), tests/test_gpu_path.py
#   4. micro      python -m bench.cuda_micro: ceilings, chunked GEMM, Triton vs cuBLAS, copies, priority
#   5. memcheck   compute-sanitizer --tool memcheck on the copy tests
#   6. offload    python -m bench offload --device cuda --nproc 1 (the step with offload on and off)
#   7. profile    python -m bench profile --device cuda --nproc 1 (the planner's GPU profile, the
#                 link assumed: one GPU has no peer to measure it against)
#   8. plan       oases plan for Llama-7B on 16 such GPUs from that profile
#   9. cpu-suite  (OASES_GPU_STAGES names it) the test suite on gloo, ranks on the CPU cores
#  10. share      (named in OASES_GPU_STAGES) the multi-rank tier on NCCL, every rank on the one GPU
#                 as its own NCCL host (.ci/gpu_share.py: stages in order, 2 ranks first, then 4;
#                 share.json per test: outcome, NCCL calls; versions)
#  11. link-share python -m bench link --share-gpu: NCCL socket all-reduce / ring P2P, 64 KiB-256 MiB
#  12. layers-share  python -m bench layers --share-gpu: oases vs megatron, 2 ranks on the one GPU
#                 (a correctness mode: the ranks take turns on the GPU, so not a speedup)
# For issue 41: OASES_GPU_STAGES="env oases-env share link-share layers-share" OASES_GPU_BUDGET_S=570
# (the stages' limits add up to 30 + 30 + 360 + 60 + 90 = 570 s, under the device's 600 s a call).
#
# Multi-rank runs outside the share stages stay on gloo. Each stage runs under a time
# limit cut to what is left of OASES_GPU_BUDGET_S (default 480 s), so a slow stage cannot starve
# the ones after it; its output goes to $out/log.txt and one line to $out/summary.txt.
# At most 8 files land in $out (the device tool brings back no more): log.txt, summary.txt, _C.so,
# cuda_micro.json / .md, offload.json, profile.json, plan.json (the PNGs: bench.cuda_plots, later).
# $out: OUT (the device tool's folder), else OASES_GPU_OUT, else bench/results/gpu-local.
# OASES_GPU_STAGES: the stages to run (default "env build oases-env gpu-tests micro memcheck offload profile plan").
# OASES_PREBUILT_SO: a _C .so built on such a machine before (used if the build fails);
# OASES_GPU_KERNEL_TESTS=0 leaves out tests/test_kernels.py; OASES_MICRO_ARGS: more arguments
# for bench.cuda_micro (e.g. "--sections batched_copies").
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-${OASES_GPU_OUT:-bench/results/gpu-local}}"
py="${PYTHON:-python3}"
budget="${OASES_GPU_BUDGET_S:-480}"
stages="${OASES_GPU_STAGES:-env build oases-env gpu-tests micro memcheck offload profile plan}"
mkdir -p "$out"
log="$out/log.txt"
summary="$out/summary.txt"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export PYTHONPATH="$PWD/python_api:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
t0=$(date +%s)
failed=0

left() { echo $(( budget - ($(date +%s) - t0) )); }

# stage NAME LIMIT_S COMMAND...: run it with `timeout` (LIMIT_S or what is left), log and summarise.
stage() {
  local name=$1 limit=$2; shift 2
  case " $stages " in *" $name "*) ;; *) return 0 ;; esac
  local remaining; remaining=$(left)
  if (( remaining < 20 )); then
    echo "$name: skipped (budget spent)" | tee -a "$summary"; failed=1; return 0
  fi
  (( limit > remaining )) && limit=$remaining
  echo "===== $name (limit ${limit}s) =====" >>"$log"
  local start rc; start=$(date +%s)
  timeout --kill-after=5 "$limit" bash -c '"$@"' "$name" "$@" >>"$log" 2>&1  # bash -c: the functions below
  rc=$?
  local line="$name: rc=$rc $(( $(date +%s) - start ))s"
  (( rc == 124 || rc == 137 )) && line="$line (timed out)"
  echo "$line" | tee -a "$summary"
  (( rc != 0 )) && failed=1
  tail -n 15 "$log" | sed "s/^/  [$name] /"
  return 0
}

env_report() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.sm --format=csv
  "$py" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0), 'nccl', torch.cuda.nccl.version())"
  "$py" -c "import transformers, pytest; print('transformers', transformers.__version__, 'pytest', pytest.__version__)"
  "$py" -c "import xdist; print('pytest-xdist', xdist.__version__)" || true
  nvcc --version | tail -n 2
  nproc
  if ip netns add oases-probe 2>/dev/null; then
    echo "ip netns: works"; ip netns del oases-probe
  else
    echo "ip netns: refused"
  fi
  if tc qdisc show dev lo >/dev/null 2>&1; then echo "tc: works"; else echo "tc: refused"; fi
  # Without root's netns: a user namespace of its own (`unshare -rn`) may still let tc shape its lo.
  if unshare -rn true 2>/dev/null; then
    echo "unshare -rn: works"
    if unshare -rn bash -c 'ip link set lo up && tc qdisc add dev lo root netem delay 1ms' 2>&1; then
      echo "tc in a user namespace: works"
    else
      echo "tc in a user namespace: refused"
    fi
  else
    echo "unshare -rn: refused"
  fi
}

build() {
  # In place, beside the sources (PYTHONPATH above): `pip install -e .` would fetch setuptools
  # for an isolated build, and there is no registry here. With the system's gcc/g++ (OASES_CC,
  # OASES_CXX; deliberately not the CC/CXX the image sets, /opt/gcc): on the H200 image of
  # 2026-11 an extension built by /opt/gcc's g++ crashed (SIGSEGV) on its first C++ exception,
  # i.e. on every argument error, and one built by /usr/bin/g++ (GCC 13.3, as torch 2.11's
  # build) raised properly (docs/results/gpu/nvidia-h200-2026-11-25/run3-compiler-diagnosis.txt;
  # the cause was not established: /opt/gcc's version was not read).
  local cc="${OASES_CC:-/usr/bin/gcc}" cxx="${OASES_CXX:-/usr/bin/g++}"
  [[ -x "$cc" && -x "$cxx" ]] || { cc="${CC:-gcc}"; cxx="${CXX:-g++}"; }
  echo "compilers: $cc, $cxx"
  local so  # this interpreter's name for the built module (another Python's build may sit beside it)
  so="python_api/oases/_C$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
  if CC="$cc" CXX="$cxx" OASES_BUILD_CUDA=1 MAX_JOBS="${MAX_JOBS:-16}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
       "$py" setup.py build_ext --inplace; then
    cp "$so" "$out/_C.so"
  elif [[ -n "${OASES_PREBUILT_SO:-}" && -f "${OASES_PREBUILT_SO}" ]]; then
    echo "build failed: using the prebuilt ${OASES_PREBUILT_SO}"
    cp "$OASES_PREBUILT_SO" "$so"
  else
    return 1
  fi
  "$py" -c "import oases._C as C, oases; info = C.build_info(); print('oases._C', info); assert info['cuda']"
}

gpu_tests() {
  OASES_TEST_DEVICE=cuda "$py" -m pytest -q -rfEs -p no:cacheprovider tests/test_cuda.py tests/test_gpu_path.py || local rc=$?
  if [[ "${OASES_GPU_KERNEL_TESTS:-1}" == 1 ]]; then
    OASES_TEST_DEVICE=cuda "$py" -m pytest -q -rfEs -p no:cacheprovider -n 8 tests/test_kernels.py || rc=$?
  fi
  return "${rc:-0}"
}

export -f env_report build gpu_tests
export py out
stage env 30 env_report
stage build 240 build
stage oases-env 30 "$py" -m oases.env
stage gpu-tests 180 gpu_tests
stage micro 150 "$py" -m bench.cuda_micro --out "$out" --watchdog 140 --no-plots ${OASES_MICRO_ARGS:-}
stage memcheck 120 env OASES_TEST_DEVICE=cuda compute-sanitizer --tool memcheck --target-processes all --error-exitcode 3 \
  "$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "batched_copies or copy_engine or offloader_round_trip"
# A Llama-sized layer stack that fills a good part of the GPU (about 60 GB at its peak on an H200):
# 1.6 B parameters twice (offload on and off both resident) and 64 checkpoints of 256 MiB; one more
# step per variant with the allocator's history: the allocations live at its peak, by frame.
stage offload 240 "$py" -m bench offload --device cuda --nproc 1 --parts step ${OASES_OFFLOAD_ARGS:---step-hidden 2048 \
  --step-heads 16 --step-layers 32 --step-seq-len 4096 --step-batch 8 --step-autocast bfloat16 --warmup 2 --iters 5 \
  --step-memory-peak} \
  --out "$work/offload"
cp "$(ls -t "$work"/offload/*.json 2>/dev/null | head -n 1)" "$out/offload.json" 2>/dev/null
stage profile 150 "$py" -m bench profile --device cuda --nproc 1 --assume-link 25gbit,20us --dtype bfloat16 \
  --hidden 4096 --heads 32 --seq-len 2048 --vocab 32000 --rows 1,2,4 --out "$work/profile" --profile-out "$out/profile.json"
stage plan 30 "$py" -m oases plan --model llama-7b --world 16 --device-memory 141GB \
  --profile "$out/profile.json" --out "$out/plan.json"
stage share 360 "$py" .ci/gpu_share.py --device cuda --workers "${OASES_SHARE_WORKERS:-6}" \
  --budget "${OASES_SHARE_BUDGET_S:-340}" --out "$work/share"
cp "$work/share/share.json" "$out/share.json" 2>/dev/null
stage link-share 60 "$py" -m bench link --device cuda --share-gpu --nproc 2 --out "$work/link"
cp "$(ls -t "$work"/link/*.json 2>/dev/null | head -n 1)" "$out/link.json" 2>/dev/null
stage layers-share 90 "$py" -m bench layers --device cuda --share-gpu --nproc 2 --model llama --layers 4 \
  --warmup 2 --iters 5 --out "$work/layers"
cp "$(ls -t "$work"/layers/*.json 2>/dev/null | head -n 1)" "$out/layers.json" 2>/dev/null
stage cpu-suite 300 env OASES_TEST_DEVICE=cpu "$py" -m pytest -q -rf --tb=short -p no:cacheprovider -n 14 \
  --maxfail 40 tests
echo "total: $(( $(date +%s) - t0 ))s, failed=$failed" | tee -a "$summary"
exit "$failed"
