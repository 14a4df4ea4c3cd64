#include "batched_copy.h"

#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#ifdef OASES_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include <algorithm>
#include <cstring>

namespace oases {
namespace {

// A thread of the CPU path copies at least this many bytes (smaller calls stay on one thread).
constexpr int64_t kGrainBytes = int64_t{1} << 20;

// Runs (see plan_runs): tensors of at most kSmallBytes each, at most kRunBytes in all. Out to the
// host, a run is gathered by one block per tensor first, which pays only below kGatherBytes (H200,
// 2026-11-26: 16 x 256 KiB gathered then copied at 0.60 x the per-tensor copies' rate, 256 x 16 KiB
// at 3.5 x); in, a run needs no gather, and runs up to kSmallBytes pay.
constexpr int64_t kSmallBytes = int64_t{1} << 20;
constexpr int64_t kGatherBytes = int64_t{64} << 10;
constexpr int64_t kRunBytes = int64_t{64} << 20;
// Where a run starts in its device buffer: congruent to its slab offset modulo kAlign, so every
// tensor of it has the alignment there that it has in the slab.
constexpr int64_t kAlign = 16;

int64_t nbytes_of(const torch::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// The allocation a tensor's bytes lie in: its storage's.
const void* owner_of(const torch::Tensor& t) { return t.storage().data_ptr().get(); }

// A run: pairs [first, last) whose slab regions lie end to end, each small (<= small_bytes, not
// empty) and at an offset that its element size divides. Such a run moves between the slab and
// one device buffer in one copy; every other pair is a run of its own.
//
//   slab:   |-a-|--b--|-c-|        |---d (2 MiB)---|-e-|
//   runs:   [a b c]                [d]              [e]
struct Run {
  size_t first, last;
  int64_t offset, nbytes;  // in the slab
};

std::vector<Run> plan_runs(const std::vector<int64_t>& offsets, const std::vector<int64_t>& nbytes,
                           const std::vector<int64_t>& element_sizes, int64_t small_bytes = kSmallBytes) {
  std::vector<Run> runs;
  bool open = false;  // whether the last run may take the next pair
  for (size_t i = 0; i < offsets.size(); ++i) {
    const bool small = nbytes[i] > 0 && nbytes[i] <= small_bytes && offsets[i] % element_sizes[i] == 0;
    if (small && open) {
      Run& r = runs.back();
      if (r.offset + r.nbytes == offsets[i] && r.nbytes + nbytes[i] <= kRunBytes) {
        r.last = i + 1;
        r.nbytes += nbytes[i];
        continue;
      }
    }
    runs.push_back(Run{i, i + 1, offsets[i], nbytes[i]});
    open = small;
  }
  return runs;
}

// Pairs of the same owner (the allocation on the tensors' side) that continue one another in
// both source and destination become one pair; empty pairs go. Only within one owner: memory
// from two allocations may lie end to end, and one cudaMemcpyAsync across both is invalid.
void merge_adjacent(std::vector<char*>& src, std::vector<char*>& dst, std::vector<int64_t>& nbytes,
                    const std::vector<const void*>& owners) {
  size_t kept = 0;
  const void* last_owner = nullptr;
  for (size_t i = 0; i < src.size(); ++i) {
    if (nbytes[i] == 0) continue;
    if (kept > 0 && owners[i] == last_owner && src[kept - 1] + nbytes[kept - 1] == src[i] &&
        dst[kept - 1] + nbytes[kept - 1] == dst[i]) {
      nbytes[kept - 1] += nbytes[i];
      continue;
    }
    src[kept] = src[i];
    dst[kept] = dst[i];
    nbytes[kept] = nbytes[i];
    last_owner = owners[i];
    ++kept;
  }
  src.resize(kept);
  dst.resize(kept);
  nbytes.resize(kept);
}

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

#ifdef OASES_WITH_CUDA
// GPU -> pinned slab: the runs of small tensors are first gathered (one kernel on the SMs) into a
// device staging buffer laid out as their slab regions, then each run leaves in one DMA copy:
//
//   GPU:    a  .. b .. c        d (2 MiB)
//             \   |   /          |
//   staging: [a b c]             |           (one gather kernel)
//              |                 |
//   slab:    |-a-|--b--|-c-|     |---d---|   (one cudaMemcpyAsync per run, per large tensor)
//
// All on the current stream; the staging buffer is freed when this returns (its reuse is ordered
// after the copies on that stream by the caching allocator).
void pack_to_host_cuda(const std::vector<torch::Tensor>& tensors, const torch::Tensor& slab,
                       const std::vector<int64_t>& offsets) {
  const size_t n = tensors.size();
  std::vector<int64_t> nbytes(n), element_sizes(n);
  for (size_t i = 0; i < n; ++i) {
    nbytes[i] = nbytes_of(tensors[i]);
    element_sizes[i] = static_cast<int64_t>(tensors[i].element_size());
  }
  const std::vector<Run> runs = plan_runs(offsets, nbytes, element_sizes, kGatherBytes);
  int64_t staged = 0;
  for (const Run& r : runs) {
    if (r.last - r.first > 1) staged += r.nbytes + kAlign;
  }
  torch::Tensor staging;
  if (staged > 0) staging = at::empty({staged}, at::TensorOptions().dtype(at::kByte).device(tensors[0].device()));
  std::vector<void*> gather_src, gather_dst;
  std::vector<int64_t> gather_bytes;
  std::vector<char*> dma_src, dma_dst;
  std::vector<int64_t> dma_bytes;
  std::vector<const void*> dma_owners;
  char* const host = static_cast<char*>(slab.data_ptr());
  int64_t cursor = 0;
  for (const Run& r : runs) {
    if (r.last - r.first == 1) {
      dma_src.push_back(static_cast<char*>(tensors[r.first].data_ptr()));
      dma_dst.push_back(host + r.offset);
      dma_bytes.push_back(nbytes[r.first]);
      dma_owners.push_back(owner_of(tensors[r.first]));
      continue;
    }
    // the first position at or after the cursor congruent to the run's slab offset (mod kAlign):
    // at most kAlign - 1 bytes of padding, as `staged` allows
    const int64_t start = cursor + ((r.offset - cursor) % kAlign + kAlign) % kAlign;
    char* const run_on_device = static_cast<char*>(staging.data_ptr()) + start;
    for (size_t i = r.first; i < r.last; ++i) {
      gather_src.push_back(tensors[i].data_ptr());
      gather_dst.push_back(run_on_device + (offsets[i] - r.offset));
      gather_bytes.push_back(nbytes[i]);
    }
    dma_src.push_back(run_on_device);
    dma_dst.push_back(host + r.offset);
    dma_bytes.push_back(r.nbytes);
    dma_owners.push_back(staging.data_ptr());
    cursor = start + r.nbytes;
  }
  batched_copy_cuda(gather_src, gather_dst, gather_bytes);
  merge_adjacent(dma_src, dma_dst, dma_bytes, dma_owners);
  batched_memcpy_async_cuda(std::vector<void*>(dma_src.begin(), dma_src.end()),
                            std::vector<void*>(dma_dst.begin(), dma_dst.end()), dma_bytes);
}
#endif

// The (src, dst, nbytes) pairs of a copy between `tensors` and slab regions, merged (merge_adjacent).
struct Pairs {
  std::vector<char*> src, dst;
  std::vector<int64_t> nbytes;
};

Pairs pairs_of(const std::vector<torch::Tensor>& tensors, const torch::Tensor& slab,
               const std::vector<int64_t>& offsets, bool to_slab) {
  const size_t n = tensors.size();
  Pairs p{std::vector<char*>(n), std::vector<char*>(n), std::vector<int64_t>(n)};
  std::vector<const void*> owners(n);
  char* base = static_cast<char*>(slab.data_ptr());
  for (size_t i = 0; i < n; ++i) {
    char* t = static_cast<char*>(tensors[i].data_ptr());
    p.src[i] = to_slab ? t : base + offsets[i];
    p.dst[i] = to_slab ? base + offsets[i] : t;
    p.nbytes[i] = nbytes_of(tensors[i]);
    owners[i] = owner_of(tensors[i]);
  }
  merge_adjacent(p.src, p.dst, p.nbytes, owners);
  return p;
}

void copy(const std::vector<torch::Tensor>& tensors, torch::Tensor slab,
          const std::vector<int64_t>& offsets, bool to_slab) {
  check_args(tensors, slab, offsets);
#ifdef OASES_WITH_CUDA
  if (!tensors.empty() && (tensors[0].is_cuda() || slab.is_cuda())) {
    const c10::DeviceGuard guard(tensors[0].is_cuda() ? tensors[0].device() : slab.device());
    if (to_slab && slab.is_cpu()) {
      pack_to_host_cuda(tensors, slab, offsets);
    } else {
      const Pairs p = pairs_of(tensors, slab, offsets, to_slab);
      std::vector<void*> vs(p.src.begin(), p.src.end()), vd(p.dst.begin(), p.dst.end());
      if (slab.is_cuda()) {
        batched_copy_cuda(vs, vd, p.nbytes);  // same GPU: one kernel
      } else {
        batched_memcpy_async_cuda(vs, vd, p.nbytes);  // pinned host -> GPU: the DMA engines
      }
    }
    // The tensors' memory is reused only after this stream is done with them (a no-op where
    // this stream is the one that allocated them).
    const c10::Stream stream = at::cuda::getCurrentCUDAStream();
    for (const auto& t : tensors) {
      if (t.is_cuda() && t.numel() > 0) t.record_stream(stream);
    }
    return;
  }
#endif
  TORCH_CHECK(slab.is_cpu(), "slab: device ", slab.device(),
              " needs an extension built with CUDA (OASES_BUILD_CUDA=1)");
  const Pairs p = pairs_of(tensors, slab, offsets, to_slab);
  copy_pairs(p.src, p.dst, p.nbytes);
}

}  // namespace

int64_t check_batch(const std::vector<torch::Tensor>& tensors, const torch::Tensor& slab,
                    const std::vector<int64_t>& offsets) {
  check_args(tensors, slab, offsets);
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel() * static_cast<int64_t>(t.element_size());
  return total;
}

std::tuple<std::vector<torch::Tensor>, std::vector<torch::Tensor>> empty_batch(
    const std::vector<int64_t>& offsets, const std::vector<std::vector<int64_t>>& shapes,
    const std::vector<at::ScalarType>& dtypes, at::Device device) {
  TORCH_CHECK(shapes.size() == offsets.size() && dtypes.size() == offsets.size(), "specs: need one shape and ",
              "one dtype per offset, got ", shapes.size(), " shapes and ", dtypes.size(), " dtypes for ",
              offsets.size(), " offsets");
  const size_t n = offsets.size();
  std::vector<int64_t> nbytes(n), element_sizes(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t numel = 1;
    for (size_t d = 0; d < shapes[i].size(); ++d) {
      TORCH_CHECK(shapes[i][d] >= 0, "specs[", i, "]: negative size ", shapes[i][d], " in dimension ", d);
      numel *= shapes[i][d];
    }
    element_sizes[i] = static_cast<int64_t>(c10::elementSize(dtypes[i]));
    nbytes[i] = numel * element_sizes[i];
    TORCH_CHECK(offsets[i] >= 0, "offsets[", i, "]=", offsets[i], ": must not be negative");
  }
  std::vector<torch::Tensor> outs(n), owners;
  for (const Run& r : plan_runs(offsets, nbytes, element_sizes)) {
    if (r.last - r.first == 1) {
      outs[r.first] = at::empty(shapes[r.first], at::TensorOptions().dtype(dtypes[r.first]).device(device));
      owners.push_back(outs[r.first]);
      continue;
    }
    const int64_t start = r.offset % kAlign;
    const int64_t size = (start + r.nbytes + kAlign - 1) / kAlign * kAlign;  // every element size divides it
    torch::Tensor flat = at::empty({size}, at::TensorOptions().dtype(at::kByte).device(device));
    std::vector<std::pair<at::ScalarType, torch::Tensor>> typed;  // flat as each dtype of the run
    for (size_t i = r.first; i < r.last; ++i) {
      auto it = std::find_if(typed.begin(), typed.end(), [&](const auto& p) { return p.first == dtypes[i]; });
      if (it == typed.end()) it = typed.insert(typed.end(), {dtypes[i], flat.view(dtypes[i])});
      std::vector<int64_t> strides(shapes[i].size(), 1);
      for (size_t d = shapes[i].size(); d-- > 1;) strides[d - 1] = strides[d] * shapes[i][d];
      // one view each; its offset is a whole number of elements (plan_runs: the offset is)
      outs[i] = it->second.as_strided(shapes[i], strides, (start + offsets[i] - r.offset) / element_sizes[i]);
    }
    owners.push_back(flat);
  }
  return {outs, owners};
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
