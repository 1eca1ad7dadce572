// Quantized products of GGML blocks on the CPU, read in place: y[t, r] = x[t] . W[r] for segments of
// rows of x, each against its own weight matrix (the routed experts of a layer, or one pair each);
// and the blocks' values themselves (dequantize_blocks: what strata::dequantize gives on the CPU).
//
// Each block is decoded once into float32 (the reference's values), then multiplied into every token
// of a tile with lane-wise fused multiply-adds over 16 lanes, reduced in a fixed order at the end of a
// row: the result of one (token, row) does not depend on the other tokens, the tile, the thread count
// or the instruction set (the AVX2 and AVX-512 bodies are the same lane arithmetic), so every CPU
// expert path computes the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_calls.h"
#include "cpu_isa.h"
#include "cpu_lanes.h"

#include <immintrin.h>

#include <cstdint>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

#define STRATA_INLINE inline __attribute__((always_inline))

// GGML type ids (gguf GGMLQuantizationType)
constexpr int Q4_0 = 2, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_XS = 23, MXFP4 = 39;
constexpr int TOKEN_TILE = 8;  // tokens multiplied per decoded block
constexpr int ROW_CHUNK = 16;  // rows of one work item
constexpr int64_t MIN_THREAD_BYTES = 64 << 10;

STRATA_INLINE float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) { man <<= 1; --exp; }
      bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

STRATA_INLINE float e8m0_half(uint8_t e) {  // 2**(e - 128), ggml_e8m0_to_fp32_half
  uint32_t bits = e < 2 ? 0x00200000u << e : uint32_t(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}


struct Geometry { int values, bytes; };

Geometry geometry(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return {32, 18};
    case Q8_0: return {32, 34};
    case MXFP4: return {32, 17};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    case IQ4_XS: return {256, 136};
    default: return {0, 0};
  }
}

