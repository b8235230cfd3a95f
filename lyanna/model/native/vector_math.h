// Vector arithmetic of the native decoder with an explicit operation order: dot products, exp,
// and attention's two inner loops for heads of 16 * C dims (see decoder.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

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

// Sum of a[i] * b[i] in a fixed order: 16 interleaved partial sums, a pairwise tree over them,
// then any tail in sequence.
inline float dot(const float* a, const float* b, int64_t n) {
  v16 acc = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load16(a + i) * load16(b + i);
  acc += __builtin_shuffle(acc, v16i{8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15});
  acc += __builtin_shuffle(acc, v16i{4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7});
  acc += __builtin_shuffle(acc, v16i{2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3});
  acc += __builtin_shuffle(acc, v16i{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1});
  float sum = acc[0];
  for (; i < n; ++i) sum += a[i] * b[i];
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
template <int C>
void fixed_scores(const float* query, const float* keys, const int64_t* cols, int64_t count,
                  float scale, float* scores) {
  v16 q[C];
  for (int c = 0; c < C; ++c) q[c] = load16(query + c * kLanes);
  for (int64_t k = 0; k < count; ++k) {
    const float* key = keys + cols[k] * C * kLanes;
    v16 acc = {0};
    for (int c = 0; c < C; ++c) acc += q[c] * load16(key + c * kLanes);
    acc += __builtin_shuffle(acc, v16i{8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15});
    acc += __builtin_shuffle(acc, v16i{4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7});
    acc += __builtin_shuffle(acc, v16i{2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3});
    acc += __builtin_shuffle(acc, v16i{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1});
    scores[k] = acc[0] * scale;
  }
}

template <int C>
void fixed_values(const float* values, const int64_t* cols, const float* weights, int64_t count,
                  float inv, float* dst) {
  v16 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = v16{0};
  for (int64_t k = 0; k < count; ++k) {
    const v16 p = v16{0} + weights[k];
    const float* v = values + cols[k] * C * kLanes;
    for (int c = 0; c < C; ++c) acc[c] += p * load16(v + c * kLanes);
  }
  for (int c = 0; c < C; ++c)
    for (int64_t i = 0; i < kLanes; ++i) dst[c * kLanes + i] = acc[c][i] * inv;
}


}  // namespace vec
