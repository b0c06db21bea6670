// Launch sizes shared by more than one CUDA source of the fused backend (chapters 11
// and 14), defined once here: the one block that turns the builds' partial boxes into
// the robust box (params_kernel of grid_build_cuda.cu and of tree_build_cuda.cu, a
// thread per (bound, axis, block)), and the blocks of the tree's kernels
// (tree_build_cuda.cu and tree_search_cuda.cu).
#pragma once

#include "grid.h"
#include "tree.h"

namespace extkernels {
namespace {

constexpr int kParamsThreads = 6 * kRobustBlocks;

constexpr int kTreeThreads = 128;  // four warps, four queries per block
static_assert(kFanout == 32, "the kernels give one lane to each child of a node");

}  // namespace
}  // namespace extkernels
