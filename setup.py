"""Build and install Oases: the `oases` package (python_api/oases), the Triton kernels
(oases_kernels) and the optional compiled extension `oases._C` (csrc/).

The extension is a CPU `CppExtension` when torch has no CUDA and a `CUDAExtension` (adding
csrc/cuda/*.cu) when it has; OASES_BUILD_CUDA=0|1 forces the choice. Build without isolation
(`pip install --no-build-isolation -e .`): torch must be importable while building.
"""
import glob
import os

from setuptools import find_packages, setup


def _want_cuda() -> bool:
    forced = os.environ.get("OASES_BUILD_CUDA")
    if forced not in (None, "", "0", "1"):
        raise SystemExit(f"OASES_BUILD_CUDA must be 0 or 1, got {forced!r}")
    if forced is not None and forced != "":
        return forced == "1"
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.version.cuda is not None and CUDA_HOME is not None


def _extensions():
    try:
        from torch.utils import cpp_extension
    except ImportError as err:  # build isolation hides torch: say how to build instead
        raise SystemExit(
            "building Oases needs torch importable: pip install --no-build-isolation -e ."
        ) from err
    sources = sorted(glob.glob("csrc/*.cpp"))
    args = {"cxx": ["-O3", "-std=c++17"]}
    if _want_cuda():
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        args["nvcc"] = ["-O3", "-DOASES_WITH_CUDA"]
        args["cxx"].append("-DOASES_WITH_CUDA")
        ext = cpp_extension.CUDAExtension("oases._C", sources, extra_compile_args=args)
    else:
        ext = cpp_extension.CppExtension("oases._C", sources, extra_compile_args=args)
    return [ext], {"build_ext": cpp_extension.BuildExtension}


_ext_modules, _cmdclass = _extensions()

setup(
    name="oases",
    version="0.1.0",
    description="Overlapped tensor-parallel training for commodity GPU servers",
    python_requires=">=3.10",
    package_dir={"oases": "python_api/oases", "oases_kernels": "oases_kernels"},
    packages=["oases"]
    + ["oases." + p for p in find_packages("python_api/oases")]
    + ["oases_kernels"],
    ext_modules=_ext_modules,
    cmdclass=_cmdclass,
    install_requires=["torch>=2.4", "numpy", "scipy"],
    extras_require={"triton": ["triton"], "bench": ["matplotlib"]},
    entry_points={"console_scripts": ["oases-launch=oases.launch:main", "oases=oases.planner.cli:main"]},
)