// The 6-bit scale and min j of a Q4_K / Q5_K block's 12 scale bytes.
STRATA_INLINE void scale_min(const uint8_t* s, int j, float& sc, float& mn) {
  if (j < 4) {
    sc = float(s[j] & 63);
    mn = float(s[j + 4] & 63);
  } else {
    sc = float((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4));
    mn = float((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// 16 lanes as GCC vector types: one zmm register with AVX-512, two ymm with AVX2; the same lane
// arithmetic either way.
typedef float f32x16u __attribute__((vector_size(64), aligned(4)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x16u __attribute__((vector_size(16), aligned(1)));

STRATA_INLINE u8x16 load16(const uint8_t* p) { return *reinterpret_cast<const u8x16u*>(p); }
typedef int16_t i16x16 __attribute__((vector_size(32)));
// widened to int32 first: a direct byte -> float conversion is scalarised by GCC
STRATA_INLINE f32x16 floats(u8x16 v) { return __builtin_convertvector(__builtin_convertvector(v, i32x16), f32x16); }
STRATA_INLINE f32x16 floats(i8x16 v) { return __builtin_convertvector(__builtin_convertvector(v, i32x16), f32x16); }
// 16 signed bytes at p (Q8_0's codes) widened through int16: GCC scalarises the byte -> int32 step of
// bytes just loaded (32 byte moves and inserts a block, in every body)
STRATA_INLINE f32x16 loaded_floats(const uint8_t* p) {
  return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(i8x16(load16(p)), i16x16), i32x16),
                                 f32x16);
}

// 16 bytes as floats, widened as the body's instruction set compiles best (the same values; measured with
// tools/cpu_kernel_isa_bench.py): through int16 in the AVX2 body, and in the generic one for unsigned
// bytes (GCC builds their direct byte -> int32 step from scalar extracts and inserts), directly otherwise
// (through int16 halves the AVX-512 body, and the generic one's table lookups).
template <int ISA, typename Bytes>
STRATA_INLINE f32x16 byte_floats(Bytes v) {
  if constexpr (ISA == 1 || (ISA == 0 && std::is_same_v<Bytes, u8x16>))
    return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(v, i16x16), i32x16), f32x16);
  else
    return floats(v);
}
// table[code] of 16 int8 values for 16 codes 0..15 (a byte shuffle), as floats
template <int ISA>
STRATA_INLINE f32x16 table_floats(const i8x16 table, u8x16 codes) {
  return byte_floats<ISA>(__builtin_shuffle(table, codes));
}

// Decoders: one block's values in float32 (``out`` as 16-lane vectors), as strata_core/quant computes them.
STRATA_INLINE void decode_q8_0(const uint8_t* b, f32x16* out) {
  const f32x16 d = splat(fp16(b));
  out[0] = loaded_floats(b + 2) * d;
  out[1] = loaded_floats(b + 18) * d;
}

template <int ISA>
STRATA_INLINE void decode_q4_0(const uint8_t* b, f32x16* out) {
  const f32x16 d = splat(fp16(b)), eight = splat(8.f);
  const u8x16 q = load16(b + 2);
  out[0] = d * (byte_floats<ISA>(u8x16(q & 15)) - eight);
  out[1] = d * (byte_floats<ISA>(u8x16(q >> 4)) - eight);
}

const i8x16 IQ4NL = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
const i8x16 MXFP4_VALUES = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

template <int ISA>
STRATA_INLINE void decode_mxfp4(const uint8_t* b, f32x16* out) {
  const f32x16 d = splat(e8m0_half(b[0]));
  const u8x16 q = load16(b + 1);
  out[0] = d * table_floats<ISA>(MXFP4_VALUES, q & 15);
  out[1] = d * table_floats<ISA>(MXFP4_VALUES, q >> 4);
}

// Q4_K and Q5_K blocks (256 values) decoded a quarter at a time: values [64 j, 64 j + 64) of block b as
// out[0..4), given its super-scales d (fp16 at b) and dmin (at b + 2): 4-bit codes (and Q5_K's fifth
// bits), a 6-bit scale and min a 32 values.
template <int QT, int ISA>
STRATA_INLINE void k_part(const uint8_t* b, float d, float dmin, int j, f32x16* out) {
  const uint8_t* s = b + 4;
  const uint8_t* q = b + (QT == Q5_K ? 48 : 16);
  float sc0, m0, sc1, m1;
  scale_min(s, 2 * j, sc0, m0);
  scale_min(s, 2 * j + 1, sc1, m1);
  const f32x16 d0 = splat(d * sc0), n0 = splat(dmin * m0), d1 = splat(d * sc1), n1 = splat(dmin * m1);
  for (int h = 0; h < 2; ++h) {
    const u8x16 v = load16(q + 32 * j + 16 * h);
    u8x16 lo = v & 15, hi = v >> 4;
    if constexpr (QT == Q5_K) {
      const u8x16 hb = load16(b + 16 + 16 * h);
      lo = lo | (((hb >> (2 * j)) & 1) << 4);
      hi = hi | (((hb >> (2 * j + 1)) & 1) << 4);
    }
    out[h] = d0 * byte_floats<ISA>(lo) - n0;
    out[2 + h] = d1 * byte_floats<ISA>(hi) - n1;
  }
}

template <int QT, int ISA>
STRATA_INLINE void decode_k(const uint8_t* b, f32x16* out) {
  const float d = fp16(b), dmin = fp16(b + 2);
  for (int j = 0; j < 4; ++j) k_part<QT, ISA>(b, d, dmin, j, out + 4 * j);
}

template <int ISA>
STRATA_INLINE void decode_q6_k(const uint8_t* b, f32x16* out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = fp16(b + 208);
  const f32x16 off = splat(32.f);
  for (int r = 0; r < 2; ++r) {  // two runs of 128 values
    for (int k = 0; k < 4; ++k) {  // 32 values a step: nibble k / 2 of ql, bits 2k of qh
      const int shift = 4 * (k >> 1);
      for (int h = 0; h < 2; ++h) {  // 16 values, one scale
        const u8x16 l = load16(ql + 64 * r + 32 * (k & 1) + 16 * h), hb = load16(qh + 32 * r + 16 * h);
        const u8x16 q = ((l >> shift) & 15) | (((hb >> (2 * k)) & 3) << 4);
        out[8 * r + 2 * k + h] = splat(d * float(sc[8 * r + 2 * k + h])) * (byte_floats<ISA>(q) - off);
      }
    }
  }
}

template <int ISA>
STRATA_INLINE void decode_iq4_xs(const uint8_t* b, f32x16* out) {
  const float d = fp16(b);
  const uint16_t sh = uint16_t(b[2] | (b[3] << 8));
  const uint8_t* sl = b + 4;
  const uint8_t* q = b + 8;
  for (int j = 0; j < 8; ++j) {
    const int sc = ((sl[j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4);
    const f32x16 dl = splat(d * float(sc - 32));
    const u8x16 v = load16(q + 16 * j);
    out[2 * j] = dl * table_floats<ISA>(IQ4NL, v & 15);
    out[2 * j + 1] = dl * table_floats<ISA>(IQ4NL, v >> 4);
  }
}

template <int QT, int ISA>
STRATA_INLINE void decode_block(const uint8_t* blk, f32x16* w) {
  if constexpr (QT == Q8_0) decode_q8_0(blk, w);
  else if constexpr (QT == Q4_0) decode_q4_0<ISA>(blk, w);
  else if constexpr (QT == MXFP4) decode_mxfp4<ISA>(blk, w);
  else if constexpr (QT == Q4_K || QT == Q5_K) decode_k<QT, ISA>(blk, w);
  else if constexpr (QT == Q6_K) decode_q6_k<ISA>(blk, w);
  else decode_iq4_xs<ISA>(blk, w);
}

// One segment: tokens [t0, t0 + n) of x against rows of W.
struct Segment { const uint8_t* w; int64_t t0, n; };

// Rows [r0, r1) of one segment: tokens in tiles, each block decoded once per tile.
template <int QT, int VALUES, int BYTES, int ISA>
STRATA_INLINE void rows_body(const float* x, int64_t K, const Segment& seg, int64_t r0, int64_t r1, float* y,
                             int64_t out_features) {
  constexpr int V = VALUES / LANES;
  const int64_t blocks = K / VALUES, row_bytes = blocks * BYTES;
  f32x16 w[V];
  f32x16 acc[TOKEN_TILE];
  for (int64_t t0 = 0; t0 < seg.n; t0 += TOKEN_TILE) {
    const int nt = int(seg.n - t0 < TOKEN_TILE ? seg.n - t0 : TOKEN_TILE);
    const float* xt = x + (seg.t0 + t0) * K;
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = seg.w + r * row_bytes;
      for (int t = 0; t < TOKEN_TILE; ++t) acc[t] = f32x16{};
      for (int64_t bi = 0; bi < blocks; ++bi) {
        const uint8_t* blk = row + bi * BYTES;
        if constexpr (QT == Q4_K || QT == Q5_K) {  // a quarter at a time: values in registers (Q6_K measured slower)
          const float d = fp16(blk), dmin = fp16(blk + 2);
          for (int j = 0; j < 4; ++j) {
            k_part<QT, ISA>(blk, d, dmin, j, w);
            for (int t = 0; t < nt; ++t) {  // each acc[t] summed in the same order as the whole block's
              const f32x16u* xb = reinterpret_cast<const f32x16u*>(xt + t * K + bi * VALUES + 64 * j);
              for (int i = 0; i < 4; ++i) acc[t] = xb[i] * w[i] + acc[t];
            }
          }
        } else {
          decode_block<QT, ISA>(blk, w);
          for (int t = 0; t < nt; ++t) {
            const f32x16u* xb = reinterpret_cast<const f32x16u*>(xt + t * K + bi * VALUES);
            for (int i = 0; i < V; ++i) acc[t] = xb[i] * w[i] + acc[t];  // rounded twice (-ffp-contract=off): the same bits from every body and compiler
          }
        }
      }
      for (int t = 0; t < nt; ++t) {  // fixed pairwise order over the lanes
        float s[LANES];
        std::memcpy(s, &acc[t], sizeof(s));
        for (int width = LANES / 2; width >= 1; width /= 2)
          for (int l = 0; l < width; ++l) s[l] = s[l] + s[l + width];
        y[(seg.t0 + t0 + t) * out_features + r] = s[0];
      }
    }
  }
}

// Blocks [b0, b1) of raw decoded into out (VALUES floats a block): the values the products multiply.
template <int QT, int VALUES, int BYTES, int ISA>
STRATA_INLINE void blocks_body(const uint8_t* raw, int64_t b0, int64_t b1, float* out) {
  f32x16 w[VALUES / LANES];
  for (int64_t b = b0; b < b1; ++b) {
    decode_block<QT, ISA>(raw + b * BYTES, w);
    std::memcpy(out + b * VALUES, w, sizeof(w));
  }
}

// The activations of one call: x [N, K] float32, and for the int8 body (Kernels::quantized) the same
// rows quantized (quantize_rows).
struct Input {
  const float* x;
  int64_t K;
  const int8_t* q;      // [N, Kp] codes, Kp = K rounded up to 64 values (the padding's codes and scales 0)
  const float* lane_d;  // [N, Kp / 4] the scale of each 4 codes' block of 32
  const int32_t* neg4;  // [N, Kp / 4] minus the sum of each 4 codes
  const float* sums;    // [N, Kp / 32] the sum of each 32 values themselves (float32)
  int64_t Kp;
};

using RowsFn = void (*)(const Input&, const Segment&, int64_t, int64_t, float*, int64_t);
using BlocksFn = void (*)(const uint8_t*, int64_t, int64_t, float*);

// The same bodies compiled for each instruction set (inlined, so vectorised with its registers).
#define STRATA_BODIES(ROWS, BLOCKS, ATTRIBUTES, ISA)                                                        \
  template <int QT, int VALUES, int BYTES>                                                                 \
  ATTRIBUTES void ROWS(const Input& in, const Segment& seg, int64_t r0, int64_t r1, float* y,              \
                       int64_t out_features) {                                                             \
    rows_body<QT, VALUES, BYTES, ISA>(in.x, in.K, seg, r0, r1, y, out_features);                           \
  }                                                                                                        \
  template <int QT, int VALUES, int BYTES>                                                                 \
  ATTRIBUTES void BLOCKS(const uint8_t* raw, int64_t b0, int64_t b1, float* out) {                          \
    blocks_body<QT, VALUES, BYTES, ISA>(raw, b0, b1, out);                                                 \
  }
STRATA_BODIES(rows_avx512, blocks_avx512, STRATA_AVX512, 2)
STRATA_BODIES(rows_avx2, blocks_avx2, STRATA_AVX2, 1)
STRATA_BODIES(rows_generic, blocks_generic, , 0)
#undef STRATA_BODIES

// The AVX-512 VNNI body: the activations quantized once per call (quantize_rows: each 32 values of a
// row as int8 codes with one float32 scale, max |v| / 127, rounded half away from zero, as the CUDA q8
// kernels quantize them, strata_core/ops/moe_q8_kernels.py), then each 64 weight codes (unsigned bytes)
// dotted with 64 activation codes by one vpdpbusd (16 int32 lanes, each the sum of 4 byte products).
// A lane's integer sum is scaled where it is: times the weight's scale of its values and the
// activation's scale of its block (float32, one fused multiply-add into 16 float lanes), and the lanes
// summed at the end of a row in the float bodies' fixed order. Codes stored with an offset (Q4_0's 8,
// Q6_K's 32, Q8_0's signed codes read as unsigned + 128) have it taken out in integers (minus offset x
// the activation codes' sum), exactly; Q4_K / Q5_K's mins are taken out in float32 against the sum of
// the block's values themselves, as the CUDA kernels do. MXFP4 and IQ4_XS map their 4-bit codes through
// a 16-byte table (one vpshufb, as ggml's CPU backend does) to their signed integer values plus an
// offset that makes them unsigned (16 and 128), taken out the same way: cheaper than ggml's sign trick
// (|x| and the sign moved onto the weights per token), and as exact. A row's arithmetic is fixed by its own values:
// the bits do not depend on the other rows, the tile or the threads.
constexpr int QUANT = 32;   // activation values a scale
constexpr int CHUNK = 64;   // values of one vpdpbusd

STRATA_INLINE constexpr bool vnni_format(int qt) {
  return qt == Q4_0 || qt == Q8_0 || qt == Q4_K || qt == Q5_K || qt == Q6_K || qt == MXFP4 || qt == IQ4_XS;
}

// The 16 values of a table format's codes plus its offset 2**SHIFT, as unsigned bytes in each 128-bit
// lane (vpshufb looks up within lanes): MXFP4's doubled E2M1 values + 16, IQ4_NL's + 128.
template <int QT>
STRATA_VNNI STRATA_INLINE __m512i offset_table() {
  const i8x16 values = QT == MXFP4 ? MXFP4_VALUES : IQ4NL;
  const u8x16 shifted = u8x16(values) + uint8_t(QT == MXFP4 ? 16 : 128);
  __m128i t;
  std::memcpy(&t, &shifted, sizeof(t));
  return _mm512_broadcast_i32x4(t);
}

// Row x (K values) quantized into q (Kp codes), lane_d, neg4 (Kp / 4) and sums (Kp / 32): see Input.
STRATA_VNNI void quantize_row(const float* x, int64_t K, int64_t Kp, int8_t* q, float* lane_d, int32_t* neg4,
                              float* sums) {
  const __m512 half = _mm512_set1_ps(0.5f), minus_half = _mm512_set1_ps(-0.5f), zero = _mm512_setzero_ps();
  const __m256i ones = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < Kp / QUANT; ++b) {
    if (b * QUANT >= K) {  // padding to a whole chunk: nothing
      std::memset(q + b * QUANT, 0, QUANT);
      std::memset(lane_d + b * 8, 0, 8 * sizeof(float));
      std::memset(neg4 + b * 8, 0, 8 * sizeof(int32_t));
      sums[b] = 0.f;
      continue;
    }
    const __m512 v0 = _mm512_loadu_ps(x + b * QUANT), v1 = _mm512_loadu_ps(x + b * QUANT + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512 s0 = _mm512_mul_ps(v0, inv), s1 = _mm512_mul_ps(v1, inv);
    // half away from zero: +-0.5, then truncated
    const __m512 r0 = _mm512_add_ps(s0, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s0, zero, _CMP_GE_OQ), minus_half, half));
    const __m512 r1 = _mm512_add_ps(s1, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s1, zero, _CMP_GE_OQ), minus_half, half));
    const __m128i c0 = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(r0)), c1 = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(r1));
    const __m256i codes = _mm256_inserti128_si256(_mm256_castsi128_si256(c0), c1, 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QUANT), codes);
    _mm256_storeu_ps(lane_d + b * 8, _mm256_set1_ps(amax / 127.f));
    const __m256i sum4 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, codes);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(neg4 + b * 8), _mm256_sub_epi32(_mm256_setzero_si256(), sum4));
    f32x16 t, u;
    std::memcpy(&t, &v0, sizeof(t));
    std::memcpy(&u, &v1, sizeof(u));
    sums[b] = lane_sum(t + u);
  }
}

