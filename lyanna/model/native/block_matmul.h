// y [M, N] = x [M, K] W^T for a weight W held as GGUF blocks of 32 inputs (Q4_0/Q4_1 layers:
// w = d*q + m with 4-bit q; Q8_0 embedding/LM head: w = d*q with 8-bit q), with integer dot
// products.
//
// Why: torch's int4 kernel dequantizes every weight to float and multiplies in float32 FMAs, so
// each extra row of a product (a draft token under verification, a sequence in a batch, a
// prompt token) costs about as much as the first; on AVX-512 VNNI one `vpdpwssd` does 32
// multiply-adds where an FMA does 16. Rows are quantized to int16 per 32-input block (scale
// max|x| / 32767: 15 bits where bf16 keeps 8), each block's dot product with the 4-bit codes
// is exact in int32, and the block's scales are applied in float32 in a fixed order:
//
//   y[r, j] = sum over blocks g, ascending, of  s[r, g] * (d[j, g] * dot + m[j, g] * sq[r, g])
//
// where dot = sum_k q[j, k] xq[r, k] and sq = sum_k xq[r, k] (exact integers), s the row's
// block scale. A row's result depends on that row alone (batch invariant) and every float
// operation is a plain multiply or add (no contraction), so the AVX-512 and the portable
// paths give the same bits, and lyanna.model.quant.block_matmul_reference reproduces them.
//
// Packed layout (lyanna.model.quant.pack_q4): 16 outputs per tile; per tile and block 4
// chunks of 16 int32 lanes (lane j = output j); nibble i (bits 4i..4i+3) of chunk c holds
// q[j, 32g + 2p] and nibble 4 + i (bits 16 + 4i..) q[j, 32g + 2p + 1] for pair p = 4c + i, so
// `(lane >> 4i) & 0x000F000F` is the int16 pair of codes that `vpdpwssd` multiplies with the
// row's int16 pair (xq[2p], xq[2p + 1]). 8-bit codes (pack_q8): per tile and block 16 pairs of
// 16 lanes of two int8 (q[j, 32g + 2p], q[j, 32g + 2p + 1]), sign-extended to the same int16
// pairs. scales [N/16, K/32, 2, 16] fp16 (the file's own d and m; m = 0 for Q8_0): d then m
// per output.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// Three paths, one result (the same integers, the same float operations in the same order):
// AVX-512 VNNI, AVX2 (what a Zen 3 has; LYANNA_BLOCKS_AVX2 forces it, for tests), portable
// (LYANNA_BLOCKS_PORTABLE forces it).
#if defined(LYANNA_BLOCKS_PORTABLE)
// (tests: the portable loops on any CPU)
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    !defined(LYANNA_BLOCKS_AVX2)
#include <immintrin.h>
#define LYANNA_BLOCKS_VNNI 1
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define LYANNA_BLOCKS_AVX2_PATH 1
#endif

