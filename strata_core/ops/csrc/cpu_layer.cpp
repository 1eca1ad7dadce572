// The small per-layer ops of the CPU forward in float32, each one call where the torch formulas take
// five to fifteen (a decode token's layer is otherwise bound by the host: ~150 small ops a layer).
// Every row's arithmetic is fixed by its own values alone, so a token's result has the same bits in a
// prompt chunk of any size, in a decode window of any batch, with any thread count and either
// instruction set (sums in 16 lanes, lane l taking d = l, l + 16, ... ascending, the lanes summed
// pairwise; each product and sum rounded: compiled without FP contraction):
//
//   rms_norm_cpu(x [..., D], w [D], eps):      ss = sum of x[d] * x[d] in lanes;
//                                              y[d] = w[d] * (x[d] * (1 / sqrt(ss / D + eps)))
//   norm_rope_cpu(x [T, heads, D], w? [D], eps, positions [T], inv_freq [D/2], mscale):
//                                              y = rms_norm(x) per head where w is given, else x; then
//                                              NEOX RoPE at angle a[i] = float(position) * inv_freq[i]:
//                                              c = cos(a), s = sin(a) (double, rounded to float; times
//                                              mscale unless 1), out[d] = y[d] * c + rot[d] * s with
//                                              rot[d] = -y[d + D/2] (d < D/2), y[d - D/2] (d >= D/2)
//   route_cpu(logits [T, E], k, norm, scale, min_sum):
//                                              p[e] = exp(x[e] - max) / (the exps summed in lanes);
//                                              the k largest p (ties: the lower expert first), largest
//                                              first; with norm each divided by max(their sum, k
//                                              ascending, min_sum); times scale unless 1
//   combine_cpu(rows [T, k, H], weights [T, k], residual? [T, H]):
//                                              out[t] = residual[t] + (rows[t, 0] * w[t, 0] +
//                                              rows[t, 1] * w[t, 1] + ...), j ascending
//   add_rms_norm_cpu(h [T, H], delta [T, H], w [H], eps):
//                                              s = h + delta (each sum rounded), then (s, rms_norm(s)):
//                                              a residual add and the next norm in one pass
//   qkv_rope_cpu(qkv [T, (nh + 2 nkv) D], wq?, wk?, eps, positions [T], inv_freq, mscale, nh, nkv,
//                keys [N, nkv, D], values [N, nkv, D], row_ids [P]):
//                                              q = norm_rope(qkv's q heads) returned; k = norm_rope(its
//                                              k heads) and its v heads copied into row row_ids[position]
//                                              of keys and values: the q/k norm, RoPE and the KV write of a
//                                              layer in one call (the angles computed once a token)
//   route_slot_ffn_cpu(x [T, H], router [E, H], k, norm, scale, min_sum, slots [E], counts [E], buffer, ...):
//                                              the router's product (linear_cpu), route_cpu, each pair's
//                                              slot slots[id] and counts[id] += 1, slot_ffn_cpu of the pairs,
//                                              combine_cpu of their rows: a layer's routed experts held in
//                                              a cache's slots, from its normed rows to its output, in one call
//
// The torch formulas (strata_core/model/ops.py, transformer.py, ops/combine.py) stay the references these
// are tested against (tests/test_cpu_layer.py, float32 within a relative 1e-5); every CPU path of a
// forward calls the same op, so logits stay bit-identical across chunks, batches and topologies.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_calls.h"
#include "cpu_isa.h"
#include "cpu_lanes.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// 1 / sqrt(mean of the squares + eps) of one row of n floats.
STRATA_INLINE float inv_rms(const float* x, int64_t n, float eps) {
  const float mean = lane_sum(dot_lanes(x, x, n)) / float(n);
  return 1.0f / std::sqrt(mean + eps);
}

// y = w * (x * r), elementwise over n floats (y may be x).
STRATA_INLINE void scale_row(const float* x, const float* w, float r, float* y, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] = w[d] * (x[d] * r);
}

struct NormRope {
  const float *x, *w, *inv_freq;
  const int64_t* pos;
  float* out;
  int64_t heads, D, row_stride, head_stride;  // x's strides (elements) of a row and of a head
  float eps, mscale;
};

