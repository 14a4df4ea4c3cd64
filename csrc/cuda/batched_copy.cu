// Batched copies on the current CUDA stream, with the contract of the host path in batched_copy.cpp:
//   batched_copy_cuda          one launch copies up to 128 (src, dst, nbytes) pairs on one GPU,
//                              passed by value in its parameter: block b walks pair b's bytes in
//                              16-byte words where both ends are aligned, bytes elsewhere;
//   batched_memcpy_async_cuda  GPU <-> pinned host: one cudaMemcpyAsync per pair (the DMA engines,
//                              no SMs), issued back to back; the offload engine's path.
// Neither synchronises the host: callers order them with events (oases.offload.CopyEngine).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef OASES_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace oases {
namespace {

// The pairs of one launch travel by value as the kernel's parameter (3 KiB, under the 4 KiB that
// every CUDA version takes): no table to allocate and copy to the GPU first.
constexpr int kPairsPerLaunch = 128;

struct PairTable {
  const char* src[kPairsPerLaunch];
  char* dst[kPairsPerLaunch];
  int64_t nbytes[kPairsPerLaunch];
};

__global__ void batched_copy_kernel(const PairTable table) {
  const char* s = table.src[blockIdx.x];
  char* d = table.dst[blockIdx.x];
  const int64_t n = table.nbytes[blockIdx.x];
  const bool aligned = (reinterpret_cast<uintptr_t>(s) % 16 == 0) &&
                       (reinterpret_cast<uintptr_t>(d) % 16 == 0);
  int64_t done = 0;
  if (aligned) {
    const int64_t words = n / 16;
    const int4* s4 = reinterpret_cast<const int4*>(s);
    int4* d4 = reinterpret_cast<int4*>(d);
    for (int64_t i = threadIdx.x; i < words; i += blockDim.x) d4[i] = s4[i];
    done = words * 16;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

}  // namespace

void batched_copy_cuda(const std::vector<void*>& src, const std::vector<void*>& dst,
                       const std::vector<int64_t>& nbytes) {
  const size_t n = src.size();
  if (n == 0) return;
#ifdef OASES_WITH_CUDA
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
#else
  cudaStream_t stream = nullptr;
#endif
  // One launch per kPairsPerLaunch pairs, the pairs in its parameter.
  for (size_t first = 0; first < n; first += kPairsPerLaunch) {
    const size_t count = std::min(n - first, static_cast<size_t>(kPairsPerLaunch));
    PairTable table;
    for (size_t i = 0; i < count; ++i) {
      table.src[i] = static_cast<const char*>(src[first + i]);
      table.dst[i] = static_cast<char*>(dst[first + i]);
      table.nbytes[i] = nbytes[first + i];
    }
    batched_copy_kernel<<<static_cast<unsigned>(count), 256, 0, stream>>>(table);
    check(cudaGetLastError(), "batched_copy_kernel");
  }
}

void batched_memcpy_async_cuda(const std::vector<void*>& src, const std::vector<void*>& dst,
                               const std::vector<int64_t>& nbytes) {
#ifdef OASES_WITH_CUDA
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
#else
  cudaStream_t stream = nullptr;
#endif
  for (size_t i = 0; i < src.size(); ++i) {
    if (nbytes[i] == 0) continue;  // an empty tensor's pointer may be null
    check(cudaMemcpyAsync(dst[i], src[i], static_cast<size_t>(nbytes[i]), cudaMemcpyDefault, stream),
          "cudaMemcpyAsync");
  }
}

}  // namespace oases
