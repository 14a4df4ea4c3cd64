// Batched copy between many tensors and one flat byte slab (the offload copy engine's core).
#pragma once
#include <torch/extension.h>

#include <vector>

namespace oases {

// slab[offsets[i] : offsets[i] + nbytes(tensors[i])] = bytes(tensors[i]) for every i, in one call.
void pack(const std::vector<torch::Tensor>& tensors, torch::Tensor slab,
          const std::vector<int64_t>& offsets);

// bytes(tensors[i]) = slab[offsets[i] : offsets[i] + nbytes(tensors[i])] for every i, in one call.
void unpack(torch::Tensor slab, const std::vector<torch::Tensor>& tensors,
            const std::vector<int64_t>& offsets);

#ifdef OASES_WITH_CUDA
// One kernel launch copies every (src[i] -> dst[i], nbytes[i]) pair on the current stream.
void batched_copy_cuda(const std::vector<void*>& src, const std::vector<void*>& dst,
                       const std::vector<int64_t>& nbytes);
#endif

}  // namespace oases
