// The decoder layers of a 4-bit Llama-family model in one call (CPU).
//
// Why: a q4 decode step spent about half of its time in ~1,500 small eager ops around the
// int4 products (casts, RMSNorm, RoPE, KV writes, float64 attention). Here the products stay
// torch's int4 kernel and everything between them is a plain loop over rows.
//
// Batch invariance (what makes speculation lossless on this path): every loop computes a row
// from that row alone in a fixed order, and attention visits exactly the key rows a query may
// see, in ascending order, whatever else shares the forward. A token's hidden state is thus
// the same bitwise whether it runs alone (decoding) or inside a token tree (verification),
// without the float64 attention the eager path needs for that.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kLanes = 16;  // partial sums kept in this many lanes (one AVX-512 register)
constexpr int64_t kGroup = 32;  // GGUF block size = the int4 kernel's group size

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

// RMSNorm of each row of x [n, d] times w, rounded to bf16 (the int4 kernel's input).
void rms_norm_bf16(const float* x, const float* w, bf16* out, int64_t n, int64_t d, float eps) {
  for (int64_t r = 0; r < n; ++r) {
    const float* row = x + r * d;
    const float inv = 1.f / std::sqrt(dot(row, row, d) / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) out[r * d + i] = bf16(row[i] * inv * w[i]);
  }
}

void add_bf16(float* x, const bf16* y, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] += static_cast<float>(y[i]);
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz) {
  return at::_weight_int4pack_mm_for_cpu(x, packed, kGroup, sz);
}

struct Shape {
  int64_t B, q, d, nh, nkv, hd, inter, S, T;
};

// RoPE on queries and keys (Hugging Face rotate-half layout, signed sin table); queries go to
// `queries` [B*q, nh, hd], keys and values to the cache rows after each slot's prefix.
void rope_and_store(const bf16* qkv, const Shape& s, const int64_t* positions,
                    const int64_t* slots, const int64_t* lengths, const float* cos,
                    const float* sin, float* queries, float* kc, float* vc) {
  const int64_t width = (s.nh + 2 * s.nkv) * s.hd, half = s.hd / 2;
  std::vector<float> head(s.hd);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t j = 0; j < s.q; ++j) {
      const int64_t r = b * s.q + j, pos = positions[r], row = lengths[b] + j;
      const float *c = cos + pos * s.hd, *sn = sin + pos * s.hd;
      for (int64_t h = 0; h < s.nh + 2 * s.nkv; ++h) {
        const bf16* src = qkv + r * width + h * s.hd;
        for (int64_t i = 0; i < s.hd; ++i) head[i] = static_cast<float>(src[i]);
        float* dst;
        if (h < s.nh) {
          dst = queries + (r * s.nh + h) * s.hd;
        } else {
          const int64_t g = h < s.nh + s.nkv ? h - s.nh : h - s.nh - s.nkv;
          float* cache = h < s.nh + s.nkv ? kc : vc;
          dst = cache + ((slots[b] * s.nkv + g) * s.T + row) * s.hd;
        }
        if (h < s.nh + s.nkv) {
          for (int64_t i = 0; i < half; ++i) dst[i] = head[i] * c[i] + head[i + half] * sn[i];
          for (int64_t i = half; i < s.hd; ++i) dst[i] = head[i] * c[i] + head[i - half] * sn[i];
        } else {
          for (int64_t i = 0; i < s.hd; ++i) dst[i] = head[i];
        }
      }
    }
}

