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
  // The copies run without the GIL (arguments are converted before it is released), so a Python
  // thread can issue them while others compute: the CPU's copy stream (oases.offload.CopyEngine).
  m.def("pack", &oases::pack, py::arg("tensors"), py::arg("slab"), py::arg("offsets"),
        py::call_guard<py::gil_scoped_release>(),
        "slab[offsets[i]:offsets[i]+nbytes(tensors[i])] = bytes(tensors[i]) for all i (one call).\n"
        "CPU: memcpy split over the intra-op threads, GIL released; CUDA: same-device one kernel, "
        "GPU <-> pinned host one cudaMemcpyAsync per tensor, on the current stream.");
  m.def("check_batch", &oases::check_batch, py::arg("tensors"), py::arg("slab"), py::arg("offsets"),
        "The checks of pack/unpack, raising as they do, without copying; returns sum of nbytes(tensors[i]).");
  m.def("unpack", &oases::unpack, py::arg("slab"), py::arg("tensors"), py::arg("offsets"),
        py::call_guard<py::gil_scoped_release>(),
        "bytes(tensors[i]) = slab[offsets[i]:offsets[i]+nbytes(tensors[i])] for all i (one call).\n"
        "Same devices and streams as pack.");
}
