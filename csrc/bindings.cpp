// Python bindings of oases._C.
#include <torch/extension.h>

#include "batched_copy.h"

namespace {

py::dict build_info() {
  py::dict info;
#ifdef OASES_WITH_CUDA
  info["cuda"] = true;
#else
  info["cuda"] = false;
#endif
  info["torch"] = TORCH_VERSION;
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Oases compiled extension: batched host/device copies for the offload engine.";
  m.def("build_info", &build_info, "How this extension was built: {'cuda': bool, 'torch': str}.");
  m.def("pack", &oases::pack, py::arg("tensors"), py::arg("slab"), py::arg("offsets"),
        "slab[offsets[i]:offsets[i]+nbytes(tensors[i])] = bytes(tensors[i]) for all i (one call).");
  m.def("unpack", &oases::unpack, py::arg("slab"), py::arg("tensors"), py::arg("offsets"),
        "bytes(tensors[i]) = slab[offsets[i]:offsets[i]+nbytes(tensors[i])] for all i (one call).");
}