// Attention of every new row: the slot's committed rows, then the new rows its tree-mask row
// allows, visited in ascending order; out [B*q, nh*hd] in bf16 (the next product's input).
void attend(const float* queries, const float* kc, const float* vc, const Shape& s,
            const int64_t* slots, const int64_t* lengths, const bool* tree_mask, bf16* out) {
  const int64_t group = s.nh / s.nkv;
  const float scale = 1.f / std::sqrt(static_cast<float>(s.hd));
  const int64_t tasks = s.B * s.q * s.nh;
  at::parallel_for(0, tasks, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> tree_cols;
    v16 acc[kMaxHeadDim / kLanes];
    float tail[kLanes];
    const int64_t chunks = s.hd / kLanes, rest = s.hd % kLanes;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t % s.nh, r = t / s.nh, b = r / s.q, j = r % s.q;
      const int64_t L = lengths[b];
      tree_cols.clear();
      const bool* allowed = tree_mask + (b * s.q + j) * s.q;
      for (int64_t k = 0; k < s.q; ++k)
        if (allowed[k]) tree_cols.push_back(L + k);
      const int64_t g = h / group, count = L + static_cast<int64_t>(tree_cols.size());
      const float* keys = kc + (slots[b] * s.nkv + g) * s.T * s.hd;
      const float* values = vc + (slots[b] * s.nkv + g) * s.T * s.hd;
      const float* query = queries + (r * s.nh + h) * s.hd;
      auto col = [&](int64_t k) { return k < L ? k : tree_cols[k - L]; };
      scores.resize(count);
      for (int64_t k = 0; k < L; ++k) scores[k] = dot(query, keys + k * s.hd, s.hd) * scale;
      for (int64_t k = L; k < count; ++k) scores[k] = dot(query, keys + col(k) * s.hd, s.hd) * scale;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t k = 0; k < count; ++k) top = std::max(top, scores[k]);
      for (int64_t k = 0; k < count; ++k) scores[k] = fast_exp(scores[k] - top);
      float total = 0.f;
      for (int64_t k = 0; k < count; ++k) total += scores[k];
      for (int64_t c = 0; c < chunks; ++c) acc[c] = v16{0};
      std::fill(tail, tail + kLanes, 0.f);
      for (int64_t k = 0; k < count; ++k) {
        const v16 p = v16{0} + scores[k];
        const float* v = values + col(k) * s.hd;
        for (int64_t c = 0; c < chunks; ++c) acc[c] += p * load16(v + c * kLanes);
        for (int64_t i = 0; i < rest; ++i) tail[i] += scores[k] * v[chunks * kLanes + i];
      }
      bf16* dst = out + (r * s.nh + h) * s.hd;
      const float inv = count ? 1.f / total : 0.f;
      for (int64_t c = 0; c < chunks; ++c)
        for (int64_t i = 0; i < kLanes; ++i) dst[c * kLanes + i] = bf16(acc[c][i] * inv);
      for (int64_t i = 0; i < rest; ++i) dst[chunks * kLanes + i] = bf16(tail[i] * inv);
    }
  });
}

// silu(gate) * up from the fused gate/up product [n, 2*inter], rounded to bf16.
void swiglu_bf16(const bf16* gu, bf16* out, int64_t n, int64_t inter) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < inter; ++i) {
      const float g = static_cast<float>(gu[r * 2 * inter + i]);
      const float u = static_cast<float>(gu[r * 2 * inter + inter + i]);
      out[r * inter + i] = bf16(g / (1.f + fast_exp(-g)) * u);
    }
}

}  // namespace

