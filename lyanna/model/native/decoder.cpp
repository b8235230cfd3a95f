// Llama-family decoder layers in one call (CPU): the target's 4-bit layers, and the drafters'.
//
// Why: a q4 decode step spent about half of its time in ~1,500 small eager ops around the
// int4 products (casts, RMSNorm, RoPE, KV writes, float64 attention). Here the products stay
// torch's kernels (the int4 kernel, or oneDNN for a prepacked dense weight) and everything
// between them is a plain loop over rows.
//
// Batch invariance (what makes speculation lossless on this path): every loop computes a row
// from that row alone in a fixed order, and attention visits exactly the key rows a query may
// see, in ascending order, whatever else shares the forward. A token's hidden state is thus
// the same bitwise whether it runs alone (decoding) or inside a token tree (verification),
// without the float64 attention the eager path needs for that.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "block_matmul.h"
#include "vector_math.h"

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kGroup = 32;  // GGUF block size = the int4 kernel's group size
constexpr int64_t kMaxBlockQueries = 6;  // queries per attention task (at most)

using namespace vec;  // vector_math.h

// RMSNorm of each row of x [n, d] times w.
void rms_norm(const float* x, const float* w, float* out, int64_t n, int64_t d, float eps) {
  for (int64_t r = 0; r < n; ++r) {
    const float* row = x + r * d;
    const float inv = 1.f / std::sqrt(dot(row, row, d) / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) out[r * d + i] = row[i] * inv * w[i];
  }
}

void add(float* x, const std::vector<float>& y) {
  for (size_t i = 0; i < y.size(); ++i) x[i] += y[i];
}

// oneDNN's product with a weight prepacked by torch.ops.mkldnn._reorder_linear_weight (what
// lyanna.model.cpu_kernels.PackedLinear calls from Python).
at::Tensor linear_pointwise(const at::Tensor& x, const at::Tensor& weight) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x,
                          weight,
                          c10::IValue(),
                          c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// Weights in block_matmul.h's layouts: int32 lanes of 4-bit codes [N/16, K/32, 4, 16], or int8
// pairs [N/16, K/32, 16, 16, 2] (Q8_0), with fp16 scales [N/16, K/32, 2, 16].
bool is_block_weight(const at::Tensor& w) {
  return w.scalar_type() == at::kInt || w.scalar_type() == at::kChar;
}

void block_product(const float* x, int64_t M, int64_t K, const at::Tensor& packed,
                   const at::Tensor& scales, float* y, bool int8_rows) {
  const bool q8 = packed.scalar_type() == at::kChar;
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == (q8 ? 5 : 4) &&
                  packed.size(2) == (q8 ? blocks::kBlock / 2 : blocks::kChunks) &&
                  packed.size(3) == blocks::kTile && (!q8 || packed.size(4) == 2),
              "packed must be contiguous int32 [out/16, in/32, 4, 16] or int8 "
              "[out/16, in/32, 16, 16, 2]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({packed.size(0), packed.size(1), 2, blocks::kTile}),
              "scales must be a contiguous float16 [out/16, in/32, 2, 16] tensor");
  TORCH_CHECK(packed.size(1) * blocks::kBlock == K, "the weight takes ", packed.size(1) * blocks::kBlock,
              " inputs, x has ", K);
  const auto* codes = static_cast<const uint8_t*>(packed.data_ptr());
  const auto* s = scales.data_ptr<c10::Half>();
  const int64_t N = packed.size(0) * blocks::kTile;
  if (q8)
    blocks::matmul<8>(x, M, K, codes, s, N, y);
  else
    blocks::matmul<4>(x, M, K, codes, s, N, y, int8_rows);
}

