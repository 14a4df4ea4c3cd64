// Batched copy between many tensors and one flat byte slab (the offload copy engine's core).
#pragma once
#include <torch/extension.h>

#include <tuple>
#include <vector>

namespace oases {

// slab[offsets[i] : offsets[i] + nbytes(tensors[i])] = bytes(tensors[i]) for every i, in one call.
//
// Devices: tensors and slab on the same device (CPU: multi-threaded memcpy; CUDA: one kernel), or
// (CUDA build) tensors on one GPU and slab in pinned host memory, on the current stream, no host
// synchronisation: small tensors (<= 64 KiB) whose slab regions lie end to end are gathered by one
// kernel and leave in one cudaMemcpyAsync per run; every other tensor in one of its own. CUDA
// tensors are record_stream-ed on the current stream (the caller may drop them at once). Pairs
// that continue one another on both sides move as one. Every check runs before any byte moves.
void pack(const std::vector<torch::Tensor>& tensors, torch::Tensor slab,
          const std::vector<int64_t>& offsets);

// The checks pack and unpack run (raising as they do); returns the bytes the tensors hold.
int64_t check_batch(const std::vector<torch::Tensor>& tensors, const torch::Tensor& slab,
                    const std::vector<int64_t>& offsets);

// bytes(tensors[i]) = slab[offsets[i] : offsets[i] + nbytes(tensors[i])] for every i, in one call.
// Same devices and streams as pack; a GPU's copies from pinned memory are one cudaMemcpyAsync per
// tensor, or per run of tensors that continue one another in the slab and on the GPU (as
// empty_batch lays them out).
void unpack(torch::Tensor slab, const std::vector<torch::Tensor>& tensors,
            const std::vector<int64_t>& offsets);

// New tensors of shapes[i], dtypes[i] on `device` to unpack slab[offsets[i] : ...] into, as
// (outs, owners). A run of small tensors whose slab regions lie end to end (<= 1 MiB each, <= 64 MiB
// in all, each offset a multiple of its element size) shares one allocation, laid out as the slab
// (so unpack moves the run in one copy): its tensors are views of one owner, whose memory is
// freed once all of them are dropped. Every other tensor is its own owner.
std::tuple<std::vector<torch::Tensor>, std::vector<torch::Tensor>> empty_batch(
    const std::vector<int64_t>& offsets, const std::vector<std::vector<int64_t>>& shapes,
    const std::vector<at::ScalarType>& dtypes, at::Device device);

#ifdef OASES_WITH_CUDA
// Copies every (src[i] -> dst[i], nbytes[i]) pair on one GPU, on the current stream: one kernel
// launch per 128 pairs, the pairs passed in its parameter.
void batched_copy_cuda(const std::vector<void*>& src, const std::vector<void*>& dst,
                       const std::vector<int64_t>& nbytes);

// One cudaMemcpyAsync (cudaMemcpyDefault) per pair, all on the current stream: host <-> device
// copies on the DMA engines, leaving the SMs to compute. The host side must be pinned memory, or
// the copies stop being asynchronous.
void batched_memcpy_async_cuda(const std::vector<void*>& src, const std::vector<void*>& dst,
                               const std::vector<int64_t>& nbytes);
#endif

}  // namespace oases