namespace blocks {

constexpr int64_t kTile = 16;    // outputs per tile
constexpr int64_t kBlock = 32;   // inputs per block
constexpr int64_t kChunks = 4;   // int32 vectors of codes per tile and block
#ifdef LYANNA_BLOCKS_VNNI
constexpr int64_t kRowTile = 8;  // rows sharing one pass over a tile's codes (4 and 12: same)
constexpr int64_t kRowTile8 = 8;
#else
constexpr int64_t kRowTile = 4;  // (16 vector registers)
constexpr int64_t kRowTile8 = 1;  // int8 rows: 1, 2, 3, 4 measured alike (1 a little faster)
#endif
constexpr float kQMax = 32767.f;

// Software prefetch this many blocks ahead of the block being multiplied (the next tile's when
// the tile ends: a thread's tiles lie one after another). From one row up to a few the products
// read the weight at the speed of memory, and the hardware's stream prefetcher alone fell
// behind a loop that also computes: on a Zen 5 the 4-bit layers of one forward took 1.61 /
// 1.70 / 2.29 / 4.21 ms for 1 / 2 / 4 / 8 rows, with 16 blocks (4 KB) of prefetch 1.47 / 1.53
// / 2.07 / 3.21 (4 blocks ahead: half the gain; 32 and 64: no better). A hint only: the same
// integers and floats, whatever it does.
constexpr int64_t kPrefetchBlocks = 16;

// Int8 rows (llama.cpp's Q8 activations, `int8_rows`): half the integer work of int16 rows
// per product (u8 x s8 multiply-adds), at 7 bits per input instead of 15. Their codes are
// stored in the order the 4-bit lanes hold their nibbles, so one mask or shift turns a lane
// into four codes that line up with four consecutive bytes of the row: for chunk c of a
// block, bytes (x[8c], x[8c+4], x[8c+1], x[8c+5]) then (x[8c+2], x[8c+6], x[8c+3], x[8c+7]).
constexpr float kQMax8 = 127.f;
constexpr int kOrder8[8] = {0, 4, 1, 5, 2, 6, 3, 7};

// Each row's int16 (or int8) codes per block with their scale and (exact) sum.
template <class Code>
struct Quantized {
  std::vector<Code> codes;   // [M, K] (int8: permuted per chunk as above)
  std::vector<float> scale;  // [M, K/32]
  std::vector<float> sum;    // [M, K/32]
};
using QuantizedRows = Quantized<int16_t>;
using QuantizedRows8 = Quantized<int8_t>;

// One 32-input block of a row: codes (int8: in kOrder8's order), returns the exact sum of the
// codes; *scale = max|v| / qmax. The vector paths below compute the same integers: the maximum
// is order-free, each code is the same float product rounded to nearest-even and clamped.
#if defined(LYANNA_BLOCKS_VNNI) || defined(LYANNA_BLOCKS_AVX2_PATH)
// 32 int8 codes in natural order -> kOrder8's order within each group of 8 (one byte shuffle).
inline __m256i in_order8(__m256i natural) {
  const __m256i order = _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,
                                         0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  return _mm256_shuffle_epi8(natural, order);
}
#endif

template <class Code>
inline int32_t quantize_block(const float* v, Code* q, float qmax, float* scale) {
  constexpr bool int8 = sizeof(Code) == 1;
#if defined(LYANNA_BLOCKS_VNNI)
  const __m512 a0 = _mm512_abs_ps(_mm512_loadu_ps(v)), a1 = _mm512_abs_ps(_mm512_loadu_ps(v + 16));
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
#elif defined(LYANNA_BLOCKS_AVX2_PATH)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int h = 0; h < 4; ++h) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * h)), m);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
#else
  float top = 0.f;
  for (int64_t k = 0; k < kBlock; ++k) top = std::max(top, std::fabs(v[k]));
#endif
  const float inv = top > 0.f ? qmax / top : 0.f;
  *scale = top / qmax;
#if defined(LYANNA_BLOCKS_VNNI)
  const __m512 vinv = _mm512_set1_ps(inv), hi = _mm512_set1_ps(qmax), lo = _mm512_set1_ps(-qmax);
  __m512i c[2];
  for (int h = 0; h < 2; ++h) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(v + 16 * h), vinv);
    const __m512 r = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c[h] = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
  }
  if constexpr (int8) {
    const __m256i natural = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm512_cvtepi32_epi8(c[0])), _mm512_cvtepi32_epi8(c[1]), 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), in_order8(natural));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtepi32_epi16(c[0]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm512_cvtepi32_epi16(c[1]));
  }
  return _mm512_reduce_add_epi32(_mm512_add_epi32(c[0], c[1]));