// One projection: y [M, N] = x [M, K] W^T. lin points at two tensors: torch's int4 pack and its
// scales-and-zeros (inputs rounded to bf16, the kernel's fast path), or a oneDNN-prepacked
// dense weight and an empty tensor (inputs in the weight's dtype).
void product(const at::Tensor* lin, const float* x, int64_t M, int64_t K, std::vector<float>& y,
             bool int8_rows) {
  if (is_block_weight(lin[0])) {  // block_matmul.h's layouts
    const int64_t N = lin[0].size(0) * blocks::kTile;
    y.resize(M * N);
    block_product(x, M, K, lin[0], lin[1], y.data(), int8_rows);
    return;
  }
  const bool int4 = lin[1].numel() > 0;
  const auto dtype = int4 ? at::kBFloat16 : lin[0].scalar_type();
  at::Tensor input;
  if (dtype == at::kFloat) {
    input = at::from_blob(const_cast<float*>(x), {M, K}, at::TensorOptions().dtype(at::kFloat));
  } else {
    TORCH_CHECK(dtype == at::kBFloat16, "products run in float32 or bf16");
    input = at::empty({M, K}, at::TensorOptions().dtype(at::kBFloat16));
    bf16* in = input.data_ptr<bf16>();
    for (int64_t i = 0; i < M * K; ++i) in[i] = bf16(x[i]);
  }
  at::Tensor out = int4 ? at::_weight_int4pack_mm_for_cpu(input, lin[0], kGroup, lin[1])
                        : linear_pointwise(input, lin[0]);
  out = out.contiguous();
  y.resize(out.numel());
  if (out.scalar_type() == at::kFloat) {
    std::memcpy(y.data(), out.data_ptr<float>(), y.size() * sizeof(float));
  } else {
    const bf16* o = out.data_ptr<bf16>();
    for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<float>(o[i]);
  }
}

struct Shape {
  int64_t B, q, nh, nkv, hd, S, T;
};

// Where each new row (b, j) writes its key and value (write_rows[b, j]) and what it sees: the
// first lengths[b] rows of its slot, then row lengths[b] + k wherever mask[b, j, k].
struct Rows {
  const int64_t* slots;       // [B]
  const int64_t* lengths;     // [B]
  const bool* mask;           // [B, q, width]
  int64_t width;
  const int64_t* write_rows;  // [B, q]
  const float* cos;           // [B*q, hd] rotary tables at each row's position
  const float* sin;           // (sin signed as in lyanna.model.transformer.rope_tables)
};

// One head's row rotated (Hugging Face rotate-half layout), each element rounded to the
// destination's type once.
template <class T>
void rope_row(const float* src, const float* c, const float* sn, int64_t hd, T* dst) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) dst[i] = static_cast<T>(src[i] * c[i] + src[i + half] * sn[i]);
  for (int64_t i = half; i < hd; ++i) dst[i] = static_cast<T>(src[i] * c[i] + src[i - half] * sn[i]);
}

// RoPE on queries and keys (Hugging Face rotate-half layout); queries go to `queries`
// [B*q, nh, hd], keys and values to the cache.
template <class KV>
void rope_and_store(const float* qkv, const Shape& s, const Rows& rows, float* queries, KV* kc,
                    KV* vc) {
  const int64_t width = (s.nh + 2 * s.nkv) * s.hd;
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t j = 0; j < s.q; ++j) {
      const int64_t r = b * s.q + j, row = rows.write_rows[r];
      const float *c = rows.cos + r * s.hd, *sn = rows.sin + r * s.hd;
      for (int64_t h = 0; h < s.nh + 2 * s.nkv; ++h) {
        const float* src = qkv + r * width + h * s.hd;
        if (h < s.nh) {
          rope_row(src, c, sn, s.hd, queries + (r * s.nh + h) * s.hd);
          continue;
        }
        const int64_t g = h < s.nh + s.nkv ? h - s.nh : h - s.nh - s.nkv;
        KV* dst = (h < s.nh + s.nkv ? kc : vc) + ((rows.slots[b] * s.nkv + g) * s.T + row) * s.hd;
        if (h < s.nh + s.nkv) {
          rope_row(src, c, sn, s.hd, dst);  // a float16 cache rounds each element once
        } else {
          for (int64_t i = 0; i < s.hd; ++i) dst[i] = static_cast<KV>(src[i]);
        }
      }
    }
}

