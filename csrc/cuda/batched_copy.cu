// Batched copies on the current CUDA stream, with the contract of the host path in batched_copy.cpp:
//   batched_copy_cuda          one launch copies many (src, dst, nbytes) pairs on one GPU: block b
//                              walks pair b's bytes in 16-byte words where both ends are aligned,
//                              bytes elsewhere;
//   batched_memcpy_async_cuda  GPU <-> pinned host: one cudaMemcpyAsync per pair (the DMA engines,
//                              no SMs), issued back to back; the offload engine's path.
// Neither synchronises the host: callers order them with events (oases.offload.CopyEngine).
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef OASES_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace oases {
namespace {

__global__ void batched_copy_kernel(const char* const* src, char* const* dst,
                                    const int64_t* nbytes) {
  const char* s = src[blockIdx.x];
  char* d = dst[blockIdx.x];
  const int64_t n = nbytes[blockIdx.x];
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
  // Pointer and size tables travel in one small host-to-device copy on the same stream.
  std::vector<int64_t> table(3 * n);
  for (size_t i = 0; i < n; ++i) {
    table[i] = reinterpret_cast<int64_t>(src[i]);
    table[n + i] = reinterpret_cast<int64_t>(dst[i]);
    table[2 * n + i] = nbytes[i];
  }
  int64_t* device_table = nullptr;
  check(cudaMallocAsync(reinterpret_cast<void**>(&device_table), table.size() * sizeof(int64_t), stream),
        "cudaMallocAsync");
  check(cudaMemcpyAsync(device_table, table.data(), table.size() * sizeof(int64_t),
                        cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync");
  batched_copy_kernel<<<static_cast<unsigned>(n), 256, 0, stream>>>(
      reinterpret_cast<const char* const*>(device_table),
      reinterpret_cast<char* const*>(device_table + n), device_table + 2 * n);
  check(cudaGetLastError(), "batched_copy_kernel");
  check(cudaFreeAsync(device_table, stream), "cudaFreeAsync");
  // No host synchronisation: a copy from pageable host memory returns only once `table` has been
  // staged, so it may go out of scope now; the kernel and the free are ordered on `stream`.
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