#elif defined(LYANNA_BLOCKS_AVX2_PATH)
  const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(qmax), lo = _mm256_set1_ps(-qmax);
  __m256i c[4];
  for (int h = 0; h < 4; ++h) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(v + 8 * h), vinv);
    const __m256 r = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c[h] = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
  }
  // packs interleave 128-bit lanes: words (0-3, 8-11, 4-7, 12-15); permute4x64 restores order
  const __m256i w0 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);
  const __m256i w1 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8);
  if constexpr (int8) {
    const __m256i natural = _mm256_permute4x64_epi64(_mm256_packs_epi16(w0, w1), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), in_order8(natural));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), w0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), w1);
  }
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
#else
  int32_t total = 0;
  for (int64_t k = 0; k < kBlock; ++k) {
    const int64_t source = int8 ? 8 * (k / 8) + kOrder8[k % 8] : k;
    const float c = std::min(std::max(std::nearbyint(v[source] * inv), -qmax), qmax);
    q[k] = static_cast<Code>(c);
    total += q[k];
  }
  return total;
#endif
}

template <class Code>
inline void quantize_rows(const float* x, int64_t M, int64_t K, Quantized<Code>& out) {
  const float qmax = sizeof(Code) == 1 ? kQMax8 : kQMax;
  const int64_t G = K / kBlock;
  out.codes.resize(M * K);
  out.scale.resize(M * G);
  out.sum.resize(M * G);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {  // rows are independent
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = r * G + g;
        const int32_t total = quantize_block(x + r * K + g * kBlock,
                                             out.codes.data() + r * K + g * kBlock, qmax,
                                             out.scale.data() + i);
        out.sum[i] = static_cast<float>(total);
      }
  });
}

// Bytes of codes per tile and block: 4-bit codes in 4 chunks of 16 int32 lanes; 8-bit codes
// (GGUF Q8_0, the embedding and LM head) as 16 pairs of 16 lanes of two int8.
template <int Bits>
constexpr int64_t kBlockBytes = Bits == 4 ? kChunks * kTile * 4 : kBlock * kTile;

// Non-temporal (locality 0: prefetchnta): the weights stream through once per forward, and
// prefetched for keeps they likely evicted the interpreter's and torch's working set from
// every cache level, so the Python and small torch ops between two forwards (drafting, the
// acceptance rule, sampling, bookkeeping) ran cold. Measured on Zen 5, 2 threads, engine
// decoding at batch 1 (``bench.native_ab --engine``): AR +3-8 %, n-gram and Lyanna about
// 0-9 %, the forward alone unchanged within noise (docs/benchmarks.md); not measured on an
// Intel CPU. ``LYANNA_PREFETCH_T0`` builds the previous hint, for an A/B.
#ifdef LYANNA_PREFETCH_T0
constexpr int kPrefetchLocality = 3;
#else
constexpr int kPrefetchLocality = 0;
#endif

template <int Bits>
inline void prefetch_ahead(const uint8_t* codes, const c10::Half* scales, int64_t g) {
#ifndef LYANNA_NO_PREFETCH  // (benchmarks: the build without it, for an A/B in one process)
  // integer addresses: past the last tile they point nowhere, which a prefetch ignores
  const auto at = reinterpret_cast<uintptr_t>(codes) + (g + kPrefetchBlocks) * kBlockBytes<Bits>;
  for (int64_t i = 0; i < kBlockBytes<Bits>; i += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(at + i), 0, kPrefetchLocality);
  const auto s = reinterpret_cast<uintptr_t>(scales + (g + kPrefetchBlocks) * 2 * kTile);
  __builtin_prefetch(reinterpret_cast<const void*>(s), 0, kPrefetchLocality);  // d and m: one line per block
#endif
}

#ifdef LYANNA_BLOCKS_VNNI

// Calls f(p, codes) for the 16 input pairs p of one tile's block: codes holds, per output
// lane, the int16 pair (q[2p], q[2p + 1]).
template <int Bits, class F>
inline void for_pairs(const uint8_t* block, F&& f) {
  if constexpr (Bits == 4) {
    const __m512i mask = _mm512_set1_epi32(0x000F000F);
    for (int c = 0; c < kChunks; ++c) {
      const __m512i packed = _mm512_loadu_si512(block + c * kTile * 4);
      for (int i = 0; i < 4; ++i) f(4 * c + i, _mm512_and_si512(_mm512_srli_epi32(packed, 4 * i), mask));
    }
  } else {
    for (int p = 0; p < kBlock / 2; ++p)
      f(p, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(block + p * 2 * kTile))));
  }
}

