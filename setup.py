"""Build and install Oases: the `oases` package (python_api/oases), the Triton kernels
(oases_kernels) and the optional compiled extension `oases._C` (csrc/).

The extension is a CPU `CppExtension` when torch has no CUDA and a `CUDAExtension` (adding
csrc/cuda/*.cu) when it has; OASES_BUILD_CUDA=0|1 forces the choice.

Install into an environment that already has torch, without build isolation:

    pip install --no-build-isolation .        # or -e . for development

`oases._C` is compiled against the torch it is built with and must be loaded beside that same
torch, so the build uses the installed one; pyproject.toml explains why torch is not a build
requirement. The version is written once, in python_api/oases/__init__.py, and read from there.
"""

import glob
import os
import re

from setuptools import find_packages, setup

_HERE = os.path.dirname(os.path.abspath(__file__))

_NO_TORCH = """
Oases could not be built: `import torch` failed while building ({err}).

oases._C is compiled against torch and must run beside the same torch, so the build uses the
torch already installed in your environment instead of fetching one. Install torch first
(https://pytorch.org/get-started/locally/), then build without isolation:

    pip install torch
    pip install --no-build-isolation .        # or: pip install --no-build-isolation -e .

If torch is installed and you still see this, pip built in an isolated environment that hides it:
add --no-build-isolation (a plain `pip install .` isolates the build).
"""


def _version() -> str:
    # Parsed, not imported: importing oases imports torch and the whole package.
    with open(os.path.join(_HERE, "python_api", "oases", "__init__.py"), encoding="utf-8") as f:
        found = re.findall(r'^__version__ = "([^"]+)"[ \t]*(?:#.*)?$', f.read(), flags=re.M)
    if len(found) != 1:
        raise SystemExit(f"expected one __version__ line in python_api/oases/__init__.py, found {len(found)}")
    return found[0]


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
    except ImportError as err:  # torch not installed, or hidden by build isolation
        raise SystemExit(_NO_TORCH.format(err=err)) from err
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
    version=_version(),
    description="Overlapped tensor-parallel training for commodity GPU servers",
    license="MIT",
    license_files=["LICENSE"],
    python_requires=">=3.10",
    package_dir={"oases": "python_api/oases", "oases_kernels": "oases_kernels"},
    packages=["oases"] + ["oases." + p for p in find_packages("python_api/oases")] + ["oases_kernels"],
    ext_modules=_ext_modules,
    cmdclass=_cmdclass,
    install_requires=["torch>=2.4", "numpy", "scipy"],
    extras_require={
        "triton": ["triton"],
        "bench": ["matplotlib"],
        "hf": ["transformers>=5.0", "accelerate>=1.15", "peft>=0.21", "trl>=1.16", "datasets>=5.2"],
    },
    entry_points={"console_scripts": ["oases-launch=oases.launch:main", "oases=oases.cli:main"]},
)
