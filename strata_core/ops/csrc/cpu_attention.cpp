// Causal GQA attention on the CPU whose rows do not depend on the batch: out[t, h] for query t at
// positions[t], head h, over the keys s with lo <= s <= positions[t] (lo = positions[t] - window + 1
// with a sliding window, else 0).
//
// Every row's arithmetic is fixed by its own query and visible keys alone, so a token's output has the
// same bits in a prompt chunk of any size, in a decode window of any batch, with any number of keys
// past its position given (the cache capacity), any thread count and either instruction set:
//   score[s] = q . k[s] in 16 lanes (lane l: d = l, l + 16, ... ascending; each product and sum
//              rounded), the lanes summed pairwise, times scale
//   m        = max over the visible s of score[s]
//   w[s]     = exp(score[s] - m)              (exp_lanes, cpu_lanes.h: basic operations only)
//   total    = the visible w[s] summed in 16 lanes (lane s % 16, s ascending), the lanes pairwise,
//              plus exp(sink - m) with a sink
//   out[d]   = (sum over the visible s, ascending, of w[s] * v[s, d]) / total
// Keys outside a row's range are never read into its sums (a cache's unwritten rows may hold anything).
// With row ids, key s is row rows[s] of keys / values (a paged cache's pool read in place, no gather).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_isa.h"
#include "cpu_lanes.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int ROW_TILE = 8;  // query rows of one work item

const i32x16 LANE_INDEX = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

struct Problem {
  const float *q, *k, *v, *sinks;
  const int64_t *pos, *rows;  // rows: key s at row rows[s] of k / v (nullptr: row s)
  float* out;
  int64_t T, nh, nkv, D, S, window;
  float scale;
};

STRATA_INLINE int64_t key_row(const Problem& p, int64_t s) { return p.rows != nullptr ? p.rows[s] : s; }

// Rows [r0, r1) of kv head g (row r = rep index r / T, token r % T: query head g * rep + r / T).
STRATA_INLINE void rows_body(const Problem& p, int64_t g, int64_t r0, int64_t r1, std::vector<float>& scores) {
  const int64_t rep = p.nh / p.nkv, D = p.D, stride = p.nkv * D;
  const float ninf = -std::numeric_limits<float>::infinity();
  scores.resize(size_t(p.S + LANES));
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t t = r % p.T, h = g * rep + r / p.T, position = p.pos[t];
    const int64_t last = position < p.S - 1 ? position : p.S - 1;
    const int64_t first = p.window > 0 && position - p.window + 1 > 0 ? position - p.window + 1 : 0;
    const float* qr = p.q + (t * p.nh + h) * D;
    float* o = p.out + (t * p.nh + h) * D;
    if (last < first) {  // no key visible
      for (int64_t d = 0; d < D; ++d) o[d] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const int64_t base = first / LANES * LANES;  // 16 scores a vector, score s in lane s % 16
    float* sc = scores.data();
    float m = ninf;
    for (int64_t s = first; s <= last; ++s) {
      const float score = lane_sum(dot_lanes(qr, p.k + key_row(p, s) * stride + g * D, D)) * p.scale;
      sc[s - base] = score;
      m = score > m ? score : m;
    }
    for (int64_t s = base; s < first; ++s) sc[s - base] = ninf;
    const int64_t end = (last + 1 - base + LANES - 1) / LANES * LANES + base;
    for (int64_t s = last + 1; s < end; ++s) sc[s - base] = ninf;
    f32x16 total = f32x16{};
    for (int64_t c = base; c < end; c += LANES) {
      f32x16 x;
      std::memcpy(&x, sc + (c - base), sizeof(x));
      const f32x16 w = exp_lanes(x - splat(m));
      const f32x16 kept = x == splat(ninf) ? f32x16{} : w;  // a key outside the range adds nothing
      total = total + kept;
      std::memcpy(sc + (c - base), &kept, sizeof(kept));
    }
    float sum = lane_sum(total);
    if (p.sinks != nullptr) sum = sum + exp_lanes(splat(p.sinks[h] - m))[0];
    for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
    int64_t d0 = 0;
    for (; d0 + LANES <= D; d0 += LANES) {  // 16 columns at a time, the keys in ascending order
      f32x16 acc = f32x16{};
      for (int64_t s = first; s <= last; ++s) {
        f32x16 v;
        std::memcpy(&v, p.v + key_row(p, s) * stride + g * D + d0, sizeof(v));
        acc = v * sc[s - base] + acc;  // the scalar broadcast to every lane
      }
      acc = acc / splat(sum);
      std::memcpy(o + d0, &acc, sizeof(acc));
    }
    for (; d0 < D; ++d0) {  // the columns past the last 16: the same arithmetic one at a time
      float acc = 0.0f;
      for (int64_t s = first; s <= last; ++s) acc = sc[s - base] * p.v[key_row(p, s) * stride + g * D + d0] + acc;
      o[d0] = acc / sum;
    }
  }
}