// Rows [r0, r0 + R) of one tile: per block g, block_dots(g, dots) leaves each row's exact
// integer dot products with the tile's codes in dots[r], and the block's scales are applied
// in float32: acc[r] += s[r, g] * (d * dot + m * sq[r, g]). Forced inline: without it GCC
// kept the int16 products 25 % slower at one row (measured).
template <int R, class Rows, class BlockDots>
[[gnu::always_inline]] inline void tile_loop(const c10::Half* scales, const Rows& xq, int64_t r0,
                                             int64_t K, float* y, int64_t N, int64_t tile,
                                             BlockDots&& block_dots) {
  const int64_t G = K / kBlock;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i dots[R];
    for (int r = 0; r < R; ++r) dots[r] = _mm512_setzero_si512();
    block_dots(g, dots);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(scales + g * 2 * kTile)));
    const __m512 m =
        _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(scales + g * 2 * kTile + kTile)));
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * G + g;
      const __m512 t = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(dots[r])),
                                     _mm512_mul_ps(m, _mm512_set1_ps(xq.sum[i])));
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(t, _mm512_set1_ps(xq.scale[i])));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (r0 + r) * N + tile * kTile, acc[r]);
}

// With few rows, each row's products alternate between two accumulators (even and odd pairs,
// added at the block's end: the same integers), so that more than R dependent chains of
// vpdpwssd are in flight.
template <int Bits, int R>
inline void tile_rows(const uint8_t* codes, const c10::Half* scales, const QuantizedRows& xq,
                      int64_t r0, int64_t K, float* y, int64_t N, int64_t tile) {
  constexpr int kSplit = Bits == 4 && R <= 4 ? 2 : 1;  // (8-bit pairs: twice slower, measured)
  tile_loop<R>(scales, xq, r0, K, y, N, tile, [&](int64_t g, __m512i (&dots)[R]) {
    prefetch_ahead<Bits>(codes, scales, g);
    __m512i odd[R];
    for (int r = 0; r < R; ++r) odd[r] = _mm512_setzero_si512();
    for_pairs<Bits>(codes + g * kBlockBytes<Bits>, [&](int p, __m512i pair) {
      const int64_t k = g * kBlock + 2 * p;
      for (int r = 0; r < R; ++r) {
        int32_t xs;
        std::memcpy(&xs, xq.codes.data() + (r0 + r) * K + k, sizeof xs);
        __m512i& into = kSplit == 2 && (p & 1) ? odd[r] : dots[r];
        into = _mm512_dpwssd_epi32(into, pair, _mm512_set1_epi32(xs));
      }
    });
    if constexpr (kSplit == 2)
      for (int r = 0; r < R; ++r) dots[r] = _mm512_add_epi32(dots[r], odd[r]);
  });
}

// 4-bit codes with int8 rows: vpdpbusd multiplies the four u8 codes of a lane with four s8
// inputs (64 multiply-adds where vpdpwssd does 32).
template <int R>
inline void tile_rows8(const uint8_t* codes, const c10::Half* scales, const QuantizedRows8& xq,
                       int64_t r0, int64_t K, float* y, int64_t N, int64_t tile) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  tile_loop<R>(scales, xq, r0, K, y, N, tile, [&](int64_t g, __m512i (&dots)[R]) {
    prefetch_ahead<4>(codes, scales, g);
    const uint8_t* block = codes + g * kBlockBytes<4>;
    for (int c = 0; c < kChunks; ++c) {
      const __m512i packed = _mm512_loadu_si512(block + c * kTile * 4);
      const __m512i lo = _mm512_and_si512(packed, mask);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq.codes.data() + (r0 + r) * K + g * kBlock + 8 * c;
        int32_t a, b;
        std::memcpy(&a, xr, sizeof a);
        std::memcpy(&b, xr + 4, sizeof b);
        dots[r] = _mm512_dpbusd_epi32(dots[r], lo, _mm512_set1_epi32(a));
        dots[r] = _mm512_dpbusd_epi32(dots[r], hi, _mm512_set1_epi32(b));
      }
    }
  });
}

