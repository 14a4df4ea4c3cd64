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
        "GPU -> pinned host: runs of small tensors end to end in the slab gathered by one kernel, one "
        "cudaMemcpyAsync per run or larger tensor, on the current stream (tensors record_stream-ed on it).");
  m.def("check_batch", &oases::check_batch, py::arg("tensors"), py::arg("slab"), py::arg("offsets"),
        "The checks of pack/unpack, raising as they do, without copying; returns sum of nbytes(tensors[i]).");
  m.def("unpack", &oases::unpack, py::arg("slab"), py::arg("tensors"), py::arg("offsets"),
        py::call_guard<py::gil_scoped_release>(),
        "bytes(tensors[i]) = slab[offsets[i]:offsets[i]+nbytes(tensors[i])] for all i (one call).\n"
        "Same devices and streams as pack; tensors that continue one another in the slab and in memory "
        "(as empty_batch lays them out) move in one copy.");
  m.def("empty_batch", &oases::empty_batch, py::arg("offsets"), py::arg("shapes"), py::arg("dtypes"),
        py::arg("device"),
        "(outs, owners): new tensors of shapes[i], dtypes[i] on device to unpack slab[offsets[i]:...] into; "
        "a run of small tensors end to end in the slab shares one owner laid out as the slab (views).");
}