using RowsFn = void (*)(const Problem&, int64_t, int64_t, int64_t, std::vector<float>&);

// The same body compiled for each instruction set (inlined, so vectorised with its registers).
#define STRATA_BODY(NAME, ATTRIBUTES)                                                                      \
  ATTRIBUTES void NAME(const Problem& p, int64_t g, int64_t r0, int64_t r1, std::vector<float>& scores) {  \
    rows_body(p, g, r0, r1, scores);                                                                       \
  }
STRATA_BODY(rows_avx512, STRATA_AVX512)
STRATA_BODY(rows_avx2, STRATA_AVX2)
STRATA_BODY(rows_generic, )
#undef STRATA_BODY

RowsFn pick() { return strata_cpu::for_isa<RowsFn>(&rows_avx512, &rows_avx2, &rows_generic); }

// q [T, nh, D], keys / values [N, nkv, D] float32 contiguous, positions [T] int64; sinks [nh] or
// undefined; window 0 = none; rows [S] int64 (key s is row rows[s], each < N) or undefined (S = N, key s
// row s). Returns [T, nh * D] float32.
at::Tensor attention_cpu(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                         const at::Tensor& positions, int64_t window, const c10::optional<at::Tensor>& sinks,
                         const c10::optional<at::Tensor>& row_ids) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.sizes() == keys.sizes(), "attention_cpu: shapes ",
              q.sizes(), " ", keys.sizes(), " ", values.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
              values.scalar_type() == at::kFloat, "attention_cpu: float32 tensors only");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == q.size(0),
              "attention_cpu: positions must be int64 [T]");
  const at::Tensor qc = q.contiguous(), kc = keys.contiguous(), vc = values.contiguous(),
                   pc = positions.contiguous();
  at::Tensor sc, rc;
  if (sinks.has_value() && sinks->defined()) sc = sinks->to(at::kFloat).contiguous();
  if (row_ids.has_value() && row_ids->defined()) {
    TORCH_CHECK(row_ids->scalar_type() == at::kLong && row_ids->dim() == 1, "attention_cpu: rows must be int64 [S]");
    rc = row_ids->contiguous();  // each id < N: checked by the Python wrapper (ops/cpu_kernels.py)
  }
  const int64_t T = qc.size(0), nh = qc.size(1), D = qc.size(2), nkv = kc.size(1);
  const int64_t S = rc.defined() ? rc.numel() : kc.size(0);
  TORCH_CHECK(kc.size(2) == D && nkv > 0 && nh % nkv == 0, "attention_cpu: ", nh, " heads over ", nkv, " kv heads");
  TORCH_CHECK(!sc.defined() || sc.numel() == nh, "attention_cpu: ", sc.numel(), " sinks for ", nh, " heads");
  at::Tensor out = at::empty({T, nh * D}, qc.options());
  if (T == 0) return out;
  const Problem p{qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                  sc.defined() ? sc.data_ptr<float>() : nullptr, pc.data_ptr<int64_t>(),
                  rc.defined() ? rc.data_ptr<int64_t>() : nullptr, out.data_ptr<float>(),
                  T, nh, nkv, D, S, window, float(1.0 / std::sqrt(double(D)))};
  const int64_t rows = T * (nh / nkv), tiles = (rows + ROW_TILE - 1) / ROW_TILE;
  // a tile's work is about its rows times the keys times D: enough of it per thread to pay a wake-up
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, ROW_TILE * S * D));
  const RowsFn body = pick();
  at::parallel_for(0, nkv * tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / tiles, r0 = (item % tiles) * ROW_TILE;
      body(p, g, r0, std::min(r0 + ROW_TILE, rows), scores);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(strata, m) {
  m.def("attention_cpu(Tensor q, Tensor keys, Tensor values, Tensor positions, int window, Tensor? sinks, "
        "Tensor? rows=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(strata, CPU, m) { m.impl("attention_cpu", &attention_cpu); }
