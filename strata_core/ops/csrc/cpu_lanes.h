// The 16-lane float32 vectors the batch-invariant CPU kernels compute in (experts, attention, linear),
// a scalar in every lane, and their fixed-order horizontal sum.
#pragma once

#include <cstdint>
#include <cstring>

#ifndef STRATA_INLINE
#define STRATA_INLINE inline __attribute__((always_inline))
#endif

namespace {

constexpr int LANES = 16;

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

// v in every lane, the same bits (a negative zero, a NaN). Through an array, not ``v - f32x16{}`` or a
// braced list: GCC 12 builds those in a target("avx512f") body lane by lane (16 masked broadcasts in
// one dependency chain, several a decoded block, which makes that body slower than the AVX2 one); this
// form is one broadcast in every body.
STRATA_INLINE f32x16 splat(float v) {
  float lanes[LANES];
  for (int l = 0; l < LANES; ++l) lanes[l] = v;
  f32x16 out;
  std::memcpy(&out, lanes, sizeof(out));
  return out;
}

// The lanes summed pairwise (lane l + width into lane l, width 8, 4, 2, 1): lane 0's value.
STRATA_INLINE float lane_sum(f32x16 v) {
  v = v + __builtin_shuffle(v, i32x16{8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15});
  v = v + __builtin_shuffle(v, i32x16{4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7});
  v = v + __builtin_shuffle(v, i32x16{2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3});
  v = v + __builtin_shuffle(v, i32x16{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1});
  return v[0];
}

}  // namespace