// The lanes of acc summed in the float bodies' fixed pairwise order.
STRATA_VNNI STRATA_INLINE float pairwise_sum(__m512 acc) {
  float s[LANES];
  _mm512_storeu_ps(s, acc);
  for (int width = LANES / 2; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) s[l] = s[l] + s[l + width];
  return s[0];
}

STRATA_VNNI STRATA_INLINE __m512i join(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

STRATA_VNNI STRATA_INLINE __m512 halves(float lo, float hi) {  // lo in lanes 0-7, hi in lanes 8-15
  return _mm512_insertf32x8(_mm512_set1_ps(lo), _mm256_set1_ps(hi), 1);
}

// The 64 weight codes w (unsigned bytes, stored with an offset of 2**SHIFT where SHIFT >= 0) of values
// [v0, v0 + 64) of a row, each lane's weight scale ws, into the accumulators of NT tokens whose first row
// of activations is tok.
template <int SHIFT, int NT>
STRATA_VNNI STRATA_INLINE void dot_chunk(const Input& in, int64_t tok, __m512i w, __m512 ws, int64_t v0, __m512* acc) {
  for (int t = 0; t < NT; ++t) {
    const int64_t row = tok + t;
    __m512i s = _mm512_setzero_si512();
    if constexpr (SHIFT >= 0) s = _mm512_slli_epi32(_mm512_loadu_si512(in.neg4 + row * (in.Kp / 4) + v0 / 4), SHIFT);
    s = _mm512_dpbusd_epi32(s, w, _mm512_loadu_si512(in.q + row * in.Kp + v0));
    const __m512 sc = _mm512_mul_ps(ws, _mm512_loadu_ps(in.lane_d + row * (in.Kp / 4) + v0 / 4));
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc[t]);
  }
}

