#include "batched_copy.h"

#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>

#include <cstring>

namespace oases {
namespace {

void check_args(const std::vector<torch::Tensor>& tensors, const torch::Tensor& slab,
                const std::vector<int64_t>& offsets) {
  TORCH_CHECK(tensors.size() == offsets.size(), "offsets: need one offset per tensor, got ",
              offsets.size(), " offsets for ", tensors.size(), " tensors");
  TORCH_CHECK(slab.dim() == 1 && slab.scalar_type() == torch::kUInt8 && slab.is_contiguous(),
              "slab: must be a contiguous 1-D uint8 tensor");
  const int64_t capacity = slab.numel();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    TORCH_CHECK(t.is_contiguous(), "tensors[", i, "]: must be contiguous");
    TORCH_CHECK(t.device() == slab.device(), "tensors[", i, "]: on ", t.device(),
                " but slab is on ", slab.device(), " (copy across devices with .to())");
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    // nbytes <= capacity - offset, not offset + nbytes <= capacity: that sum can overflow.
    TORCH_CHECK(offsets[i] >= 0 && nbytes <= capacity - offsets[i], "offsets[", i, "]=",
                offsets[i], ": tensor of ", nbytes, " bytes does not fit a slab of ", capacity,
                " bytes");
  }
}

// Copies every pair; the pairs are split across at::parallel_for's threads on the CPU.
void copy_pairs(const std::vector<char*>& src, const std::vector<char*>& dst,
                const std::vector<int64_t>& nbytes) {
  at::parallel_for(0, static_cast<int64_t>(src.size()), 1, [&](int64_t begin, int64_t end) {
    // An empty tensor's data_ptr() may be null, and memcpy with a null pointer is undefined.
    for (int64_t i = begin; i < end; ++i) {
      if (nbytes[i] > 0) std::memcpy(dst[i], src[i], nbytes[i]);
    }
  });
}

void copy(const std::vector<torch::Tensor>& tensors, torch::Tensor slab,
          const std::vector<int64_t>& offsets, bool to_slab) {
  check_args(tensors, slab, offsets);
  const size_t n = tensors.size();
  std::vector<char*> src(n), dst(n);
  std::vector<int64_t> nbytes(n);
  char* base = static_cast<char*>(slab.data_ptr());
  for (size_t i = 0; i < n; ++i) {
    char* t = static_cast<char*>(tensors[i].data_ptr());
    char* s = base + offsets[i];
    src[i] = to_slab ? t : s;
    dst[i] = to_slab ? s : t;
    nbytes[i] = tensors[i].numel() * static_cast<int64_t>(tensors[i].element_size());
  }
#ifdef OASES_WITH_CUDA
  if (slab.is_cuda()) {
    const c10::DeviceGuard guard(slab.device());  // stream and table on the slab's GPU
    std::vector<void*> vs(src.begin(), src.end()), vd(dst.begin(), dst.end());
    batched_copy_cuda(vs, vd, nbytes);
    return;
  }
#endif
  TORCH_CHECK(slab.is_cpu(), "slab: device ", slab.device(),
              " needs an extension built with CUDA (OASES_BUILD_CUDA=1)");
  copy_pairs(src, dst, nbytes);
}

}  // namespace

void pack(const std::vector<torch::Tensor>& tensors, torch::Tensor slab,
          const std::vector<int64_t>& offsets) {
  copy(tensors, slab, offsets, /*to_slab=*/true);
}

void unpack(torch::Tensor slab, const std::vector<torch::Tensor>& tensors,
            const std::vector<int64_t>& offsets) {
  copy(tensors, slab, offsets, /*to_slab=*/false);
}

}  // namespace oases