// x [B*q, d] float32 (the embeddings; updated in place and returned: the residual stream
// after the last layer, before the final norm). layers: per layer, in this order, the
// attention-norm weight, the q/k/v int4 weight and its scales-and-zeros, the output
// projection's pair, the ffn-norm weight, the gate/up pair and the down pair (10 tensors).
// keys/values: the KV cache [L, S, nkv, T, hd] float32, written at each slot's rows
// lengths[b] .. lengths[b] + q - 1. tree_mask [B, q, q] bool: which new rows a new row sees.
at::Tensor decoder_layers(at::Tensor x, const std::vector<at::Tensor>& layers, at::Tensor keys,
                          at::Tensor values, at::Tensor slots, at::Tensor lengths,
                          at::Tensor positions, at::Tensor tree_mask, at::Tensor cos,
                          at::Tensor sin, int64_t num_heads, int64_t num_kv_heads,
                          int64_t intermediate, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [rows, hidden] tensor");
  TORCH_CHECK(keys.dim() == 5 && keys.scalar_type() == at::kFloat && keys.is_contiguous() &&
                  values.sizes() == keys.sizes() && values.scalar_type() == at::kFloat &&
                  values.is_contiguous(),
              "the KV cache must be two contiguous float32 [L, S, kv_heads, T, hd] tensors");
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == 10 * keys.size(0),
              "expected 10 tensors per layer");
  TORCH_CHECK(tree_mask.dim() == 3 && tree_mask.scalar_type() == at::kBool &&
                  tree_mask.is_contiguous(),
              "tree_mask must be a contiguous bool [B, q, q] tensor");
  for (const auto* t : {&slots, &lengths, &positions})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "indices must be int64");
  Shape s{};
  s.B = tree_mask.size(0);
  s.q = tree_mask.size(1);
  s.d = x.size(1);
  s.nh = num_heads;
  s.nkv = num_kv_heads;
  s.hd = keys.size(4);
  s.inter = intermediate;
  s.S = keys.size(1);
  s.T = keys.size(3);
  TORCH_CHECK(x.size(0) == s.B * s.q && positions.numel() == s.B * s.q &&
                  slots.numel() == s.B && lengths.numel() == s.B,
              "rows, positions, slots and lengths disagree with tree_mask [B, q, q]");
  TORCH_CHECK(s.nh % s.nkv == 0 && keys.size(2) == s.nkv, "bad head counts");
  TORCH_CHECK(s.hd <= kMaxHeadDim, "head_dim must be at most 256");
  const int64_t n = s.B * s.q;
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < s.B; ++b)
    TORCH_CHECK(sl[b] >= 0 && sl[b] < s.S && len[b] >= 0 && len[b] + s.q <= s.T,
                "slot or rows out of the cache");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0), "position outside the rotary table");

  auto bf = x.options().dtype(at::kBFloat16);
  at::Tensor h = at::empty({n, s.d}, bf);
  at::Tensor queries = at::empty({n, s.nh, s.hd}, x.options());
  at::Tensor attn = at::empty({n, s.nh * s.hd}, bf);
  at::Tensor act = at::empty({n, s.inter}, bf);
  float* xs = x.data_ptr<float>();
  const int64_t layer_numel = s.S * s.nkv * s.T * s.hd;
  for (int64_t l = 0; l < keys.size(0); ++l) {
    const at::Tensor* w = layers.data() + 10 * l;
    rms_norm_bf16(xs, w[0].data_ptr<float>(), h.data_ptr<bf16>(), n, s.d, eps);
    at::Tensor qkv = int4_mm(h, w[1], w[2]);
    rope_and_store(qkv.data_ptr<bf16>(), s, pos, sl, len, cos.data_ptr<float>(),
                   sin.data_ptr<float>(), queries.data_ptr<float>(),
                   keys.data_ptr<float>() + l * layer_numel,
                   values.data_ptr<float>() + l * layer_numel);
    attend(queries.data_ptr<float>(), keys.data_ptr<float>() + l * layer_numel,
           values.data_ptr<float>() + l * layer_numel, s, sl, len,
           tree_mask.data_ptr<bool>(), attn.data_ptr<bf16>());
    add_bf16(xs, int4_mm(attn, w[3], w[4]).data_ptr<bf16>(), n * s.d);
    rms_norm_bf16(xs, w[5].data_ptr<float>(), h.data_ptr<bf16>(), n, s.d, eps);
    at::Tensor gu = int4_mm(h, w[6], w[7]);
    swiglu_bf16(gu.data_ptr<bf16>(), act.data_ptr<bf16>(), n, s.inter);
    add_bf16(xs, int4_mm(act, w[8], w[9]).data_ptr<bf16>(), n * s.d);
  }
  return x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decoder_layers", &decoder_layers, "the decoder layers of a 4-bit model (CPU)");
}