STRATA_VNNI STRATA_INLINE float fp16_f16c(const uint8_t* p) {  // fp16's value, by the F16C instruction
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// A Q4_K / Q5_K block's 8 scales (lanes 0-7) and 8 mins (lanes 8-15) as floats (ggml's unpacking of the
// 12 bytes: scale_min for every j at once).
STRATA_VNNI STRATA_INLINE __m512 k_scales_mins(const uint8_t* s) {
  uint32_t u[4];
  std::memcpy(u, s, 12);
  const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
  u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
  const uint32_t mins_lo = u[1] & m1;
  u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
  u[2] = mins_lo;
  u[0] &= m1;
  __m128i bytes;
  std::memcpy(&bytes, u, 16);
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
}

// 32 bytes of 4-bit codes, two runs of 16 (low nibbles the run's first 16 values, high nibbles its
// next 16: Q4_0's and MXFP4's blocks, IQ4_XS's sub-blocks), as the 64 codes in value order.
STRATA_VNNI STRATA_INLINE __m512i nibbles_in_order(__m256i v, __m256i low4) {
  // [run 0's low, run 1's low, run 0's high, run 1's high] -> [0 low, 0 high, 1 low, 1 high]
  const __m512i both = join(_mm256_and_si256(v, low4), _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
  return _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
}

// An IQ4_XS block's 8 sub-block scales d * (sc_j - 32) as floats (lanes 0-7; the same float32 product
// as decode_iq4_xs): sc_j is nibble j of the 4 bytes at b + 4, with bits 2j, 2j + 1 of the 16 at b + 2
// above it.
STRATA_VNNI STRATA_INLINE __m512 iq4_xs_scales(const uint8_t* b) {
  uint32_t low;
  uint16_t high;
  std::memcpy(&low, b + 4, 4);
  std::memcpy(&high, b + 2, 2);
  const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(low)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                      _mm256_set1_epi32(15));
  const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(high), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                      _mm256_set1_epi32(3));
  const __m256i sc = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
  return _mm512_zextps256_ps512(_mm256_mul_ps(_mm256_set1_ps(fp16_f16c(b)), _mm256_cvtepi32_ps(sc)));
}

// Rows [r0, r1) of weights w for the NT tokens from row tok of the activations (a tile: the token
// count a compile-time constant, so that their accumulators stay in registers).
template <int QT, int VALUES, int BYTES, int NT>
STRATA_VNNI STRATA_INLINE void tile_vnni(const Input& in, const uint8_t* w, int64_t tok, int64_t r0, int64_t r1,
                                         float* y, int64_t out_features) {
  constexpr int SHIFT = QT == Q8_0 || QT == IQ4_XS ? 7 : QT == Q4_0 ? 3 : QT == MXFP4 ? 4 : QT == Q6_K ? 5 : -1;
  constexpr bool MINS = QT == Q4_K || QT == Q5_K;
  constexpr bool TABLE = QT == MXFP4 || QT == IQ4_XS;
  const __m512i table = TABLE ? offset_table<QT>() : _mm512_setzero_si512();
  const int64_t blocks = in.K / VALUES, row_bytes = blocks * BYTES;
  const __m256i low4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1), three = _mm256_set1_epi8(3);
  const __m512i low4z = _mm512_set1_epi8(15);
  __m512 acc[NT], accm[NT];
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    for (int t = 0; t < NT; ++t) acc[t] = accm[t] = _mm512_setzero_ps();
    if constexpr (VALUES == QUANT) {  // Q4_0, Q8_0, MXFP4: two blocks a chunk (the second none past the row's end)
      constexpr int CODES = QT == MXFP4 ? 1 : 2;  // bytes before a block's codes: its scale
      for (int64_t bi = 0; bi < blocks; bi += 2) {
        const uint8_t* a = row + bi * BYTES;
        const uint8_t* b = bi + 1 < blocks ? a + BYTES : nullptr;
        float da, db;
        if constexpr (QT == MXFP4) {
          da = e8m0_half(a[0]);
          db = b ? e8m0_half(b[0]) : 0.f;
        } else {
          da = fp16_f16c(a);
          db = b ? fp16_f16c(b) : 0.f;
        }
        __m512i codes;
        if constexpr (QT == Q8_0) {
          const __m256i wa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 2));
          const __m256i wb = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)) : _mm256_setzero_si256();
          codes = _mm512_xor_si512(join(wa, wb), _mm512_set1_epi8(char(0x80)));
        } else {  // [a's low nibbles, b's low], [a's high, b's high] -> a's 32 codes, b's 32
          const __m128i qb = b ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + CODES)) : _mm_setzero_si128();
          const __m256i v = _mm256_inserti128_si256(
              _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + CODES))), qb, 1);
          codes = nibbles_in_order(v, low4);
          if constexpr (TABLE) codes = _mm512_shuffle_epi8(table, codes);  // past the row: activation codes 0
        }
        dot_chunk<SHIFT, NT>(in, tok, codes, halves(da, db), bi * QUANT, acc);
      }
    } else {
      for (int64_t bi = 0; bi < blocks; ++bi) {
        const uint8_t* b = row + bi * BYTES;
        const int64_t v0 = bi * VALUES;
        if constexpr (MINS) {
          const __m512 sm = k_scales_mins(b + 4);
          const __m512 dsc = _mm512_mul_ps(_mm512_set1_ps(fp16_f16c(b)), sm);
          const __m512 dmn = _mm512_mul_ps(_mm512_set1_ps(fp16_f16c(b + 2)), sm);
          const uint8_t* qs = b + (QT == Q5_K ? 48 : 16);
          const __m256i hb = QT == Q5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)) : _mm256_setzero_si256();
          for (int j = 0; j < 4; ++j) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
            __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            if constexpr (QT == Q5_K) {
              lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j), one), 4));
              hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j + 1), one), 4));
            }
            const __m512 ws = _mm512_permutexvar_ps(
                _mm512_set_epi32(2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j), dsc);
            dot_chunk<SHIFT, NT>(in, tok, join(lo, hi), ws, v0 + CHUNK * j, acc);
          }
          // minus dmin * min_j * (the sum of sub-block j's values), j = 0..7 in lanes 0-7
          const __m512 mins = _mm512_maskz_permutexvar_ps(0x00ff, _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8,
                                                                                     15, 14, 13, 12, 11, 10, 9, 8), dmn);
          for (int t = 0; t < NT; ++t) {
            const __m512 xs = _mm512_zextps256_ps512(_mm256_loadu_ps(in.sums + (tok + t) * (in.Kp / QUANT) + v0 / QUANT));
            accm[t] = _mm512_fmadd_ps(mins, xs, accm[t]);
          }
        } else if constexpr (QT == IQ4_XS) {  // 8 scales of 32 values; chunk c is sub-blocks 2c and 2c + 1
          const __m512 sc = iq4_xs_scales(b);
          for (int c = 0; c < 4; ++c) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 8 + 32 * c));
            const __m512 ws = _mm512_permutexvar_ps(
                _mm512_set_epi32(2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1,
                                 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c), sc);
            dot_chunk<SHIFT, NT>(in, tok, _mm512_shuffle_epi8(table, nibbles_in_order(v, low4)), ws, v0 + CHUNK * c, acc);
          }
        } else {  // Q6_K: 16 scales of 16 values; chunk c is values [64 c, 64 c + 64)
          const __m512 sc = _mm512_mul_ps(
              _mm512_set1_ps(fp16_f16c(b + 208)),
              _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))));
          for (int half = 0; half < 2; ++half) {  // 128 values: 64 bytes of low nibbles, 32 of high bits
            const __m512i l = _mm512_loadu_si512(b + 64 * half);
            const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
            for (int k = 0; k < 2; ++k) {  // nibble k of l; bits 4k and 4k + 2 of h
              const __m512i lo = k ? _mm512_and_si512(_mm512_srli_epi16(l, 4), low4z) : _mm512_and_si512(l, low4z);
              const __m512i hi = join(_mm256_and_si256(_mm256_srli_epi16(h, 4 * k), three),
                                      _mm256_and_si256(_mm256_srli_epi16(h, 4 * k + 2), three));
              const int c = 2 * half + k;
              const __m512 ws = _mm512_permutexvar_ps(
                  _mm512_set_epi32(4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2,
                                   4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c, 4 * c, 4 * c, 4 * c), sc);
              dot_chunk<SHIFT, NT>(in, tok, _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4)), ws, v0 + CHUNK * c, acc);
            }
          }
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      const float sum = pairwise_sum(acc[t]);
      y[(tok + t) * out_features + r] = MINS ? sum - pairwise_sum(accm[t]) : sum;
    }
  }
}

