// The 16-lane float32 vectors the batch-invariant CPU kernels compute in (experts, attention, linear,
// the layer's small ops), a scalar in every lane, their fixed-order horizontal sum, a dot product in
// lanes, and exp lane-wise.
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

// Lane l of the products x[d] * y[d] over d = l, l + 16, ... (ascending), n floats each (each product and
// sum rounded: -ffp-contract=off); the tail in the first lanes, zeros elsewhere adding exactly nothing.
STRATA_INLINE f32x16 dot_lanes(const float* x, const float* y, int64_t n) {
  f32x16 acc = f32x16{};
  int64_t d = 0;
  for (; d + LANES <= n; d += LANES) {
    f32x16 a, b;
    std::memcpy(&a, x + d, sizeof(a));
    std::memcpy(&b, y + d, sizeof(b));
    acc = a * b + acc;
  }
  if (d < n) {
    f32x16 a = f32x16{}, b = f32x16{};
    std::memcpy(&a, x + d, (n - d) * sizeof(float));
    std::memcpy(&b, y + d, (n - d) * sizeof(float));
    acc = a * b + acc;
  }
  return acc;
}

// exp(x) lane-wise from basic operations (Cody-Waite reduction by ln 2, a degree-6 polynomial, the
// exponent added to the bits): within ~2 ulp of expf, and the same bits vectorised or not.
STRATA_INLINE f32x16 exp_lanes(f32x16 x) {
  const f32x16 lo = splat(-87.3f), hi = splat(88.3f);  // 2**n stays a normal float
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const f32x16 t = x * splat(1.44269504088896341f);
  const i32x16 ni = __builtin_convertvector(t + (t < 0 ? splat(-0.5f) : splat(0.5f)), i32x16);  // nearest n
  const f32x16 nf = __builtin_convertvector(ni, f32x16);
  f32x16 r = x - nf * splat(0.693359375f);
  r = r - nf * splat(-2.12194440e-4f);
  f32x16 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * (r * r) + r + splat(1.0f);
  const i32x16 bits = (ni + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace
