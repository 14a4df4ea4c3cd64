// Batched copy between many tensors and one flat byte slab (the offload copy engine's core).
#pragma once
#include <torch/extension.h>

#include <vector>

namespace oases {

// slab[offsets[i] : offsets[i] + nbytes(tensors[i])] = bytes(tensors[i]) for every i, in one call.
//
// Devices: tensors and slab on the same device (CPU: multi-threaded memcpy; CUDA: one kernel), or
// (CUDA build) tensors on one GPU and slab in pinned host memory (one cudaMemcpyAsync per tensor,
// all on the current stream, no host synchronisation). Every check runs before any byte moves.
void pack(const std::vector<torch::Tensor>& tensors, torch::Tensor slab,
          const std::vector<int64_t>& offsets);

// The checks pack and unpack run (raising as they do); returns the bytes the tensors hold.
int64_t check_batch(const std::vector<torch::Tensor>& tensors, const torch::Tensor& slab,
                    const std::vector<int64_t>& offsets);

// bytes(tensors[i]) = slab[offsets[i] : offsets[i] + nbytes(tensors[i])] for every i, in one call.
void unpack(torch::Tensor slab, const std::vector<torch::Tensor>& tensors,
            const std::vector<int64_t>& offsets);

#ifdef OASES_WITH_CUDA
// One kernel launch copies every (src[i] -> dst[i], nbytes[i]) pair on the current stream.
void batched_copy_cuda(const std::vector<void*>& src, const std::vector<void*>& dst,
                       const std::vector<int64_t>& nbytes);

// One cudaMemcpyAsync (cudaMemcpyDefault) per pair, all on the current stream: host <-> device
// copies on the DMA engines, leaving the SMs to compute. The host side must be pinned memory, or
// the copies stop being asynchronous.
void batched_memcpy_async_cuda(const std::vector<void*>& src, const std::vector<void*>& dst,
                               const std::vector<int64_t>& nbytes);
#endif

}  // namespace oases