template <int QT, int VALUES, int BYTES>
STRATA_VNNI void rows_vnni(const Input& in, const Segment& seg, int64_t r0, int64_t r1, float* y,
                           int64_t out_features) {
  for (int64_t t0 = 0; t0 < seg.n; t0 += TOKEN_TILE) {
    const int64_t tok = seg.t0 + t0;
    switch (seg.n - t0 < TOKEN_TILE ? seg.n - t0 : TOKEN_TILE) {
      case 1: tile_vnni<QT, VALUES, BYTES, 1>(in, seg.w, tok, r0, r1, y, out_features); break;
      case 2: tile_vnni<QT, VALUES, BYTES, 2>(in, seg.w, tok, r0, r1, y, out_features); break;
      case 3: tile_vnni<QT, VALUES, BYTES, 3>(in, seg.w, tok, r0, r1, y, out_features); break;
      case 4: tile_vnni<QT, VALUES, BYTES, 4>(in, seg.w, tok, r0, r1, y, out_features); break;
      case 5: tile_vnni<QT, VALUES, BYTES, 5>(in, seg.w, tok, r0, r1, y, out_features); break;
      case 6: tile_vnni<QT, VALUES, BYTES, 6>(in, seg.w, tok, r0, r1, y, out_features); break;
      case 7: tile_vnni<QT, VALUES, BYTES, 7>(in, seg.w, tok, r0, r1, y, out_features); break;
      default: tile_vnni<QT, VALUES, BYTES, 8>(in, seg.w, tok, r0, r1, y, out_features); break;
    }
  }
}

enum class Isa { generic = 0, avx2 = 1, avx512 = 2, avx512_vnni = 3 };

Isa detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return __builtin_cpu_supports("avx512vnni") ? Isa::avx512_vnni : Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
  return Isa::generic;
}

Isa& chosen_isa() {
  static Isa isa = detect_isa();
  return isa;
}

// quantized: rows takes the activations quantized (Input), the int8 body's
struct Kernels { RowsFn rows; BlocksFn blocks; bool quantized; };

template <int QT, int VALUES, int BYTES>
Kernels pick() {
  switch (chosen_isa()) {
    case Isa::avx512_vnni:
      if constexpr (vnni_format(QT)) return {&rows_vnni<QT, VALUES, BYTES>, &blocks_avx512<QT, VALUES, BYTES>, true};
      [[fallthrough]];  // a format without the int8 body: the float one
    case Isa::avx512: return {&rows_avx512<QT, VALUES, BYTES>, &blocks_avx512<QT, VALUES, BYTES>, false};
    case Isa::avx2: return {&rows_avx2<QT, VALUES, BYTES>, &blocks_avx2<QT, VALUES, BYTES>, false};
    default: return {&rows_generic<QT, VALUES, BYTES>, &blocks_generic<QT, VALUES, BYTES>, false};
  }
}

Kernels kernels_for(int64_t qtype) {
  switch (qtype) {
    case Q8_0: return pick<Q8_0, 32, 34>();
    case Q4_0: return pick<Q4_0, 32, 18>();
    case MXFP4: return pick<MXFP4, 32, 17>();
    case Q4_K: return pick<Q4_K, 256, 144>();
    case Q5_K: return pick<Q5_K, 256, 176>();
    case Q6_K: return pick<Q6_K, 256, 210>();
    case IQ4_XS: return pick<IQ4_XS, 256, 136>();
    default: return {nullptr, nullptr, false};
  }
}