// The columns new row r (of sequence b) sees beyond the first lengths[b] cached rows: lengths[b]
// + k wherever mask[r, k], ascending.
inline void tree_columns(const Rows& rows, int64_t b, int64_t r, std::vector<int64_t>& cols) {
  cols.clear();
  const bool* seen = rows.mask + r * rows.width;
  for (int64_t k = 0; k < rows.width; ++k)
    if (seen[k]) cols.push_back(rows.lengths[b] + k);
}

// One query's attention over the rows it sees (the first L of its slot, then `tree`) into
// dst; scores: scratch of at least L + tree.size() floats, cols: scratch.
template <class KV>
void finish_query(const float* query, const KV* keys, const KV* values, int64_t L,
                  const std::vector<int64_t>& tree, int64_t hd, float scale, float* scores,
                  std::vector<int64_t>& cols, float* dst) {
  const int64_t count = L + static_cast<int64_t>(tree.size()), chunks = hd / kLanes;
  const bool fixed = hd % kLanes == 0 && (chunks == 2 || chunks == 4 || chunks == 8);
  cols.resize(L);
  for (int64_t k = 0; k < L; ++k) cols[k] = k;
  cols.insert(cols.end(), tree.begin(), tree.end());
  if (fixed && chunks == 4)
    fixed_scores<4>(query, keys, cols.data(), count, scale, scores);
  else if (fixed && chunks == 8)
    fixed_scores<8>(query, keys, cols.data(), count, scale, scores);
  else if (fixed)
    fixed_scores<2>(query, keys, cols.data(), count, scale, scores);
  else
    for (int64_t k = 0; k < count; ++k) scores[k] = dot(query, keys + cols[k] * hd, hd) * scale;
  const float inv = softmax_weights(scores, count);
  if (fixed) {
    if (chunks == 4)
      fixed_values<4>(values, cols.data(), scores, count, inv, dst);
    else if (chunks == 8)
      fixed_values<8>(values, cols.data(), scores, count, inv, dst);
    else
      fixed_values<2>(values, cols.data(), scores, count, inv, dst);
    return;
  }
  const int64_t rest = hd % kLanes;
  v16 acc[kMaxHeadDim / kLanes];
  float tail[kLanes];
  for (int64_t c = 0; c < chunks; ++c) acc[c] = v16{0};
  std::fill(tail, tail + kLanes, 0.f);
  for (int64_t k = 0; k < count; ++k) {
    const v16 p = v16{0} + scores[k];
    const KV* v = values + cols[k] * hd;
    for (int64_t c = 0; c < chunks; ++c) acc[c] += p * load16(v + c * kLanes);
    for (int64_t i = 0; i < rest; ++i) tail[i] += scores[k] * static_cast<float>(v[chunks * kLanes + i]);
  }
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t i = 0; i < kLanes; ++i) dst[c * kLanes + i] = acc[c][i] * inv;
  for (int64_t i = 0; i < rest; ++i) dst[chunks * kLanes + i] = tail[i] * inv;
}

#ifdef LYANNA_GROUPED_ATTENTION
static_assert(kMaxBlock <= kMaxBlockQueries, "an attention task holds at most kMaxBlockQueries");