#elif defined(LYANNA_BLOCKS_AVX2_PATH)

// The 16 output lanes as two halves of 8; vpmaddwd + vpaddd give the same integers as
// vpdpwssd (no intermediate can overflow: |q| <= 128, |xq| <= 32767, 32 products per block).
template <int Bits, class F>
inline void for_pairs(const uint8_t* block, F&& f) {
  if constexpr (Bits == 4) {
    const __m256i mask = _mm256_set1_epi32(0x000F000F);
    for (int c = 0; c < kChunks; ++c) {
      const __m256i lo = _mm256_loadu_si256((const __m256i*)(block + c * kTile * 4));
      const __m256i hi = _mm256_loadu_si256((const __m256i*)(block + c * kTile * 4 + 32));
      for (int i = 0; i < 4; ++i)
        f(4 * c + i, _mm256_and_si256(_mm256_srli_epi32(lo, 4 * i), mask),
          _mm256_and_si256(_mm256_srli_epi32(hi, 4 * i), mask));
    }
  } else {
    for (int p = 0; p < kBlock / 2; ++p) {
      const uint8_t* pair = block + p * 2 * kTile;
      f(p, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)pair)),
        _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(pair + 16))));
    }
  }
}

// Rows [r0, r0 + R) of one tile, as two halves of 8 outputs (see the AVX-512 tile_loop).
template <int R, class Rows, class BlockDots>
[[gnu::always_inline]] inline void tile_loop(const c10::Half* scales, const Rows& xq, int64_t r0,
                                             int64_t K, float* y, int64_t N, int64_t tile,
                                             BlockDots&& block_dots) {
  const int64_t G = K / kBlock;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i dots[R][2];
    for (int r = 0; r < R; ++r) dots[r][0] = dots[r][1] = _mm256_setzero_si256();
    block_dots(g, dots);
    for (int h = 0; h < 2; ++h) {
      const c10::Half* sc = scales + g * 2 * kTile + h * 8;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)sc));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sc + kTile)));
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * G + g;
        const __m256 t = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(dots[r][h])),
                                       _mm256_mul_ps(m, _mm256_set1_ps(xq.sum[i])));
        acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(t, _mm256_set1_ps(xq.scale[i])));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (r0 + r) * N + tile * kTile + h * 8, acc[r][h]);
}

template <int Bits, int R>
inline void tile_rows(const uint8_t* codes, const c10::Half* scales, const QuantizedRows& xq,
                      int64_t r0, int64_t K, float* y, int64_t N, int64_t tile) {
  tile_loop<R>(scales, xq, r0, K, y, N, tile, [&](int64_t g, __m256i (&dots)[R][2]) {
    prefetch_ahead<Bits>(codes, scales, g);
    for_pairs<Bits>(codes + g * kBlockBytes<Bits>, [&](int p, __m256i a, __m256i b) {
      const int64_t k = g * kBlock + 2 * p;
      for (int r = 0; r < R; ++r) {
        int32_t xs;
        std::memcpy(&xs, xq.codes.data() + (r0 + r) * K + k, sizeof xs);
        const __m256i x = _mm256_set1_epi32(xs);
        dots[r][0] = _mm256_add_epi32(dots[r][0], _mm256_madd_epi16(a, x));
        dots[r][1] = _mm256_add_epi32(dots[r][1], _mm256_madd_epi16(b, x));
      }
    });
  });
}