// cs[i] = cos, cs[half + i] = sin of the angle position * inv_freq[i] (double, rounded to float; times mscale).
STRATA_INLINE void rope_angles(float position, const float* inv_freq, int64_t half, float mscale, float* cs) {
  for (int64_t i = 0; i < half; ++i) {
    const float angle = position * inv_freq[i];
    float c = float(std::cos(double(angle))), s = float(std::sin(double(angle)));
    if (mscale != 1.0f) c = c * mscale, s = s * mscale;
    cs[i] = c;
    cs[half + i] = s;
  }
}

// One head of D floats at x, normed with w (none: copied) into the scratch y, then rotated by cs into o.
STRATA_INLINE void norm_rope_head(const float* x, const float* w, float eps, const float* cs, int64_t D, float* y,
                                  float* o) {
  const int64_t half = D / 2;
  if (w != nullptr) {
    scale_row(x, w, inv_rms(x, D, eps), y, D);
  } else {
    std::memcpy(y, x, size_t(D) * sizeof(float));
  }
  for (int64_t i = 0; i < half; ++i) {
    const float c = cs[i], s = cs[half + i];
    o[i] = y[i] * c + -y[half + i] * s;
    o[half + i] = y[half + i] * c + y[i] * s;
  }
}

// Rows [t0, t1) of norm_rope_cpu.
STRATA_INLINE void norm_rope_body(const NormRope& p, int64_t t0, int64_t t1) {
  const int64_t D = p.D;
  std::vector<float> cs(static_cast<size_t>(D)), y(static_cast<size_t>(D));
  for (int64_t t = t0; t < t1; ++t) {
    rope_angles(float(p.pos[t]), p.inv_freq, D / 2, p.mscale, cs.data());
    for (int64_t h = 0; h < p.heads; ++h)
      norm_rope_head(p.x + t * p.row_stride + h * p.head_stride, p.w, p.eps, cs.data(), D, y.data(),
                     p.out + (t * p.heads + h) * D);
  }
}

struct QkvRope {
  const float *qkv, *wq, *wk, *inv_freq;
  const int64_t *pos, *row_ids;
  float *q, *keys, *values;
  int64_t nh, nkv, D, row_stride;  // qkv's stride (elements) of a row
  float eps, mscale;
};

// Rows [t0, t1) of qkv_rope_cpu: q rotated into q, k rotated and v copied into their pool rows.
STRATA_INLINE void qkv_rope_body(const QkvRope& p, int64_t t0, int64_t t1) {
  const int64_t D = p.D, kv_size = p.nkv * D;
  std::vector<float> cs(static_cast<size_t>(D)), y(static_cast<size_t>(D));
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t position = p.pos[t], row = p.row_ids[position];
    const float* x = p.qkv + t * p.row_stride;
    rope_angles(float(position), p.inv_freq, D / 2, p.mscale, cs.data());
    for (int64_t h = 0; h < p.nh; ++h)
      norm_rope_head(x + h * D, p.wq, p.eps, cs.data(), D, y.data(), p.q + (t * p.nh + h) * D);
    const float* k = x + p.nh * D;
    for (int64_t h = 0; h < p.nkv; ++h)
      norm_rope_head(k + h * D, p.wk, p.eps, cs.data(), D, y.data(), p.keys + row * kv_size + h * D);
    std::memcpy(p.values + row * kv_size, k + kv_size, size_t(kv_size) * sizeof(float));
  }
}

// Rows [t0, t1) of add_rms_norm_cpu over rows of D: s = h + d, y = rms_norm(s).
STRATA_INLINE void add_norm_body(const float* h, const float* d, const float* w, float* s, float* y, int64_t D,
                                 float eps, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    float* sum = s + t * D;
    for (int64_t i = 0; i < D; ++i) sum[i] = h[t * D + i] + d[t * D + i];
    scale_row(sum, w, inv_rms(sum, D, eps), y + t * D, D);
  }
}

// Rows [t0, t1) of rms_norm_cpu over rows of D.
STRATA_INLINE void norm_body(const float* x, const float* w, float* y, int64_t D, float eps, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) scale_row(x + t * D, w, inv_rms(x + t * D, D, eps), y + t * D, D);
}

