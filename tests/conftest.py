import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _spawn import harness_device  # noqa: E402  (after the path is set)

# The device the suite's distributed harness uses: OASES_TEST_DEVICE=cpu|cuda, else cuda where
# GPUs exist. On CPU, Triton's interpreter must be chosen before any @triton.jit function is
# defined; on CUDA the kernels are compiled for the GPU.
if harness_device() == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
