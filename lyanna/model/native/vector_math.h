// Vector arithmetic of the native decoder with an explicit operation order: dot products, exp,
// and attention's two inner loops for heads of 16 * C dims (see decoder.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include <c10/util/Half.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace vec {

constexpr int64_t kLanes = 16;  // partial sums kept in this many lanes (one AVX-512 register)

// Every floating-point operation below is written out (no contraction into FMAs by the
// compiler: -ffp-contract=off; explicit std::fma where wanted), so a vectorised loop body and
// its scalar tail compute the same bits, and a value never depends on where in a loop it falls.

// GCC/Clang vector extensions: one AVX-512 register, or two AVX2 ones, whatever the CPU has.
typedef float v16 __attribute__((vector_size(64)));
typedef int v16i __attribute__((vector_size(64)));
constexpr int64_t kMaxHeadDim = 256;

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A float16 KV cache's row, as float32 (every float16 is exactly a float32).
inline v16 load16(const c10::Half* p) {
#if defined(__AVX512F__)
  const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  v16 v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
#else
  v16 v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// The 16 lanes' sum by a pairwise tree: lanes i + (i + 8), then i + (i + 4), i + (i + 2),
// i + (i + 1).
inline float tree_sum(v16 acc) {
  acc += __builtin_shuffle(acc, v16i{8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15});
  acc += __builtin_shuffle(acc, v16i{4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7});
  acc += __builtin_shuffle(acc, v16i{2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3});
  acc += __builtin_shuffle(acc, v16i{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1});
  return acc[0];
}

// Sum of a[i] * b[i] in a fixed order: 16 interleaved partial sums, a pairwise tree over them,
// then any tail in sequence.
template <class B>
inline float dot(const float* a, const B* b, int64_t n) {
  v16 acc = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load16(a + i) * load16(b + i);
  float sum = tree_sum(acc);
  for (; i < n; ++i) sum += a[i] * static_cast<float>(b[i]);
  return sum;
}

// exp(x) from elementwise IEEE operations only (Cephes' expf polynomial, within 2 ulp), so
// that the compiler may vectorise it without changing a bit; x is clamped to [-87, 88].
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  float r = std::fma(k, -0.693359375f, x);
  r = std::fma(k, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r) + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}


// The two loops of attention for a head of exactly 16 * C dims, with the query and the
// accumulators in registers: the same operations in the same order as ``dot`` and the generic
// loop below (so the same bits), without a round trip through memory per key.
template <int C, class KV>
void fixed_scores_generic(const float* query, const KV* keys, const int64_t* cols,
                          int64_t count, float scale, float* scores) {
  v16 q[C];
  for (int c = 0; c < C; ++c) q[c] = load16(query + c * kLanes);
  for (int64_t k = 0; k < count; ++k) {
    const KV* key = keys + cols[k] * C * kLanes;
    v16 acc = q[0] * load16(key);
    for (int c = 1; c < C; ++c) acc += q[c] * load16(key + c * kLanes);
    scores[k] = tree_sum(acc) * scale;
  }
}

#if defined(__AVX2__) && !defined(LYANNA_GENERIC_ATTENTION)
// AVX2: GCC lowers the 16-lane vector type through the stack there (xmm stores read back as
// ymm: a store-forwarding stall per operation, which made attention a third of a decode
// step), so attention's loops are written with 8-lane registers: the same operations in the
// same order, hence the generic loops' bits. Scores take eight keys at a time: each key's 16
// partial sums, then the same pairwise tree (lanes i + 8, i + 4, i + 2, i + 1) for the eight
// keys together in three shuffle steps (float addition commutes exactly).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {  // a float16 cache row as float32, exactly
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float v[8];
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  return _mm256_loadu_ps(v);
#endif
}