// Rows [t0, t1) of route_cpu: E logits a row, k chosen.
STRATA_INLINE void route_body(const float* logits, int64_t* ids, float* weights, int64_t E, int64_t k, bool norm,
                              float scale, float min_sum, int64_t t0, int64_t t1) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t padded = (E + LANES - 1) / LANES * LANES;
  std::vector<float> p(static_cast<size_t>(padded));
  std::vector<char> taken(static_cast<size_t>(E));
  for (int64_t t = t0; t < t1; ++t) {
    const float* x = logits + t * E;
    float m = ninf;
    for (int64_t e = 0; e < E; ++e) m = x[e] > m ? x[e] : m;
    f32x16 total = f32x16{};
    for (int64_t c = 0; c < padded; c += LANES) {
      f32x16 v = splat(ninf);
      std::memcpy(&v, x + c, size_t(std::min<int64_t>(LANES, E - c)) * sizeof(float));
      const f32x16 w = exp_lanes(v - splat(m));
      const f32x16 kept = v == splat(ninf) ? f32x16{} : w;  // past E (or a -inf logit): nothing
      total = total + kept;
      std::memcpy(p.data() + c, &kept, sizeof(kept));
    }
    const float sum = lane_sum(total);
    for (int64_t e = 0; e < E; ++e) p[size_t(e)] = p[size_t(e)] / sum;
    std::fill(taken.begin(), taken.end(), 0);
    int64_t* row_ids = ids + t * k;
    float* row_w = weights + t * k;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[size_t(e)] && (best < 0 || p[size_t(e)] > p[size_t(best)])) best = e;
      taken[size_t(best)] = 1;
      row_ids[j] = best;
      row_w[j] = p[size_t(best)];
    }
    if (norm) {
      float s = 0.0f;
      for (int64_t j = 0; j < k; ++j) s = s + row_w[j];
      s = s > min_sum ? s : min_sum;
      for (int64_t j = 0; j < k; ++j) row_w[j] = row_w[j] / s;
    }
    if (scale != 1.0f)
      for (int64_t j = 0; j < k; ++j) row_w[j] = row_w[j] * scale;
  }
}

// Rows [t0, t1) of combine_cpu.
STRATA_INLINE void combine_body(const float* rows, const float* w, const float* residual, float* out, int64_t k,
                                int64_t H, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    float* o = out + t * H;
    const float* r = rows + t * k * H;
    const float* wt = w + t * k;
    for (int64_t h = 0; h < H; ++h) o[h] = r[h] * wt[0];
    for (int64_t j = 1; j < k; ++j)
      for (int64_t h = 0; h < H; ++h) o[h] = o[h] + r[j * H + h] * wt[j];
    if (residual != nullptr)
      for (int64_t h = 0; h < H; ++h) o[h] = residual[t * H + h] + o[h];
  }
}

using NormRopeFn = void (*)(const NormRope&, int64_t, int64_t);
using NormFn = void (*)(const float*, const float*, float*, int64_t, float, int64_t, int64_t);
using RouteFn = void (*)(const float*, int64_t*, float*, int64_t, int64_t, bool, float, float, int64_t, int64_t);
using CombineFn = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
using QkvRopeFn = void (*)(const QkvRope&, int64_t, int64_t);
using AddNormFn = void (*)(const float*, const float*, const float*, float*, float*, int64_t, float, int64_t, int64_t);

// Each body compiled for each instruction set (inlined, so vectorised with its registers).
#define STRATA_BODIES(SUFFIX, ATTRIBUTES)                                                                  \
  ATTRIBUTES void norm_rope_##SUFFIX(const NormRope& p, int64_t t0, int64_t t1) { norm_rope_body(p, t0, t1); } \
  ATTRIBUTES void norm_##SUFFIX(const float* x, const float* w, float* y, int64_t D, float eps, int64_t t0,    \
                                int64_t t1) {                                                              \
    norm_body(x, w, y, D, eps, t0, t1);                                                                    \
  }                                                                                                        \
  ATTRIBUTES void route_##SUFFIX(const float* logits, int64_t* ids, float* weights, int64_t E, int64_t k,      \
                                 bool norm, float scale, float min_sum, int64_t t0, int64_t t1) {          \
    route_body(logits, ids, weights, E, k, norm, scale, min_sum, t0, t1);                                  \
  }                                                                                                        \
  ATTRIBUTES void combine_##SUFFIX(const float* rows, const float* w, const float* residual, float* out,       \
                                   int64_t k, int64_t H, int64_t t0, int64_t t1) {                         \
    combine_body(rows, w, residual, out, k, H, t0, t1);                                                    \
  }                                                                                                        \
  ATTRIBUTES void qkv_rope_##SUFFIX(const QkvRope& p, int64_t t0, int64_t t1) { qkv_rope_body(p, t0, t1); }    \
  ATTRIBUTES void add_norm_##SUFFIX(const float* h, const float* d, const float* w, float* s, float* y,        \
                                    int64_t D, float eps, int64_t t0, int64_t t1) {                        \
    add_norm_body(h, d, w, s, y, D, eps, t0, t1);                                                          \
  }