// item(i) for i in [0, n) on torch's threads (as many as at::parallel_for gives at least ``grain`` items
// each), every thread taking the next item left from a shared counter until none is: a thread that is
// slow or descheduled (its core also needed by the caller's process: a GPU host's main thread, the
// driver, another job) delays the product by the item it holds, where at::parallel_for's even split
// makes the region wait for that thread's whole share. Which thread computes an item does not change
// its bits.
template <typename F>
void parallel_items(int64_t n, int64_t grain, const F& item) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, n, grain, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n; i = next.fetch_add(1, std::memory_order_relaxed))
      item(i);
  });
}

// x [N, K] as the rows functions take it: for the int8 body (quantized), its rows quantized into buffer.
Input prepare(const float* x, int64_t N, int64_t K, bool quantized, at::Tensor& buffer) {
  Input in{x, K, nullptr, nullptr, nullptr, nullptr, 0};
  if (!quantized || N == 0) return in;
  const int64_t Kp = (K + CHUNK - 1) / CHUNK * CHUNK;
  buffer = at::empty({N * (3 * Kp + Kp / 8)}, at::TensorOptions().dtype(at::kByte));  // codes, lane_d, neg4, sums
  uint8_t* base = buffer.data_ptr<uint8_t>();
  int8_t* q = reinterpret_cast<int8_t*>(base);
  float* lane_d = reinterpret_cast<float*>(base + N * Kp);
  int32_t* neg4 = reinterpret_cast<int32_t*>(base + 2 * N * Kp);
  float* sums = reinterpret_cast<float*>(base + 3 * N * Kp);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / K);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      quantize_row(x + n * K, K, Kp, q + n * Kp, lane_d + n * (Kp / 4), neg4 + n * (Kp / 4), sums + n * (Kp / QUANT));
  });
  return {x, K, q, lane_d, neg4, sums, Kp};
}

// x [N, K] float32; weights[i] the packed rows (out_features x K values) of segment i, which owns
// counts[i] consecutive rows of x; returns [N, out_features] float32.
at::Tensor qlinear_grouped(const at::Tensor& x, at::TensorList weights, at::IntArrayRef counts, int64_t qtype,
                           int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "qlinear_grouped: x must be a 2-D float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(weights.size() == counts.size(), "qlinear_grouped: ", weights.size(), " weights for ",
              counts.size(), " counts");
  const Kernels kernels = kernels_for(qtype);
  const RowsFn fn = kernels.rows;
  const Geometry g = geometry(qtype);
  TORCH_CHECK(fn != nullptr, "qlinear_grouped: no CPU kernel for GGML type ", qtype);
  const at::Tensor xc = x.contiguous();
  const int64_t N = xc.size(0), K = xc.size(1);
  TORCH_CHECK(K % g.values == 0, "qlinear_grouped: row length ", K, " is not a multiple of ", g.values);
  const int64_t row_bytes = K / g.values * g.bytes;
  std::vector<Segment> segs;
  int64_t t0 = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous(),
                "qlinear_grouped: weights must be contiguous uint8 CPU tensors");
    TORCH_CHECK(w.numel() == out_features * row_bytes, "qlinear_grouped: weight ", i, " holds ", w.numel(),
                " bytes, expected ", out_features * row_bytes);
    TORCH_CHECK(counts[i] >= 0, "qlinear_grouped: negative count");
    if (counts[i] > 0) segs.push_back({w.data_ptr<uint8_t>(), t0, counts[i]});
    t0 += counts[i];
  }
  TORCH_CHECK(t0 == N, "qlinear_grouped: counts sum to ", t0, ", x has ", N, " rows");
  at::Tensor y = at::empty({N, out_features}, xc.options());
  const int64_t chunks = (out_features + ROW_CHUNK - 1) / ROW_CHUNK;
  const int64_t items = int64_t(segs.size()) * chunks;
  at::Tensor quantized;
  const Input in = prepare(xc.data_ptr<float>(), N, K, kernels.quantized, quantized);
  float* yp = y.data_ptr<float>();
  // at least MIN_THREAD_BYTES of weights a thread: a small product runs inline, sparing a wake-up of the pool
  const int64_t grain = (MIN_THREAD_BYTES + ROW_CHUNK * row_bytes - 1) / (ROW_CHUNK * row_bytes);
  parallel_items(items, grain, [&](int64_t item) {
    const Segment& seg = segs[item / chunks];
    const int64_t r0 = (item % chunks) * ROW_CHUNK;
    const int64_t r1 = r0 + ROW_CHUNK < out_features ? r0 + ROW_CHUNK : out_features;
    fn(in, seg, r0, r1, yp, out_features);
  });
  return y;
}