template <int C, class KV>
void fixed_scores(const float* query, const KV* keys, const int64_t* cols, int64_t count,
                  float scale, float* scores) {
  __m256 q[2 * C];  // the query as 16-lane chunks, each two registers
  for (int c = 0; c < 2 * C; ++c) q[c] = _mm256_loadu_ps(query + 8 * c);
  const __m256 factor = _mm256_set1_ps(scale);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int64_t k = 0;
  for (; k + 8 <= count; k += 8) {
    __m256 half[8];  // key j: lanes i + (i + 8) of its 16 partial sums
    for (int j = 0; j < 8; ++j) {
      const KV* key = keys + cols[k + j] * C * kLanes;
      __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
      for (int c = 0; c < C; ++c) {
        lo = _mm256_add_ps(lo, _mm256_mul_ps(q[2 * c], load8(key + 16 * c)));
        hi = _mm256_add_ps(hi, _mm256_mul_ps(q[2 * c + 1], load8(key + 16 * c + 8)));
      }
      half[j] = _mm256_add_ps(lo, hi);
    }
    __m256 quarter[4];  // keys 2p | 2p + 1: lanes i + (i + 4), four each
    for (int p = 0; p < 4; ++p)
      quarter[p] = _mm256_add_ps(_mm256_permute2f128_ps(half[2 * p], half[2 * p + 1], 0x20),
                                 _mm256_permute2f128_ps(half[2 * p], half[2 * p + 1], 0x31));
    __m256 eighth[2];  // keys (4h, 4h + 2 | 4h + 1, 4h + 3): lanes i + (i + 2), two each
    for (int h = 0; h < 2; ++h)
      eighth[h] = _mm256_add_ps(
          _mm256_shuffle_ps(quarter[2 * h], quarter[2 * h + 1], _MM_SHUFFLE(1, 0, 1, 0)),
          _mm256_shuffle_ps(quarter[2 * h], quarter[2 * h + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 sums = _mm256_add_ps(  // keys (0, 2, 4, 6 | 1, 3, 5, 7)
        _mm256_shuffle_ps(eighth[0], eighth[1], _MM_SHUFFLE(2, 0, 2, 0)),
        _mm256_shuffle_ps(eighth[0], eighth[1], _MM_SHUFFLE(3, 1, 3, 1)));
    _mm256_storeu_ps(scores + k, _mm256_permutevar8x32_ps(_mm256_mul_ps(sums, factor), order));
  }
  if (k < count) fixed_scores_generic<C>(query, keys, cols + k, count - k, scale, scores + k);
}
#else
template <int C, class KV>
void fixed_scores(const float* query, const KV* keys, const int64_t* cols, int64_t count,
                  float scale, float* scores) {
  fixed_scores_generic<C>(query, keys, cols, count, scale, scores);
}
#endif

#if defined(__AVX2__) && !defined(LYANNA_GENERIC_ATTENTION)
template <int C, class KV>
void fixed_values(const KV* values, const int64_t* cols, const float* weights, int64_t count,
                  float inv, float* dst) {
  __m256 acc[2 * C];
  for (int c = 0; c < 2 * C; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < count; ++k) {
    const __m256 p = _mm256_set1_ps(weights[k]);
    const KV* v = values + cols[k] * C * kLanes;
    for (int c = 0; c < 2 * C; ++c)
      acc[c] = _mm256_add_ps(acc[c], _mm256_mul_ps(p, load8(v + 8 * c)));
  }
  const __m256 scale = _mm256_set1_ps(inv);
  for (int c = 0; c < 2 * C; ++c) _mm256_storeu_ps(dst + 8 * c, _mm256_mul_ps(acc[c], scale));
}
#else
template <int C, class KV>
void fixed_values(const KV* values, const int64_t* cols, const float* weights, int64_t count,
                  float inv, float* dst) {
  v16 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = v16{0};
  for (int64_t k = 0; k < count; ++k) {
    const v16 p = v16{0} + weights[k];
    const KV* v = values + cols[k] * C * kLanes;
    for (int c = 0; c < C; ++c) acc[c] += p * load16(v + c * kLanes);
  }
  for (int c = 0; c < C; ++c)
    for (int64_t i = 0; i < kLanes; ++i) dst[c * kLanes + i] = acc[c][i] * inv;
}
#endif


// Softmax weights in place over scores[0, count): exp(score - max), and 1 / their sum. The
// sum runs in 16 lanes (score k in lane k mod 16, in ascending order), then the pairwise tree
// (``tree_sum``): one sequential sum was a chain of dependent additions, as long as the context.
inline float softmax_weights(float* scores, int64_t count) {
  if (count == 0) return 0.f;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t k = 0; k < count; ++k) top = std::max(top, scores[k]);  // exact in any order
  for (int64_t k = 0; k < count; ++k) scores[k] = fast_exp(scores[k] - top);
  v16 acc = {0};
  int64_t k = 0;
  for (; k + kLanes <= count; k += kLanes) acc += load16(scores + k);
  for (int64_t i = 0; k + i < count; ++i) acc[i] += scores[k + i];
  return 1.f / tree_sum(acc);
}

#if defined(__AVX512F__) && !defined(LYANNA_GENERIC_ATTENTION)
#define LYANNA_GROUPED_ATTENTION 1
// Several queries at once over the keys and values they all see (a sequence's cached rows,
// for the heads of one KV head and every new row of the step): each key and value is loaded
// (and converted from float16) once for the block instead of once per query, and the scores of
// sixteen keys are reduced together. Every query gets the operations of
// ``fixed_scores_generic`` and ``fixed_values`` in their order, so the same bits.
constexpr int kMaxBlock = 6;  // queries per block (at most 24 / C: registers)

inline __m512 load_row(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_row(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// out[j] = scale * tree_sum(partial[j]) for 16 keys j: the lanes i +
// (i + 8), i + (i + 4), i + (i + 2), i + (i + 1) of every key at once by shuffles (float
// addition commutes exactly), then the keys back in order.
inline void reduce16(const float* partial, float scale, float* out) {
  __m512 r[8], t[4], u[2];
  for (int m = 0; m < 8; ++m) {  // keys 2m | 2m + 1: lanes i + (i + 8)
    const __m512 a = _mm512_loadu_ps(partial + 32 * m), b = _mm512_loadu_ps(partial + 32 * m + 16);
    r[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int p = 0; p < 4; ++p)  // four keys, i + (i + 4)
    t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * p], r[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(r[2 * p], r[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int h = 0; h < 2; ++h)  // eight keys, i + (i + 2)
    u[h] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * h], t[2 * h + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * h], t[2 * h + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, _mm512_mul_ps(sums, _mm512_set1_ps(scale))));
}

// scores[i][k] for keys 0 .. L-1 (contiguous rows of 16 * C dims) and NQ queries; writes up to
// 15 entries past L (scratch: the caller's buffers have room). partial: NQ * 256 floats.
template <int C, int NQ, class KV>
void block_scores(const float* const* query, const KV* keys, int64_t L, float scale,
                  float* const* scores, float* partial) {
  __m512 q[NQ][C];
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < C; ++c) q[i][c] = _mm512_loadu_ps(query[i] + c * kLanes);
  for (int64_t k0 = 0; k0 < L; k0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, L - k0);
    for (int64_t j = 0; j < n; ++j) {
      const KV* key = keys + (k0 + j) * C * kLanes;
      __m512 kv[C];
      for (int c = 0; c < C; ++c) kv[c] = load_row(key + c * kLanes);
      for (int i = 0; i < NQ; ++i) {
        __m512 acc = _mm512_mul_ps(q[i][0], kv[0]);
        for (int c = 1; c < C; ++c) acc = _mm512_add_ps(acc, _mm512_mul_ps(q[i][c], kv[c]));
        _mm512_storeu_ps(partial + (i * kLanes + j) * kLanes, acc);
      }
    }
    for (int i = 0; i < NQ; ++i) reduce16(partial + i * kLanes * kLanes, scale, scores[i] + k0);
  }
}

// acc[i] (C * 16 floats each) = sum over keys k < L, ascending, of weights[i][k] * value k.
template <int C, int NQ, class KV>
void block_values(const KV* values, int64_t L, const float* const* weights, float* const* acc) {
  __m512 a[NQ][C];
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < C; ++c) a[i][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < L; ++k) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load_row(values + k * C * kLanes + c * kLanes);
    for (int i = 0; i < NQ; ++i) {
      const __m512 p = _mm512_set1_ps(weights[i][k]);
      for (int c = 0; c < C; ++c) a[i][c] = _mm512_add_ps(a[i][c], _mm512_mul_ps(p, v[c]));
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc[i] + c * kLanes, a[i][c]);
}
#endif

}  // namespace vec
