#include "batched_copy.h"

#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cstring>

namespace oases {
namespace {

// A thread of the CPU path copies at least this many bytes (smaller calls stay on one thread).
constexpr int64_t kGrainBytes = int64_t{1} << 20;

// Whether tensors on `t` may be copied to/from a slab on `slab` in one call.
bool host_device_pair(const torch::Tensor& t, const torch::Tensor& slab) {
#ifdef OASES_WITH_CUDA
  return t.is_cuda() && slab.is_cpu();
#else
  (void)t;
  (void)slab;
  return false;
#endif
}

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
    TORCH_CHECK(i == 0 || t.device() == tensors[0].device(), "tensors[", i, "]: on ", t.device(),
                " but tensors[0] is on ", tensors[0].device(), " (one device per call)");
    TORCH_CHECK(t.device() == slab.device() || host_device_pair(t, slab), "tensors[", i, "]: on ",
                t.device(), " but slab is on ", slab.device(), " (copy across devices with .to())");
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    // nbytes <= capacity - offset, not offset + nbytes <= capacity: that sum can overflow.
    TORCH_CHECK(offsets[i] >= 0 && nbytes <= capacity - offsets[i], "offsets[", i, "]=",
                offsets[i], ": tensor of ", nbytes, " bytes does not fit a slab of ", capacity,
                " bytes");
  }
  if (!tensors.empty() && host_device_pair(tensors[0], slab)) {
    TORCH_CHECK(slab.is_pinned(), "slab: host memory must be pinned for asynchronous copies to/from ",
                tensors[0].device(), " (allocate it with pin_memory=True)");
  }
}

// Copies every pair on the CPU. The pairs' bytes, laid end to end, are split evenly over
// at::parallel_for's threads, so one large tensor is shared out as well as many small ones:
//
//   pairs:   |--- 0 ---|- 1 -||------ 3 ------|      (pair 2 empty: never touched)
//   threads: |---- thread 0 ----|---- thread 1 ----|
void copy_pairs(const std::vector<char*>& src, const std::vector<char*>& dst,
                const std::vector<int64_t>& nbytes) {
  const size_t n = src.size();
  std::vector<int64_t> start(n + 1, 0);  // start[i]: where pair i begins in the concatenation
  for (size_t i = 0; i < n; ++i) start[i + 1] = start[i] + nbytes[i];
  const int64_t total = start[n];
  if (total == 0) return;
  at::parallel_for(0, total, kGrainBytes, [&](int64_t begin, int64_t end) {
    // The last pair starting at or before `begin`, then every pair starting before `end`.
    size_t i = static_cast<size_t>(std::upper_bound(start.begin(), start.end(), begin) - start.begin()) - 1;
    for (; i < n && start[i] < end; ++i) {
      const int64_t lo = std::max(begin, start[i]);
      const int64_t hi = std::min(end, start[i + 1]);
      // An empty tensor's data_ptr() may be null, and memcpy with a null pointer is undefined.
      if (hi > lo) std::memcpy(dst[i] + (lo - start[i]), src[i] + (lo - start[i]), hi - lo);
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
  if (n > 0 && host_device_pair(tensors[0], slab)) {
    const c10::DeviceGuard guard(tensors[0].device());  // the current stream of the tensors' GPU
    std::vector<void*> vs(src.begin(), src.end()), vd(dst.begin(), dst.end());
    batched_memcpy_async_cuda(vs, vd, nbytes);
    return;
  }
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

int64_t check_batch(const std::vector<torch::Tensor>& tensors, const torch::Tensor& slab,
                    const std::vector<int64_t>& offsets) {
  check_args(tensors, slab, offsets);
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel() * static_cast<int64_t>(t.element_size());
  return total;
}

void pack(const std::vector<torch::Tensor>& tensors, torch::Tensor slab,
          const std::vector<int64_t>& offsets) {
  copy(tensors, slab, offsets, /*to_slab=*/true);
}

void unpack(torch::Tensor slab, const std::vector<torch::Tensor>& tensors,
            const std::vector<int64_t>& offsets) {
  copy(tensors, slab, offsets, /*to_slab=*/false);
}

}  // namespace oases