STRATA_BODIES(avx512, STRATA_AVX512)
STRATA_BODIES(avx2, STRATA_AVX2)
STRATA_BODIES(generic, )
#undef STRATA_BODIES

// rows of at least this many floats of work go to one thread (a decode row never wakes a second one)
constexpr int64_t GRAIN_FLOATS = 1 << 14;

int64_t grain(int64_t per_row) { return std::max<int64_t>(1, GRAIN_FLOATS / std::max<int64_t>(1, per_row)); }

void check_float(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), op, ": ", name, " must be float32 on the CPU");
}

// x [..., D], weight [D] float32 -> [..., D] float32.
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float(x, "rms_norm_cpu", "x");
  check_float(weight, "rms_norm_cpu", "weight");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm_cpu: shapes ", x.sizes(),
              " ", weight.sizes());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t D = xc.size(-1), T = D ? xc.numel() / D : 0;
  if (T == 0) return y;
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const NormFn body = strata_cpu::for_isa<NormFn>(&norm_avx512, &norm_avx2, &norm_generic);
  const float e = float(eps);
  at::parallel_for(0, T, grain(D), [&](int64_t t0, int64_t t1) { body(xp, wp, yp, D, e, t0, t1); });
  return y;
}

// x [T, heads, D] float32 (its last dim contiguous), weight [D] or undefined, positions [T] int64,
// inv_freq [D / 2] float32 -> [T, heads, D] float32 contiguous.
at::Tensor norm_rope_cpu(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps,
                         const at::Tensor& positions, const at::Tensor& inv_freq, double mscale) {
  check_float(x, "norm_rope_cpu", "x");
  check_float(inv_freq, "norm_rope_cpu", "inv_freq");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "norm_rope_cpu: x must be [T, heads, D] with D even, got ",
              x.sizes());
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2);
  const at::Tensor xc = x.stride(2) == 1 ? x : x.contiguous();
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == T,
              "norm_rope_cpu: positions must be int64 [T]");
  TORCH_CHECK(inv_freq.dim() == 1 && inv_freq.size(0) == D / 2, "norm_rope_cpu: inv_freq must be [D / 2]");
  at::Tensor wc;
  if (weight.has_value() && weight->defined()) {
    check_float(*weight, "norm_rope_cpu", "weight");
    TORCH_CHECK(weight->dim() == 1 && weight->size(0) == D, "norm_rope_cpu: weight must be [D]");
    wc = weight->contiguous();
  }
  const at::Tensor pc = positions.contiguous(), fc = inv_freq.contiguous();
  at::Tensor out = at::empty({T, heads, D}, xc.options());
  if (T == 0 || heads == 0) return out;
  const NormRope p{xc.data_ptr<float>(), wc.defined() ? wc.data_ptr<float>() : nullptr, fc.data_ptr<float>(),
                   pc.data_ptr<int64_t>(), out.data_ptr<float>(), heads, D, xc.stride(0), xc.stride(1),
                   float(eps), float(mscale)};
  const NormRopeFn body = strata_cpu::for_isa<NormRopeFn>(&norm_rope_avx512, &norm_rope_avx2, &norm_rope_generic);
  at::parallel_for(0, T, grain(heads * D), [&](int64_t t0, int64_t t1) { body(p, t0, t1); });
  return out;
}

// logits [T, E] float32 -> (ids int64 [T, k], weights float32 [T, k]).
std::tuple<at::Tensor, at::Tensor> route_cpu(const at::Tensor& logits, int64_t k, bool norm, double scale,
                                             double min_sum) {
  check_float(logits, "route_cpu", "logits");
  TORCH_CHECK(logits.dim() == 2 && k >= 1 && k <= logits.size(1), "route_cpu: top ", k, " of logits ",
              logits.sizes());
  const at::Tensor lc = logits.contiguous();
  const int64_t T = lc.size(0), E = lc.size(1);
  at::Tensor ids = at::empty({T, k}, lc.options().dtype(at::kLong)), weights = at::empty({T, k}, lc.options());
  if (T == 0) return {ids, weights};
  const float* lp = lc.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* wp = weights.data_ptr<float>();
  const RouteFn body = strata_cpu::for_isa<RouteFn>(&route_avx512, &route_avx2, &route_generic);
  const float s = float(scale), lo = float(min_sum);
  at::parallel_for(0, T, grain(E * k), [&](int64_t t0, int64_t t1) { body(lp, ip, wp, E, k, norm, s, lo, t0, t1); });
  return {ids, weights};
}

