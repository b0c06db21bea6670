// Launch helpers shared by every CUDA source of the C++ backend (chapter 9) and of the
// fused backend (chapters 11 and 14): the block size of the point-wise kernels, the
// number of blocks that covers n threads, whether the current stream is being captured
// into a CUDA graph (then nothing may be read back on the host), and the mask of a
// whole warp for the shuffles.
#pragma once

#include <cstdint>

#include <c10/cuda/CUDAGraphsC10Utils.h>

namespace extkernels {
namespace {

constexpr int kThreads = 128;  // threads per block of the point-wise kernels
constexpr unsigned kFullWarp = 0xffffffffu;  // every lane of a warp takes part

inline int blocks_for(int64_t n, int threads = kThreads) {
  return (int)((n + threads - 1) / threads);
}

inline bool capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() !=
         c10::cuda::CaptureStatus::None;
}

}  // namespace
}  // namespace extkernels
