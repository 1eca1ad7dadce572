// The 16-lane float32 vectors the batch-invariant CPU kernels compute in (attention, linear), and
// their fixed-order horizontal sum.
#pragma once

#include <cstdint>

#ifndef STRATA_INLINE
#define STRATA_INLINE inline __attribute__((always_inline))
#endif

namespace {

constexpr int LANES = 16;

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

// The lanes summed pairwise (lane l + width into lane l, width 8, 4, 2, 1): lane 0's value.
STRATA_INLINE float lane_sum(f32x16 v) {
  v = v + __builtin_shuffle(v, i32x16{8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15});
  v = v + __builtin_shuffle(v, i32x16{4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7});
  v = v + __builtin_shuffle(v, i32x16{2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3});
  v = v + __builtin_shuffle(v, i32x16{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1});
  return v[0];
}

}  // namespace