// rows [T, k, H], weights [T, k], residual [T, H] or undefined, float32 -> [T, H] float32.
at::Tensor combine_cpu(const at::Tensor& rows, const at::Tensor& weights, const c10::optional<at::Tensor>& residual) {
  check_float(rows, "combine_cpu", "rows");
  check_float(weights, "combine_cpu", "weights");
  TORCH_CHECK(rows.dim() == 3 && weights.dim() == 2 && weights.size(0) == rows.size(0) &&
              weights.size(1) == rows.size(1) && rows.size(1) >= 1, "combine_cpu: shapes ", rows.sizes(), " ",
              weights.sizes());
  const int64_t T = rows.size(0), k = rows.size(1), H = rows.size(2);
  at::Tensor rc_ = rows.contiguous(), wc = weights.contiguous(), res;
  if (residual.has_value() && residual->defined()) {
    check_float(*residual, "combine_cpu", "residual");
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == T && residual->size(1) == H,
                "combine_cpu: residual must be [T, H]");
    res = residual->contiguous();
  }
  at::Tensor out = at::empty({T, H}, rc_.options());
  if (T == 0 || H == 0) return out;
  const float *rp = rc_.data_ptr<float>(), *wp = wc.data_ptr<float>(), *sp = res.defined() ? res.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const CombineFn body = strata_cpu::for_isa<CombineFn>(&combine_avx512, &combine_avx2, &combine_generic);
  at::parallel_for(0, T, grain(k * H), [&](int64_t t0, int64_t t1) { body(rp, wp, sp, op, k, H, t0, t1); });
  return out;
}

// h, delta [T, H], weight [H] float32 -> (h + delta, rms_norm(h + delta)), both [T, H] float32.
std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& h, const at::Tensor& delta,
                                                    const at::Tensor& weight, double eps) {
  check_float(h, "add_rms_norm_cpu", "h");
  check_float(delta, "add_rms_norm_cpu", "delta");
  check_float(weight, "add_rms_norm_cpu", "weight");
  TORCH_CHECK(h.dim() == 2 && delta.sizes() == h.sizes() && weight.dim() == 1 && weight.size(0) == h.size(1),
              "add_rms_norm_cpu: shapes ", h.sizes(), " ", delta.sizes(), " ", weight.sizes());
  const at::Tensor hc = h.contiguous(), dc = delta.contiguous(), wc = weight.contiguous();
  at::Tensor sum = at::empty_like(hc), y = at::empty_like(hc);
  const int64_t T = hc.size(0), D = hc.size(1);
  if (T == 0 || D == 0) return {sum, y};
  const float *hp = hc.data_ptr<float>(), *dp = dc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float *sp = sum.data_ptr<float>(), *yp = y.data_ptr<float>();
  const AddNormFn body = strata_cpu::for_isa<AddNormFn>(&add_norm_avx512, &add_norm_avx2, &add_norm_generic);
  const float e = float(eps);
  at::parallel_for(0, T, grain(D), [&](int64_t t0, int64_t t1) { body(hp, dp, wp, sp, yp, D, e, t0, t1); });
  return {sum, y};
}

// The defined [D] float32 weight of qkv_rope_cpu's argument `name`, or undefined.
at::Tensor optional_weight(const c10::optional<at::Tensor>& weight, int64_t D, const char* name) {
  if (!weight.has_value() || !weight->defined()) return at::Tensor();
  check_float(*weight, "qkv_rope_cpu", name);
  TORCH_CHECK(weight->dim() == 1 && weight->size(0) == D, "qkv_rope_cpu: ", name, " must be [D]");
  return weight->contiguous();
}