// A block of queries that share a KV head and a sequence: the cached rows by block_scores /
// block_values (each row loaded once for the block), each query's tree rows after them.
template <int C, int NQ, class KV>
void grouped_block(const float* const* query, float* const* dst, const KV* keys,
                   const KV* values, int64_t L, const std::vector<int64_t>* const* tree,
                   float scale, std::vector<float>& scratch) {
  int64_t longest = 0;
  for (int i = 0; i < NQ; ++i) longest = std::max<int64_t>(longest, tree[i]->size());
  // each query's scores: its L cached rows (block_scores writes up to kLanes - 1 past them),
  // then its tree rows
  const int64_t stride = L + std::max<int64_t>(kLanes, longest);
  scratch.resize(NQ * (stride + kLanes * kLanes + C * kLanes));
  float* scores[NQ];
  float* acc[NQ];
  float* partial = scratch.data() + NQ * stride;
  for (int i = 0; i < NQ; ++i) {
    scores[i] = scratch.data() + i * stride;
    acc[i] = partial + NQ * kLanes * kLanes + i * C * kLanes;
  }
  block_scores<C, NQ>(query, keys, L, scale, scores, partial);
  float inv[NQ];
  for (int i = 0; i < NQ; ++i) {
    const std::vector<int64_t>& cols = *tree[i];
    const int64_t m = static_cast<int64_t>(cols.size());
    if (m) fixed_scores_generic<C>(query[i], keys, cols.data(), m, scale, scores[i] + L);
    inv[i] = softmax_weights(scores[i], L + m);
  }
  block_values<C, NQ>(values, L, scores, acc);
  for (int i = 0; i < NQ; ++i) {
    v16 a[C];
    for (int c = 0; c < C; ++c) a[c] = load16(acc[i] + c * kLanes);
    const std::vector<int64_t>& cols = *tree[i];
    for (size_t k = 0; k < cols.size(); ++k) {
      const v16 p = v16{0} + scores[i][L + k];
      const KV* v = values + cols[k] * C * kLanes;
      for (int c = 0; c < C; ++c) a[c] += p * load16(v + c * kLanes);
    }
    for (int c = 0; c < C; ++c)
      for (int64_t l = 0; l < kLanes; ++l) dst[i][c * kLanes + l] = a[c][l] * inv[i];
  }
}

template <int C, int NQ = kMaxBlock, class KV>
void grouped_dispatch(int nq, const float* const* query, float* const* dst, const KV* keys,
                      const KV* values, int64_t L, const std::vector<int64_t>* const* tree,
                      float scale, std::vector<float>& scratch) {
  if constexpr (NQ > 1) {
    if (nq < NQ)
      return grouped_dispatch<C, NQ - 1>(nq, query, dst, keys, values, L, tree, scale, scratch);
  }
  grouped_block<C, NQ>(query, dst, keys, values, L, tree, scale, scratch);
}
#endif