// Int8 rows: vpmaddubsw multiplies u8 codes with s8 inputs in pairs (int16 sums of at most
// 2 * 15 * 127; eight of them per block stay below 2^15), one vpmaddwd per block widens.
template <int R>
inline void tile_rows8(const uint8_t* codes, const c10::Half* scales, const QuantizedRows8& xq,
                       int64_t r0, int64_t K, float* y, int64_t N, int64_t tile) {
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  tile_loop<R>(scales, xq, r0, K, y, N, tile, [&](int64_t g, __m256i (&dots)[R][2]) {
    prefetch_ahead<4>(codes, scales, g);
    __m256i sums[R][2];
    for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
    const uint8_t* block = codes + g * kBlockBytes<4>;
    for (int c = 0; c < kChunks; ++c) {
      __m256i lo[2], hi[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i packed = _mm256_loadu_si256((const __m256i*)(block + c * kTile * 4 + h * 32));
        lo[h] = _mm256_and_si256(packed, mask);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq.codes.data() + (r0 + r) * K + g * kBlock + 8 * c;
        int32_t a, b;
        std::memcpy(&a, xr, sizeof a);
        std::memcpy(&b, xr + 4, sizeof b);
        const __m256i xa = _mm256_set1_epi32(a), xb = _mm256_set1_epi32(b);
        for (int h = 0; h < 2; ++h)
          sums[r][h] = _mm256_add_epi16(sums[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xa),
                                                                     _mm256_maddubs_epi16(hi[h], xb)));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) dots[r][h] = _mm256_madd_epi16(sums[r][h], ones);
  });
}

#else

typedef int32_t v16i32 __attribute__((vector_size(64)));
typedef float v16f __attribute__((vector_size(64)));

// The portable twin of the AVX-512 path: the same integers, the same float operations.
template <int Bits, class F>
inline void for_pairs(const uint8_t* block, F&& f) {
  for (int p = 0; p < kBlock / 2; ++p) {
    v16i32 lo, hi;
    for (int j = 0; j < kTile; ++j) {
      if constexpr (Bits == 4) {
        int32_t lane;
        std::memcpy(&lane, block + ((p / 4) * kTile + j) * 4, sizeof lane);
        lo[j] = (lane >> (4 * (p % 4))) & 0xF;
        hi[j] = (lane >> (16 + 4 * (p % 4))) & 0xF;
      } else {
        lo[j] = static_cast<int8_t>(block[(p * kTile + j) * 2]);
        hi[j] = static_cast<int8_t>(block[(p * kTile + j) * 2 + 1]);
      }
    }
    f(p, lo, hi);
  }
}