// A KV pool of float32 rows of nkv * D values, contiguous (any leading dims): how many rows it has.
int64_t pool_rows(const at::Tensor& pool, int64_t kv_size, const char* name) {
  check_float(pool, "qkv_rope_cpu", name);
  TORCH_CHECK(pool.dim() >= 2 && pool.is_contiguous() && kv_size > 0 && pool.numel() % kv_size == 0 &&
                  pool.size(-1) * pool.size(-2) == kv_size,
              "qkv_rope_cpu: ", name, " must be contiguous rows [..., n_kv_heads, D], got ", pool.sizes());
  return pool.numel() / kv_size;
}

// qkv [T, (nh + 2 nkv) D] float32 (rows may be strided), keys / values pools of rows [nkv, D] (written),
// row_ids [P] int64 (position -> pool row) -> q [T, nh, D] float32; every id is checked before any write.
at::Tensor qkv_rope_cpu(const at::Tensor& qkv, const c10::optional<at::Tensor>& q_weight,
                        const c10::optional<at::Tensor>& k_weight, double eps, const at::Tensor& positions,
                        const at::Tensor& inv_freq, double mscale, int64_t n_heads, int64_t n_kv_heads,
                        at::Tensor& keys, at::Tensor& values, const at::Tensor& row_ids) {
  check_float(qkv, "qkv_rope_cpu", "qkv");
  check_float(inv_freq, "qkv_rope_cpu", "inv_freq");
  TORCH_CHECK(qkv.dim() == 2 && n_heads >= 1 && n_kv_heads >= 1 && qkv.size(1) % (n_heads + 2 * n_kv_heads) == 0,
              "qkv_rope_cpu: qkv ", qkv.sizes(), " is not rows of ", n_heads, " + 2 x ", n_kv_heads, " heads");
  const int64_t T = qkv.size(0), D = qkv.size(1) / (n_heads + 2 * n_kv_heads);
  TORCH_CHECK(D % 2 == 0 && inv_freq.dim() == 1 && inv_freq.size(0) == D / 2,
              "qkv_rope_cpu: head dim ", D, " must be even with inv_freq [D / 2]");
  const at::Tensor xc = qkv.stride(1) == 1 ? qkv : qkv.contiguous();
  const at::Tensor wq = optional_weight(q_weight, D, "q_weight"), wk = optional_weight(k_weight, D, "k_weight");
  const int64_t n_rows = pool_rows(keys, n_kv_heads * D, "keys");
  TORCH_CHECK(pool_rows(values, n_kv_heads * D, "values") == n_rows, "qkv_rope_cpu: keys and values differ in rows");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == T,
              "qkv_rope_cpu: positions must be int64 [T]");
  TORCH_CHECK(row_ids.scalar_type() == at::kLong && row_ids.dim() == 1, "qkv_rope_cpu: row_ids must be int64 [P]");
  const at::Tensor pc = positions.contiguous(), rc = row_ids.contiguous(), fc = inv_freq.contiguous();
  const int64_t *pp = pc.data_ptr<int64_t>(), *rp = rc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < rc.size(0), "qkv_rope_cpu: position ", pp[t], " outside the ", rc.size(0),
                " row ids");
    TORCH_CHECK(rp[pp[t]] >= 0 && rp[pp[t]] < n_rows, "qkv_rope_cpu: row ", rp[pp[t]], " outside the ", n_rows,
                " rows of the pools");
  }
  at::Tensor q = at::empty({T, n_heads, D}, xc.options());
  if (T == 0) return q;
  const QkvRope p{xc.data_ptr<float>(), wq.defined() ? wq.data_ptr<float>() : nullptr,
                  wk.defined() ? wk.data_ptr<float>() : nullptr, fc.data_ptr<float>(), pp, rp, q.data_ptr<float>(),
                  keys.data_ptr<float>(), values.data_ptr<float>(), n_heads, n_kv_heads, D, xc.stride(0),
                  float(eps), float(mscale)};
  const QkvRopeFn body = strata_cpu::for_isa<QkvRopeFn>(&qkv_rope_avx512, &qkv_rope_avx2, &qkv_rope_generic);
  at::parallel_for(0, T, grain((n_heads + 2 * n_kv_heads) * D), [&](int64_t t0, int64_t t1) { body(p, t0, t1); });
  return q;
}

