// Float32 products on the CPU whose rows do not depend on the batch: y[m, n] = x[m] . w[n] for
// x [M, K], w [N, K] (a dense weight as stored), each dot product in 16 lanes (lane l: k = l, l + 16, ...
// ascending; each product and sum rounded), the lanes summed pairwise. A row's result is fixed by its
// own values and the weight, whatever M, the tiling, the threads or the instruction set: what the CPU
// path needs for logits bit-identical across chunks and batches, without padding one decode row to a
// 16-row BLAS product (four to five times the work at one row).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_calls.h"
#include "cpu_isa.h"
#include "cpu_lanes.h"

namespace {

constexpr int ROWS = 4;     // rows of x a tile
constexpr int COLS = 4;     // outputs a tile
constexpr int64_t MIN_THREAD_BYTES = 64 << 10;

STRATA_INLINE f32x16 load(const float* p, int64_t n) {  // n < 16: the first n lanes, zeros after
  f32x16 v = f32x16{};
  std::memcpy(&v, p, n * sizeof(float));
  return v;
}

// Outputs [n0, n1) of rows [m0, m1): tiles of ROWS x COLS dot products sharing their loads.
STRATA_INLINE void tile_body(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t m0,
                             int64_t m1, int64_t n0, int64_t n1) {
  const int64_t full = K / LANES * LANES;
  for (int64_t m = m0; m < m1; m += ROWS) {
    const int rows = int(std::min<int64_t>(ROWS, m1 - m));
    for (int64_t n = n0; n < n1; n += COLS) {
      const int cols = int(std::min<int64_t>(COLS, n1 - n));
      f32x16 acc[ROWS][COLS] = {};
      for (int64_t k = 0; k < full; k += LANES) {
        f32x16 a[ROWS], b[COLS];
        for (int r = 0; r < rows; ++r) std::memcpy(&a[r], x + (m + r) * K + k, sizeof(f32x16));
        for (int c = 0; c < cols; ++c) std::memcpy(&b[c], w + (n + c) * K + k, sizeof(f32x16));
        for (int r = 0; r < rows; ++r)
          for (int c = 0; c < cols; ++c) acc[r][c] = a[r] * b[c] + acc[r][c];  // rounded twice
      }
      if (full < K) {  // the tail in the first lanes; zeros elsewhere add exactly nothing
        for (int r = 0; r < rows; ++r)
          for (int c = 0; c < cols; ++c)
            acc[r][c] = load(x + (m + r) * K + full, K - full) * load(w + (n + c) * K + full, K - full) + acc[r][c];
      }
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) y[(m + r) * N + n + c] = lane_sum(acc[r][c]);
    }
  }
}

using TileFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);

#define STRATA_BODY(NAME, ATTRIBUTES)                                                                      \
  ATTRIBUTES void NAME(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t m0,         \
                       int64_t m1, int64_t n0, int64_t n1) {                                               \
    tile_body(x, w, y, K, N, m0, m1, n0, n1);                                                              \
  }
STRATA_BODY(tiles_avx512, STRATA_AVX512)
STRATA_BODY(tiles_avx2, STRATA_AVX2)
STRATA_BODY(tiles_generic, )
#undef STRATA_BODY

TileFn pick() { return strata_cpu::for_isa<TileFn>(&tiles_avx512, &tiles_avx2, &tiles_generic); }

// x [M, K], w [N, K] float32 contiguous -> [M, N] float32.
at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_cpu: shapes ", x.sizes(), " ",
              w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "linear_cpu: float32 only");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const TileFn body = pick();
  // work items: blocks of 64 outputs by blocks of 64 rows; a thread takes at least MIN_THREAD_BYTES of weights
  constexpr int64_t NB = 64, MB = 64;
  const int64_t nblocks = (N + NB - 1) / NB, mblocks = (M + MB - 1) / MB;
  const int64_t grain = std::max<int64_t>(1, MIN_THREAD_BYTES / (NB * K * int64_t(sizeof(float))));
  at::parallel_for(0, nblocks * mblocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t nb = item % nblocks, mb = item / nblocks;
      body(xp, wp, yp, K, N, mb * MB, std::min(M, (mb + 1) * MB), nb * NB, std::min(N, (nb + 1) * NB));
    }
  });
  return y;
}

}  // namespace

at::Tensor strata_cpu::linear(const at::Tensor& x, const at::Tensor& weight) { return linear_cpu(x, weight); }

TORCH_LIBRARY_FRAGMENT(strata, m) { m.def("linear_cpu(Tensor x, Tensor weight) -> Tensor"); }

TORCH_LIBRARY_IMPL(strata, CPU, m) { m.impl("linear_cpu", &linear_cpu); }