// The pairs' products with weights found in one buffer: pair p (of P = slot.numel()) is row p / rep of
// x [T, K] float32; matrix m of its weights starts offsets[m] bytes into row slot[p] of buffer
// (2-D uint8, [S, stride], contiguous), out_features rows of K values in qtype blocks. Returns
// [P, M * out_features] float32, columns [m * out_features, (m + 1) * out_features) matrix m's
// product. The pairs are grouped by slot inside, so each slot's weights are read once for all its
// pairs; a row has the bits qlinear_grouped gives it (the same body, rows independent).
at::Tensor qlinear_slots(const at::Tensor& x, int64_t rep, const at::Tensor& buffer, const at::Tensor& slot,
                         at::IntArrayRef offsets, int64_t qtype, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "qlinear_slots: x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(buffer.device().is_cpu() && buffer.scalar_type() == at::kByte && buffer.dim() == 2 &&
              buffer.is_contiguous(), "qlinear_slots: buffer must be a contiguous 2-D uint8 CPU tensor");
  TORCH_CHECK(slot.device().is_cpu() && slot.scalar_type() == at::kLong && slot.dim() == 1,
              "qlinear_slots: slot must be a 1-D int64 CPU tensor");
  const Kernels kernels = kernels_for(qtype);
  const RowsFn fn = kernels.rows;
  const Geometry g = geometry(qtype);
  TORCH_CHECK(fn != nullptr, "qlinear_slots: no CPU kernel for GGML type ", qtype);
  const int64_t T = x.size(0), K = x.size(1), P = slot.numel(), M = int64_t(offsets.size());
  const int64_t S = buffer.size(0), stride = buffer.size(1);
  TORCH_CHECK(rep > 0 && P == T * rep, "qlinear_slots: ", P, " pairs for ", T, " rows of x times ", rep);
  TORCH_CHECK(K % g.values == 0, "qlinear_slots: row length ", K, " is not a multiple of ", g.values);
  const int64_t matrix_bytes = out_features * (K / g.values * g.bytes);
  for (int64_t off : offsets)
    TORCH_CHECK(off >= 0 && off + matrix_bytes <= stride, "qlinear_slots: a matrix at byte ", off,
                " does not fit a row of ", stride, " bytes");
  const int64_t* sp = slot.contiguous().data_ptr<int64_t>();
  std::vector<int64_t> order(P);  // pairs sorted by slot (stable): each slot's pairs one segment
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(sp[p] >= 0 && sp[p] < S, "qlinear_slots: slot ", sp[p], " outside the buffer's ", S, " rows");
    order[p] = p;
  }
  std::stable_sort(order.begin(), order.end(), [sp](int64_t a, int64_t b) { return sp[a] < sp[b]; });
  at::Tensor xs = at::empty({P, K}, x.options());  // x's rows in the pairs' sorted order
  const float* xp = x.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  for (int64_t i = 0; i < P; ++i) std::memcpy(xsp + i * K, xp + order[i] / rep * K, K * sizeof(float));
  at::Tensor quantized;
  const Input in = prepare(xsp, P, K, kernels.quantized, quantized);
  const uint8_t* base = buffer.data_ptr<uint8_t>();
  std::vector<std::pair<Segment, int64_t>> segs;  // (segment, matrix) of each distinct slot and matrix
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first sorted pair, count) of each distinct slot
  for (int64_t i = 0; i < P;) {
    int64_t j = i;
    while (j < P && sp[order[j]] == sp[order[i]]) ++j;
    runs.emplace_back(i, j - i);
    i = j;
  }
  for (int64_t m = 0; m < M; ++m)
    for (const auto& run : runs)
      segs.push_back({{base + sp[order[run.first]] * stride + offsets[m], run.first, run.second}, m});
  at::Tensor ys = at::empty({M * P, out_features}, x.options());  // [M, P sorted, out]
  float* ysp = ys.data_ptr<float>();
  const int64_t chunks = (out_features + ROW_CHUNK - 1) / ROW_CHUNK;
  const int64_t items = int64_t(segs.size()) * chunks;
  const int64_t grain = (MIN_THREAD_BYTES + ROW_CHUNK * (matrix_bytes / out_features) - 1) /
                        (ROW_CHUNK * (matrix_bytes / out_features));
  parallel_items(items, grain, [&](int64_t item) {
    const auto& [seg, m] = segs[item / chunks];
    const int64_t r0 = (item % chunks) * ROW_CHUNK;
    const int64_t r1 = r0 + ROW_CHUNK < out_features ? r0 + ROW_CHUNK : out_features;
    fn(in, seg, r0, r1, ysp + m * P * out_features, out_features);
  });
  at::Tensor y = at::empty({P, M * out_features}, x.options());
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < P; ++i)
      std::memcpy(yp + order[i] * M * out_features + m * out_features, ysp + (m * P + i) * out_features,
                  out_features * sizeof(float));
  return y;
}

// h = silu(g) * u lane-wise: silu(g) = g / (1 + exp(-g)) (exp_lanes, cpu_lanes.h), each operation
// rounded, so an element's bits depend on its own g and u alone (vectorised or not, any row count).
STRATA_INLINE void silu_mul_body(const float* g, const float* u, float* h, int64_t n) {
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    f32x16 a, b;
    std::memcpy(&a, g + i, sizeof(a));
    std::memcpy(&b, u + i, sizeof(b));
    const f32x16 out = a / (splat(1.0f) + exp_lanes(-a)) * b;
    std::memcpy(h + i, &out, sizeof(out));
  }
  if (i < n) {  // the tail through the same lane arithmetic
    f32x16 a = f32x16{}, b = f32x16{};
    std::memcpy(&a, g + i, (n - i) * sizeof(float));
    std::memcpy(&b, u + i, (n - i) * sizeof(float));
    const f32x16 out = a / (splat(1.0f) + exp_lanes(-a)) * b;
    std::memcpy(h + i, &out, (n - i) * sizeof(float));
  }
}

using SiluMulFn = void (*)(const float*, const float*, float*, int64_t);
STRATA_AVX512 void silu_mul_avx512(const float* g, const float* u, float* h, int64_t n) { silu_mul_body(g, u, h, n); }
STRATA_AVX2 void silu_mul_avx2(const float* g, const float* u, float* h, int64_t n) { silu_mul_body(g, u, h, n); }
void silu_mul_generic(const float* g, const float* u, float* h, int64_t n) { silu_mul_body(g, u, h, n); }

// rows of g [N, F] and u [N, F] (row strides g_stride, u_stride) -> h [N, F] contiguous, threaded over rows.
void silu_mul_rows(const float* g, int64_t g_stride, const float* u, int64_t u_stride, float* h, int64_t N,
                   int64_t F) {
  const SiluMulFn fn = strata_cpu::for_isa<SiluMulFn>(&silu_mul_avx512, &silu_mul_avx2, &silu_mul_generic);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, F));
  at::parallel_for(0, N, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) fn(g + r * g_stride, u + r * u_stride, h + r * F, F);
  });
}

// g, u [..., F] float32 -> silu(g) * u [..., F] float32 (the SiLU-gated activation of every CPU expert path).
at::Tensor silu_mul_cpu(const at::Tensor& g, const at::Tensor& u) {
  TORCH_CHECK(g.device().is_cpu() && g.scalar_type() == at::kFloat && u.scalar_type() == at::kFloat &&
              g.sizes() == u.sizes() && g.dim() >= 1, "silu_mul_cpu: g and u must be float32 CPU tensors of one shape, got ",
              g.sizes(), " ", u.sizes());
  const at::Tensor gc = g.contiguous(), uc = u.contiguous();
  at::Tensor h = at::empty_like(gc);
  const int64_t F = gc.size(-1), N = F ? gc.numel() / F : 0;
  if (N > 0) silu_mul_rows(gc.data_ptr<float>(), F, uc.data_ptr<float>(), F, h.data_ptr<float>(), N, F);
  return h;
}