// Each pair's slot slots[ids[p]] (ids [P] of E experts), every one checked to be a row of `rows` rows before
// any is counted; then counts[ids[p]] += 1 for each pair. -> slot [P] int64.
at::Tensor lookup_and_count(const at::Tensor& ids, const at::Tensor& slots, at::Tensor& counts, int64_t rows) {
  const int64_t P = ids.numel(), E = slots.numel();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && counts.scalar_type() == at::kLong &&
              counts.dim() == 1 && counts.numel() == E && counts.is_contiguous() && counts.device().is_cpu(),
              "route_slot_ffn_cpu: slots and counts must be int64 [E], counts contiguous on the CPU");
  const at::Tensor sc = slots.contiguous();
  const int64_t *ip = ids.data_ptr<int64_t>(), *sp = sc.data_ptr<int64_t>();
  at::Tensor slot = at::empty({P}, ids.options());
  int64_t* out = slot.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) {
    out[p] = sp[ip[p]];
    TORCH_CHECK(out[p] >= 0 && out[p] < rows, "route_slot_ffn_cpu: expert ", ip[p], " in slot ", out[p],
                " outside the buffer's ", rows, " rows");
  }
  int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) cp[ip[p]] += 1;
  return slot;
}

// x [T, H] float32, router [E, H] float32, slots / counts [E] int64 (counts added to), buffer [S, stride] uint8
// -> (the routed output [T, H] float32, ids [T, k] int64).
std::tuple<at::Tensor, at::Tensor> route_slot_ffn_cpu(const at::Tensor& x, const at::Tensor& router, int64_t k,
                                                      bool norm, double scale, double min_sum,
                                                      const at::Tensor& slots, at::Tensor& counts,
                                                      const at::Tensor& buffer, at::IntArrayRef offsets,
                                                      at::IntArrayRef qtypes, int64_t F) {
  check_float(x, "route_slot_ffn_cpu", "x");
  check_float(router, "route_slot_ffn_cpu", "router");
  TORCH_CHECK(x.dim() == 2 && router.dim() == 2 && router.size(1) == x.size(1) && router.size(0) == slots.numel(),
              "route_slot_ffn_cpu: x ", x.sizes(), ", router ", router.sizes(), ", slots ", slots.sizes());
  TORCH_CHECK(buffer.dim() == 2 && buffer.scalar_type() == at::kByte && buffer.is_contiguous(),
              "route_slot_ffn_cpu: buffer must be contiguous uint8 [S, stride]");
  const at::Tensor xc = x.contiguous();
  const int64_t T = xc.size(0), H = xc.size(1);
  auto [ids, weights] = route_cpu(strata_cpu::linear(xc, router), k, norm, scale, min_sum);  // [T, k] each
  const at::Tensor slot = lookup_and_count(ids, slots, counts, buffer.size(0));  // [T * k]
  const at::Tensor rows = strata_cpu::slot_ffn(xc, k, buffer, slot, offsets, qtypes, F);  // [T * k, H]
  return {combine_cpu(rows.view({T, k, H}), weights, c10::nullopt), ids};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(strata, m) {
  m.def("rms_norm_cpu(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("norm_rope_cpu(Tensor x, Tensor? weight, float eps, Tensor positions, Tensor inv_freq, float mscale) -> Tensor");
  m.def("route_cpu(Tensor logits, int k, bool norm, float scale, float min_sum) -> (Tensor, Tensor)");
  m.def("combine_cpu(Tensor rows, Tensor weights, Tensor? residual) -> Tensor");
  m.def("add_rms_norm_cpu(Tensor h, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("qkv_rope_cpu(Tensor qkv, Tensor? q_weight, Tensor? k_weight, float eps, Tensor positions, Tensor inv_freq, "
        "float mscale, int n_heads, int n_kv_heads, Tensor(a!) keys, Tensor(b!) values, Tensor row_ids) -> Tensor");
  m.def("route_slot_ffn_cpu(Tensor x, Tensor router, int k, bool norm, float scale, float min_sum, Tensor slots, "
        "Tensor(a!) counts, Tensor buffer, int[] offsets, int[] qtypes, int F) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(strata, CPU, m) {
  m.impl("rms_norm_cpu", &rms_norm_cpu);
  m.impl("norm_rope_cpu", &norm_rope_cpu);
  m.impl("route_cpu", &route_cpu);
  m.impl("combine_cpu", &combine_cpu);
  m.impl("add_rms_norm_cpu", &add_rms_norm_cpu);
  m.impl("qkv_rope_cpu", &qkv_rope_cpu);
  m.impl("route_slot_ffn_cpu", &route_slot_ffn_cpu);
}