template <int R, class Rows, class BlockDots>
[[gnu::always_inline]] inline void tile_loop(const c10::Half* scales, const Rows& xq, int64_t r0,
                                             int64_t K, float* y, int64_t N, int64_t tile,
                                             BlockDots&& block_dots) {
  const int64_t G = K / kBlock;
  v16f acc[R];
  for (int r = 0; r < R; ++r) acc[r] = v16f{0};
  for (int64_t g = 0; g < G; ++g) {
    v16i32 dots[R];
    for (int r = 0; r < R; ++r) dots[r] = v16i32{0};
    block_dots(g, dots);
    v16f d, m;
    for (int j = 0; j < kTile; ++j) {
      d[j] = static_cast<float>(scales[g * 2 * kTile + j]);
      m[j] = static_cast<float>(scales[g * 2 * kTile + kTile + j]);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * G + g;
      v16f dot;
      for (int j = 0; j < kTile; ++j) dot[j] = static_cast<float>(dots[r][j]);
      const v16f t = d * dot + m * xq.sum[i];
      acc[r] += t * xq.scale[i];
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + (r0 + r) * N + tile * kTile, &acc[r], sizeof acc[r]);
}

template <int Bits, int R>
inline void tile_rows(const uint8_t* codes, const c10::Half* scales, const QuantizedRows& xq,
                      int64_t r0, int64_t K, float* y, int64_t N, int64_t tile) {
  tile_loop<R>(scales, xq, r0, K, y, N, tile, [&](int64_t g, v16i32 (&dots)[R]) {
    prefetch_ahead<Bits>(codes, scales, g);
    for_pairs<Bits>(codes + g * kBlockBytes<Bits>, [&](int p, v16i32 lo, v16i32 hi) {
      for (int r = 0; r < R; ++r) {
        const int16_t* xr = xq.codes.data() + (r0 + r) * K + g * kBlock + 2 * p;
        dots[r] += lo * static_cast<int32_t>(xr[0]) + hi * static_cast<int32_t>(xr[1]);
      }
    });
  });
}

template <int R>
inline void tile_rows8(const uint8_t* codes, const c10::Half* scales, const QuantizedRows8& xq,
                       int64_t r0, int64_t K, float* y, int64_t N, int64_t tile) {
  tile_loop<R>(scales, xq, r0, K, y, N, tile, [&](int64_t g, v16i32 (&dots)[R]) {
    prefetch_ahead<4>(codes, scales, g);
    const uint8_t* block = codes + g * kBlockBytes<4>;
    for (int c = 0; c < kChunks; ++c)
      for (int j = 0; j < kTile; ++j) {
        uint32_t lane;
        std::memcpy(&lane, block + (c * kTile + j) * 4, sizeof lane);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xq.codes.data() + (r0 + r) * K + g * kBlock + 8 * c;
          for (int b = 0; b < 4; ++b)
            dots[r][j] += static_cast<int32_t>((lane >> (8 * b)) & 0xF) * xr[b] +
                          static_cast<int32_t>((lane >> (8 * b + 4)) & 0xF) * xr[4 + b];
        }
      }
  });
}
#endif

template <int Bits, int R>
inline void rows_step(const uint8_t* codes, const c10::Half* scales, const QuantizedRows& xq,
                      int64_t r0, int64_t rows, int64_t K, float* y, int64_t N, int64_t tile) {
  if constexpr (R > 1) {
    if (rows < R) return rows_step<Bits, R - 1>(codes, scales, xq, r0, rows, K, y, N, tile);
  }
  tile_rows<Bits, R>(codes, scales, xq, r0, K, y, N, tile);
}

template <int R>
inline void rows_step8(const uint8_t* codes, const c10::Half* scales, const QuantizedRows8& xq,
                       int64_t r0, int64_t rows, int64_t K, float* y, int64_t N, int64_t tile) {
  if constexpr (R > 1) {
    if (rows < R) return rows_step8<R - 1>(codes, scales, xq, r0, rows, K, y, N, tile);
  }
  tile_rows8<R>(codes, scales, xq, r0, K, y, N, tile);
}

// x [M, K] float32 times a packed weight (kBlockBytes<Bits> per tile and block) with scales
// [N/16, K/32, 2, 16] fp16 -> y [M, N]. int8_rows (4-bit weights only): the rows as int8
// (QuantizedRows8) instead of int16.
template <int Bits>
inline void matmul(const float* x, int64_t M, int64_t K, const uint8_t* packed,
                   const c10::Half* scales, int64_t N, float* y, bool int8_rows = false) {
  const int64_t G = K / kBlock, tiles = N / kTile;
  if (Bits == 4 && int8_rows) {
    QuantizedRows8 xq;
    quantize_rows(x, M, K, xq);
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t r0 = 0; r0 < M; r0 += kRowTile8)
          rows_step8<kRowTile8>(packed + t * G * kBlockBytes<4>, scales + t * G * 2 * kTile, xq,
                                r0, std::min(kRowTile8, M - r0), K, y, N, t);
    });
    return;
  }
  QuantizedRows xq;
  quantize_rows(x, M, K, xq);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* codes = packed + t * G * kBlockBytes<Bits>;
      const c10::Half* s = scales + t * G * 2 * kTile;
      for (int64_t r0 = 0; r0 < M; r0 += kRowTile)
        rows_step<Bits, kRowTile>(codes, s, xq, r0, std::min(kRowTile, M - r0), K, y, N, t);
    }
  });
}

}  // namespace blocks