// A layer's routed experts held whole in one buffer's rows (a CPU cache's slots), every pair in one call:
// pair p (of P = slot.numel()) is row p / rep of x [T, H] through the expert packed gate | up | down at
// offsets[0..2] of row slot[p] (qtypes[0..2], gate and up F x H, down H x F): down(silu(gate x) * up x),
// [P, H] float32. The products are qlinear_slots' (gate and up in one where their formats agree) and the
// activation silu_mul_cpu's, so each row has the bits of those ops called one after another.
at::Tensor slot_ffn_cpu(const at::Tensor& x, int64_t rep, const at::Tensor& buffer, const at::Tensor& slot,
                        at::IntArrayRef offsets, at::IntArrayRef qtypes, int64_t F) {
  TORCH_CHECK(offsets.size() == 3 && qtypes.size() == 3, "slot_ffn_cpu: gate, up and down offsets and types");
  const int64_t H = x.size(1), P = slot.numel();
  at::Tensor g, u;
  int64_t g_stride = F, u_stride = F;
  if (qtypes[0] == qtypes[1]) {
    g = qlinear_slots(x, rep, buffer, slot, {offsets[0], offsets[1]}, qtypes[0], F);  // [P, 2F]
    u = g.narrow(1, F, F);
    g_stride = u_stride = 2 * F;
  } else {
    g = qlinear_slots(x, rep, buffer, slot, {offsets[0]}, qtypes[0], F);
    u = qlinear_slots(x, rep, buffer, slot, {offsets[1]}, qtypes[1], F);
  }
  at::Tensor h = at::empty({P, F}, x.options());
  silu_mul_rows(g.data_ptr<float>(), g_stride, u.data_ptr<float>(), u_stride, h.data_ptr<float>(), P, F);
  return qlinear_slots(h, 1, buffer, slot, {offsets[2]}, qtypes[2], H);
}

// Blocks [begin, end) decoded into out (values of block b at b * values) as T: float32 directly; a 16-bit
// float through a float32 buffer of DECODE_BLOCKS blocks, each value rounded to nearest even as torch's
// conversion rounds it (so the result is the float32 values' .to(dtype), bit for bit).
constexpr int64_t DECODE_BLOCKS = 64;
template <typename T>
void decode_into(BlocksFn fn, const uint8_t* rp, int64_t begin, int64_t end, const Geometry& g, T* out) {
  if constexpr (std::is_same_v<T, float>) {
    fn(rp, begin, end, out);
  } else {
    std::vector<float> buffer(DECODE_BLOCKS * g.values);
    for (int64_t b0 = begin; b0 < end; b0 += DECODE_BLOCKS) {
      const int64_t n = std::min(end - b0, DECODE_BLOCKS);
      fn(rp + b0 * g.bytes, 0, n, buffer.data());  // blocks b0.. as the buffer's first n
      T* dst = out + b0 * g.values;
      for (int64_t i = 0; i < n * g.values; ++i) dst[i] = static_cast<T>(buffer[i]);
    }
  }
}

// Every block of raw (contiguous uint8, whole blocks) decoded to dtype (float32, bfloat16 or float16):
// [blocks * values].
at::Tensor dequantize_blocks(const at::Tensor& raw, int64_t qtype, std::optional<at::ScalarType> dtype) {
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.is_contiguous(),
              "dequantize_blocks: raw must be contiguous uint8 on the CPU");
  BlocksFn fn = kernels_for(qtype).blocks;
  const Geometry g = geometry(qtype);
  TORCH_CHECK(fn != nullptr, "dequantize_blocks: no CPU kernel for GGML type ", qtype);
  TORCH_CHECK(raw.numel() % g.bytes == 0, "dequantize_blocks: ", raw.numel(), " bytes are not whole blocks of ",
              g.bytes);
  const at::ScalarType type = dtype.value_or(at::kFloat);
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf,
              "dequantize_blocks: values as float32, bfloat16 or float16, not ", type);
  const int64_t blocks = raw.numel() / g.bytes;
  at::Tensor out = at::empty({blocks * g.values}, raw.options().dtype(type));
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  const int64_t grain = (MIN_THREAD_BYTES + g.bytes - 1) / g.bytes;
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    if (type == at::kFloat) decode_into(fn, rp, begin, end, g, out.data_ptr<float>());
    else if (type == at::kBFloat16) decode_into(fn, rp, begin, end, g, out.data_ptr<at::BFloat16>());
    else decode_into(fn, rp, begin, end, g, out.data_ptr<at::Half>());
  });
  return out;
}

// How many threads the kernels' parallel regions run on the calling thread (at::parallel_for's team,
// of the OpenMP runtime this extension is linked to): what torch.set_num_threads on that thread gave it.
int64_t kernel_threads() {
  std::atomic<int64_t> seen{0};
  at::parallel_for(0, int64_t(1) << 20, 1, [&](int64_t, int64_t) { seen.fetch_add(1); });
  return seen.load();
}

// The instruction set the kernels run with: 0 generic, 1 AVX2, 2 AVX-512, 3 AVX-512 VNNI.
int64_t kernel_isa() { return int64_t(chosen_isa()); }

// Run with at most instruction set ``isa`` from now on (tests compare the bodies); returns the one chosen.
int64_t limit_kernel_isa(int64_t isa) {
  const Isa best = detect_isa();
  chosen_isa() = int64_t(best) < isa ? best : Isa(isa < 0 ? 0 : isa);
  return int64_t(chosen_isa());
}

}  // namespace

int strata_cpu::chosen_isa() { return int(::chosen_isa()); }

at::Tensor strata_cpu::slot_ffn(const at::Tensor& x, int64_t rep, const at::Tensor& buffer, const at::Tensor& slot,
                                at::IntArrayRef offsets, at::IntArrayRef qtypes, int64_t F) {
  return slot_ffn_cpu(x, rep, buffer, slot, offsets, qtypes, F);
}

TORCH_LIBRARY_FRAGMENT(strata, m) {
  m.def("qlinear_grouped(Tensor x, Tensor[] weights, int[] counts, int qtype, int out_features) -> Tensor");
  m.def("qlinear_slots(Tensor x, int rep, Tensor buffer, Tensor slot, int[] offsets, int qtype, int out_features) -> Tensor");
  m.def("dequantize_blocks(Tensor raw, int qtype, ScalarType? dtype=None) -> Tensor");
  m.def("silu_mul_cpu(Tensor g, Tensor u) -> Tensor");
  m.def("slot_ffn_cpu(Tensor x, int rep, Tensor buffer, Tensor slot, int[] offsets, int[] qtypes, int F) -> Tensor");
  m.def("cpu_kernel_isa() -> int");
  m.def("cpu_kernel_threads() -> int");
  m.def("cpu_kernel_limit_isa(int isa) -> int");
}

TORCH_LIBRARY_IMPL(strata, CPU, m) {
  m.impl("qlinear_grouped", &qlinear_grouped);
  m.impl("qlinear_slots", &qlinear_slots);
  m.impl("dequantize_blocks", &dequantize_blocks);
  m.impl("silu_mul_cpu", &silu_mul_cpu);
  m.impl("slot_ffn_cpu", &slot_ffn_cpu);
}

TORCH_LIBRARY_IMPL(strata, CompositeExplicitAutograd, m) {
  m.impl("cpu_kernel_isa", &kernel_isa);
  m.impl("cpu_kernel_threads", &kernel_threads);
  m.impl("cpu_kernel_limit_isa", &limit_kernel_isa);
}