// Attention of every new row over exactly the rows it sees, in ascending order; out
// [B*q, nh*hd]. Keys and values are float32 or float16 (read as float32: exactly). Work is
// split into tasks of up to `block` queries of one sequence and one KV head (its heads for
// every new row: they all see the sequence's cached rows); each query's arithmetic is the
// same whatever its task, so a row's result does not depend on what shares the forward.
template <class KV>
void attend(const float* queries, const KV* kc, const KV* vc, const Shape& s, const Rows& rows,
            float* out) {
  const int64_t group = s.nh / s.nkv, per_kv = s.q * group;
  const float scale = 1.f / std::sqrt(static_cast<float>(s.hd));
  const int64_t chunks = s.hd / kLanes;
  int64_t block = 1;
#ifdef LYANNA_GROUPED_ATTENTION
  const bool grouped = s.hd % kLanes == 0 && (chunks == 2 || chunks == 4 || chunks == 8);
  if (grouped) {  // at least two tasks per thread where the queries allow
    const int64_t most = std::min<int64_t>(kMaxBlock, 24 / chunks);
    const int64_t spread = s.B * s.nkv * per_kv / (2 * at::get_num_threads());
    block = std::max<int64_t>(1, std::min({most, spread, per_kv}));
  }
#endif
  const int64_t blocks_per_kv = (per_kv + block - 1) / block;
  at::parallel_for(0, s.B * s.nkv * blocks_per_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    std::vector<int64_t> cols;
    std::vector<int64_t> trees[kMaxBlockQueries];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / (s.nkv * blocks_per_kv), g = (t / blocks_per_kv) % s.nkv;
      const int64_t first = (t % blocks_per_kv) * block, nq = std::min(block, per_kv - first);
      const int64_t L = rows.lengths[b];
      const KV* keys = kc + (rows.slots[b] * s.nkv + g) * s.T * s.hd;
      const KV* values = vc + (rows.slots[b] * s.nkv + g) * s.T * s.hd;
      const float* query[kMaxBlockQueries];
      float* dst[kMaxBlockQueries];
      const std::vector<int64_t>* tree[kMaxBlockQueries];
      for (int64_t i = 0; i < nq; ++i) {  // query first + i: new row j, head g * group + i % group
        const int64_t j = (first + i) / group, h = g * group + (first + i) % group;
        const int64_t r = b * s.q + j;
        tree_columns(rows, b, r, trees[i]);
        tree[i] = &trees[i];
        query[i] = queries + (r * s.nh + h) * s.hd;
        dst[i] = out + (r * s.nh + h) * s.hd;
      }
#ifdef LYANNA_GROUPED_ATTENTION
      if (grouped) {
        auto run = [&](auto c) {
          grouped_dispatch<decltype(c)::value>(static_cast<int>(nq), query, dst, keys, values, L,
                                               tree, scale, scratch);
        };
        if (chunks == 2) run(std::integral_constant<int, 2>{});
        else if (chunks == 4) run(std::integral_constant<int, 4>{});
        else run(std::integral_constant<int, 8>{});
        continue;
      }
#endif
      for (int64_t i = 0; i < nq; ++i) {
        scratch.resize(L + trees[i].size() + kLanes);
        finish_query(query[i], keys, values, L, trees[i], s.hd, scale, scratch.data(), cols, dst[i]);
      }
    }
  });
}

// A fresh prompt alone (B = 1, nothing cached before it: its prefill): torch's blocked causal
// attention over its own rows, which ``attend`` (one query row at a time, for any mask) ran
// at a fraction of the speed once a prompt reaches hundreds of tokens. Not bitwise equal to
// ``attend``, so only the prefill takes it, and a prompt prefills the same way whether it is
// then decoded plainly or speculatively.
template <class KV>
void prompt_attention(const float* queries, const KV* kc, const KV* vc, const Shape& s,
                      int64_t slot, float* out) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const auto kv_type = at::TensorOptions().dtype(c10::CppTypeToScalarType<KV>::value);
  const int64_t head_stride = s.T * s.hd;  // the cache is [S, nkv, T, hd] per layer
  const std::vector<int64_t> kv_sizes{1, s.nkv, s.q, s.hd};
  const std::vector<int64_t> kv_strides{s.nkv * head_stride, head_stride, s.hd, 1};
  const KV* k = kc + slot * s.nkv * head_stride;
  const KV* v = vc + slot * s.nkv * head_stride;
  at::Tensor query = at::from_blob(const_cast<float*>(queries), {1, s.q, s.nh, s.hd}, f32);
  // a float16 cache: the prompt's rows as float32 (exactly), for the float32 kernel
  at::Tensor keys = at::from_blob(const_cast<KV*>(k), kv_sizes, kv_strides, kv_type).to(at::kFloat);
  at::Tensor values = at::from_blob(const_cast<KV*>(v), kv_sizes, kv_strides, kv_type).to(at::kFloat);
  at::Tensor attn = at::scaled_dot_product_attention(
      query.transpose(1, 2), keys, values, {}, 0.0,
      /*is_causal=*/true, std::nullopt, /*enable_gqa=*/s.nh != s.nkv);  // [1, nh, q, hd]
  at::from_blob(out, {1, s.q, s.nh, s.hd}, f32).copy_(attn.transpose(1, 2));
}

// silu(gate) * up from the fused gate/up product [n, 2*inter].
void swiglu(const std::vector<float>& gu, std::vector<float>& out, int64_t n, int64_t inter) {
  out.resize(n * inter);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < inter; ++i) {
      const float g = gu[r * 2 * inter + i], u = gu[r * 2 * inter + inter + i];
      out[r * inter + i] = g / (1.f + fast_exp(-g)) * u;
    }
}

void check_int64(const at::Tensor& t, int64_t numel, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.numel() == numel, name,
              " must be a contiguous int64 tensor of ", numel, " elements");
}

}  // namespace

constexpr int64_t kPerLayer = 10;  // 2 norm weights + 4 projections x 2 tensors

// x [B*q, d] float32 (the layers' input; updated in place and returned: the residual stream
// after the last layer, before any final norm). layers: per layer, in this order, the
// attention-norm weight, the q/k/v projection, the output projection, the ffn-norm weight,
// the gate/up projection and the down projection (2 tensors each, see ``product``).
// keys/values: the KV cache [L, S, nkv, T, hd] float32 or float16 (``Transformer.kv_dtype``)
// of exactly these layers. slots [B], lengths [B], mask [B, q, width] bool, write_rows [B, q]:
// see ``Rows``; cos/sin [B*q, hd].
// prompt: the rows are a fresh prompt's prefill (one sequence, nothing cached, causal mask,
// written to rows 0..q-1): its attention may run as ``prompt_attention``.
// int8_rows: the 4-bit products quantize their inputs to int8 (block_matmul.h, llama.cpp's
// activations) instead of int16.
at::Tensor decoder_layers(at::Tensor x, const std::vector<at::Tensor>& layers, at::Tensor keys,
                          at::Tensor values, at::Tensor slots, at::Tensor lengths,
                          at::Tensor mask, at::Tensor write_rows, at::Tensor cos,
                          at::Tensor sin, int64_t num_heads, int64_t num_kv_heads, double eps,
                          bool prompt, bool int8_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [rows, hidden] tensor");
  const bool half_kv = keys.scalar_type() == at::kHalf;
  TORCH_CHECK(keys.dim() == 5 && (half_kv || keys.scalar_type() == at::kFloat) &&
                  keys.is_contiguous() && values.sizes() == keys.sizes() &&
                  values.scalar_type() == keys.scalar_type() && values.is_contiguous(),
              "the KV cache must be two contiguous float32 or float16 [L, S, kv_heads, T, hd] "
              "tensors");
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == kPerLayer * keys.size(0),
              "expected 10 tensors per layer of the cache");
  TORCH_CHECK(mask.dim() == 3 && mask.scalar_type() == at::kBool && mask.is_contiguous(),
              "mask must be a contiguous bool [B, q, width] tensor");
  Shape s{};
  s.B = mask.size(0);
  s.q = mask.size(1);
  s.nh = num_heads;
  s.nkv = num_kv_heads;
  s.hd = keys.size(4);
  s.S = keys.size(1);
  s.T = keys.size(3);
  const int64_t n = s.B * s.q, d = x.size(1);
  TORCH_CHECK(x.size(0) == n, "x has ", x.size(0), " rows, mask says ", n);
  TORCH_CHECK(s.nh % s.nkv == 0 && keys.size(2) == s.nkv, "bad head counts");
  TORCH_CHECK(s.hd <= kMaxHeadDim, "head_dim must be at most 256");
  check_int64(slots, s.B, "slots");
  check_int64(lengths, s.B, "lengths");
  check_int64(write_rows, n, "write_rows");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == n && t->size(1) == s.hd,
                "the rotary tables must be contiguous float32 [B*q, head_dim]");
  Rows rows{slots.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), mask.data_ptr<bool>(),
            mask.size(2), write_rows.data_ptr<int64_t>(), cos.data_ptr<float>(),
            sin.data_ptr<float>()};
  for (int64_t b = 0; b < s.B; ++b) {
    TORCH_CHECK(rows.slots[b] >= 0 && rows.slots[b] < s.S, "slot out of the cache");
    TORCH_CHECK(rows.lengths[b] >= 0 && rows.lengths[b] + rows.width <= s.T,
                "visible rows out of the cache");
    for (int64_t j = 0; j < s.q; ++j) {
      const int64_t row = rows.write_rows[b * s.q + j];
      TORCH_CHECK(row >= 0 && row < s.T, "write row out of the cache");
    }
  }

  if (prompt) {
    TORCH_CHECK(s.B == 1 && rows.lengths[0] == 0 && rows.width == s.q,
                "a prompt's prefill is one sequence with nothing cached");
    for (int64_t j = 0; j < s.q; ++j)
      TORCH_CHECK(rows.write_rows[j] == j, "a prompt's rows are written from row 0");
  }
  const int64_t inner = s.nh * s.hd;
  std::vector<float> h(n * d), qkv, queries(n * inner), attn(n * inner), out, gu, act;
  float* xs = x.data_ptr<float>();
  const int64_t layer_numel = s.S * s.nkv * s.T * s.hd;
  for (int64_t l = 0; l < keys.size(0); ++l) {
    const at::Tensor* w = layers.data() + kPerLayer * l;
    rms_norm(xs, w[0].data_ptr<float>(), h.data(), n, d, eps);
    product(w + 1, h.data(), n, d, qkv, int8_rows);
    TORCH_CHECK(static_cast<int64_t>(qkv.size()) == n * (s.nh + 2 * s.nkv) * s.hd,
                "the q/k/v projection does not match the head counts");
    auto attention = [&](auto* kc, auto* vc) {
      rope_and_store(qkv.data(), s, rows, queries.data(), kc, vc);
      if (prompt)
        prompt_attention(queries.data(), kc, vc, s, rows.slots[0], attn.data());
      else
        attend(queries.data(), kc, vc, s, rows, attn.data());
    };
    if (half_kv)
      attention(static_cast<c10::Half*>(keys.data_ptr()) + l * layer_numel,
                static_cast<c10::Half*>(values.data_ptr()) + l * layer_numel);
    else
      attention(keys.data_ptr<float>() + l * layer_numel,
                values.data_ptr<float>() + l * layer_numel);
    product(w + 3, attn.data(), n, inner, out, int8_rows);
    add(xs, out);
    rms_norm(xs, w[5].data_ptr<float>(), h.data(), n, d, eps);
    product(w + 6, h.data(), n, d, gu, int8_rows);
    const int64_t inter = static_cast<int64_t>(gu.size()) / (2 * n);
    swiglu(gu, act, n, inter);
    product(w + 8, act.data(), n, inter, out, int8_rows);
    add(xs, out);
  }
  return x;
}

// x [M, K] float32 times a weight packed by lyanna.model.quant.pack_q4 or pack_q8.
at::Tensor block_linear(at::Tensor x, at::Tensor packed, at::Tensor scales, bool int8_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [rows, in] tensor");
  TORCH_CHECK(is_block_weight(packed), "packed must be int32 (4-bit) or int8 (8-bit) codes");
  at::Tensor y = at::empty({x.size(0), packed.size(0) * blocks::kTile}, x.options());
  TORCH_CHECK(!int8_rows || packed.scalar_type() == at::kInt, "int8 rows take 4-bit weights only");
  block_product(x.data_ptr<float>(), x.size(0), x.size(1), packed, scales, y.data_ptr<float>(),
                int8_rows);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decoder_layers", &decoder_layers, "Llama-family decoder layers (CPU)");
  m.def("block_linear", &block_linear, "x W^T for a 4- or 8-bit weight in block_matmul.h's layouts",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("scales"),
        pybind11::arg("int8_rows") = false);
}
