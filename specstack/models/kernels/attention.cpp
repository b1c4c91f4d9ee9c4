// Attention summed in one fixed order per query (specstack/models/fixed_attention.py says where it runs):
//   out[b, h, t] = sum_j p_j v[b, h / g, j] / sum_j p_j,  p_j = exp(s_j - max s),  s_j = (q . k_j) / sqrt(D)
// over the keys j the query may see, in increasing slot order.
//
// Why it is shaped so: a query's numbers are the same sequence of fp32 operations whatever else shares
// the call, so a token's attention does not depend on the tokens beside it (a verified tree computes
// what one-token steps compute, batched rows what they compute alone), in fp32, without the float64
// cache that torch's kernels need for that (their sums are blocked by the shapes of the call):
// - a score is one dot product over D: 8 fp32 lanes, each summing its lanes' products in order of D,
//   then one fixed lane reduction; the keys a query may not see are skipped, never multiplied by zero;
// - the softmax's weights are one vectorised exp each (exp8), their sum 8 lanes over the visible keys
//   in slot order then one fixed lane reduction, and each output lane sums over the visible keys in slot
//   order (a query's visible keys sit in slots in the order of their positions: committed tokens, then
//   its ancestors), so the numbers depend on the query's visible keys only;
// - the query heads that share a key/value head and a position are one tile (they see the same keys),
//   so keys and values are read once for the group; tiles are spread over threads, never split;
// - on an AVX-512 CPU the dot products and weighted sums run on 512-bit vectors that are two of those
//   8-lane vectors side by side (two keys, or two column chunks), so the numbers are the 8-lane loops'
//   on every CPU, bit for bit, at half the instructions.
// Built once per machine by specstack/models/native.py with -mavx2 -mfma -fopenmp, contraction off (the
// AVX-512 loops compiled for that target on their own, run where the CPU reports it).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec_math.h"

namespace {

using specstack_vec::exp8;
using specstack_vec::hsum;

constexpr int64_t kLanes = 8;
constexpr int64_t kTile = 8;  // query heads whose accumulators stay in registers together


// R query rows (stride d) against the visible keys from the `first`: their scaled scores (out[r * n + i],
// i over `keys`)
template <int R>
void scores(const float* q, const float* k, int64_t k_stride, const std::vector<int64_t>& keys, int64_t d,
            float scale, float* out, int64_t first = 0) {
  const int64_t n = static_cast<int64_t>(keys.size());
  for (int64_t i = first; i < n; ++i) {
    const float* kj = k + keys[i] * k_stride;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += kLanes) {
      const __m256 kv = _mm256_loadu_ps(kj + c);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * d + c), kv, acc[r]);
    }
    for (int r = 0; r < R; ++r) out[r * n + i] = hsum(acc[r]) * scale;
  }
}

// R rows of weights p (unnormalised, p[r * n + i]) times the visible values, divided by each row's sum
template <int R>
void weighted(const float* p, const float* denom, const float* v, int64_t v_stride, const std::vector<int64_t>& keys,
              int64_t d, float* out, int64_t out_stride) {
  const int64_t n = static_cast<int64_t>(keys.size());
  for (int64_t c = 0; c < d; c += kLanes) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const __m256 vv = _mm256_loadu_ps(v + keys[i] * v_stride + c);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(p[r * n + i]), vv, acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * out_stride + c, _mm256_div_ps(acc[r], _mm256_set1_ps(denom[r])));
  }
}


// The same two loops on AVX-512, the same numbers: a 512-bit vector holds two 8-lane vectors of the loops
// above side by side, each half doing exactly what one 8-lane vector did there, so every score and output
// lane is the same sequence of fp32 operations (tested bit for bit against the 8-lane loops). Half the
// instructions, and twice the registers for independent chains.
#define WIDE_FN __attribute__((target("avx512f,avx512dq")))

WIDE_FN inline __m512 pair(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}

// scores<R>, two keys a vector (lanes 0-7 key i's 8-lane sums, 8-15 key i + n / 2's: two sequential
// streams through the keys, which the hardware prefetchers follow; adjacent keys side by side read a
// long head's rows cold from memory at a third less speed); q2 holds each query row doubled per 8 columns
// ([q[c..c+8) | q[c..c+8)], stride 2 d)
template <int R>
WIDE_FN void scores_wide(const float* q, const float* q2, const float* k, int64_t k_stride,
                         const std::vector<int64_t>& keys, int64_t d, float scale, float* out) {
  const int64_t n = static_cast<int64_t>(keys.size()), half = n / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float* k0 = k + keys[i] * k_stride;
    const float* k1 = k + keys[i + half] * k_stride;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += kLanes) {
      const __m512 kv = pair(k0 + c, k1 + c);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q2 + r * 2 * d + 2 * c), kv, acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      out[r * n + i] = hsum(_mm512_castps512_ps256(acc[r])) * scale;
      out[r * n + i + half] = hsum(_mm512_extractf32x8_ps(acc[r], 1)) * scale;
    }
  }
  if (n % 2) scores<R>(q, k, k_stride, keys, d, scale, out, n - 1);  // an odd key count: the last key 8-lane
}

// weighted<R>, 16 columns a vector (the 8-lane loop's chunks c and c + 8 side by side)
template <int R>
WIDE_FN void weighted_wide(const float* p, const float* denom, const float* v, int64_t v_stride,
                           const std::vector<int64_t>& keys, int64_t d, float* out, int64_t out_stride) {
  const int64_t n = static_cast<int64_t>(keys.size());
  int64_t c = 0;
  for (; c + 2 * kLanes <= d; c += 2 * kLanes) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const __m512 vv = _mm512_loadu_ps(v + keys[i] * v_stride + c);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * n + i]), vv, acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * out_stride + c, _mm512_div_ps(acc[r], _mm512_set1_ps(denom[r])));
  }
  if (c < d)  // d an odd multiple of 8: the last chunk through the 8-lane loop
    weighted<R>(p, denom, v + c, v_stride, keys, d - c, out + c, out_stride);
}

// Whether `fixed` runs the AVX-512 loops: where the CPU has them, unless the `set_wide` op turned them off
// (the tests compare both on one machine, benchmarks time both)
bool& wide_wanted() {
  static bool on = true;
  return on;
}

bool wide_here() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return has && wide_wanted();
}

bool set_wide(bool on) { return std::exchange(wide_wanted(), on); }

// A query row's softmax weights in place: p[i] = exp(p[i] - max p) over its n scores; returns their sum
// (8 lanes, each summing its keys in order, then the lanes in one fixed order). Every key goes through
// the same vector operations (the last partial vector padded with -inf, whose exp is 0), so a query's
// weights depend on its own scores only.
inline float softmax_weights(float* p, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) top = std::max(top, p[i]);
  const __m256 shift = _mm256_set1_ps(top);
  __m256 sum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 w = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), shift));
    _mm256_storeu_ps(p + i, w);
    sum = _mm256_add_ps(sum, w);
  }
  if (i < n) {
    alignas(32) float tail[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) tail[j] = i + j < n ? p[i + j] : -std::numeric_limits<float>::infinity();
    const __m256 w = exp8(_mm256_sub_ps(_mm256_load_ps(tail), shift));
    _mm256_store_ps(tail, w);
    for (int64_t j = 0; i + j < n; ++j) p[i + j] = tail[j];
    sum = _mm256_add_ps(sum, w);
  }
  return hsum(sum);
}

// f(std::integral_constant<int, R>) for R = rows (1 <= rows <= Most)
template <int Most, class F>
inline void by_rows(int64_t rows, const F& f) {
  if constexpr (Most > 1) {
    if (rows < Most) return by_rows<Most - 1>(rows, f);
  }
  f(std::integral_constant<int, Most>{});
}

at::Tensor fixed(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                 bool causal) {
  TORCH_CHECK(q_in.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention: q, k, v must be 4-D [B, H, T, D]");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "attention: q, k, v must be float32");
  const int64_t b = q_in.size(0), h = q_in.size(1), t = q_in.size(2), d = q_in.size(3);
  const int64_t hkv = k.size(1), s = k.size(2);
  TORCH_CHECK(k.size(0) == b && v.size(0) == b && v.size(1) == hkv && v.size(2) == s && k.size(3) == d &&
                  v.size(3) == d && hkv > 0 && h % hkv == 0, "attention: k and v do not fit q");
  TORCH_CHECK(d % kLanes == 0 && d <= 256, "attention: the head dimension must be a multiple of 8, at most 256");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "attention: k and v must be contiguous in their last dimension");
  const at::Tensor q = q_in.contiguous();
  const bool* mp = nullptr;
  int64_t msb = 0, mst = 0, mss = 0;
  at::Tensor m;
  if (mask.has_value()) {
    m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(0) == b && m.size(1) == 1 && m.size(2) == t &&
                    m.size(3) == s, "attention: the mask must be bool [B, 1, T, S]");
    mp = m.data_ptr<bool>();
    msb = m.stride(0), mst = m.stride(2), mss = m.stride(3);
  }
  at::Tensor out = at::empty({b, h, t, d}, q.options());
  const int64_t g = h / hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool wide = wide_here();
  // one task: a row, a key/value head and a position (the g query heads that share them)
  at::parallel_for(0, b * hkv * t, 1, [&](int64_t first, int64_t last) {
    thread_local std::vector<int64_t> keys;  // reused across calls: no allocations a decode step
    thread_local std::vector<float> p;
    for (int64_t task = first; task < last; ++task) {
      const int64_t bi = task / (hkv * t), kh = task / t % hkv, ti = task % t;
      keys.clear();
      for (int64_t j = 0; j < s; ++j) {
        const bool seen = mp != nullptr ? mp[bi * msb + ti * mst + j * mss] : (!causal || j <= ti);
        if (seen) keys.push_back(j);
      }
      const int64_t n = static_cast<int64_t>(keys.size());
      const float* kb = kp + bi * k.stride(0) + kh * k.stride(1);
      const float* vb = vp + bi * v.stride(0) + kh * v.stride(1);
      for (int64_t h0 = 0; h0 < g; h0 += kTile) {
        const int64_t rows = std::min(kTile, g - h0);
        const int64_t head = kh * g + h0;
        const float* qr = qp + ((bi * h + head) * t + ti) * d;  // rows of consecutive heads: stride t * d
        float* orow = op + ((bi * h + head) * t + ti) * d;
        p.assign(static_cast<size_t>(rows * n), 0.f);
        float denom[kTile];
        // the tile's queries gathered (their heads are t * d apart), and doubled for the wide loops
        float qt[kTile * 256];
        alignas(64) float q2[kTile * 512];
        for (int64_t r = 0; r < rows; ++r) std::copy(qr + r * t * d, qr + r * t * d + d, qt + r * d);
        if (wide)
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < d; c += kLanes) {
              std::copy(qt + r * d + c, qt + r * d + c + kLanes, q2 + r * 2 * d + 2 * c);
              std::copy(qt + r * d + c, qt + r * d + c + kLanes, q2 + r * 2 * d + 2 * c + kLanes);
            }
        by_rows<kTile>(rows, [&](auto rt) {
          constexpr int R = decltype(rt)::value;
          if (wide) scores_wide<R>(qt, q2, kb, k.stride(2), keys, d, scale, p.data());
          else scores<R>(qt, kb, k.stride(2), keys, d, scale, p.data());
          for (int r = 0; r < R; ++r) {
            const float sum = softmax_weights(p.data() + r * n, n);
            denom[r] = sum > 0.f ? sum : 1.f;  // no visible key: zeros out
          }
          if (wide) weighted_wide<R>(p.data(), denom, vb, v.stride(2), keys, d, orow, t * d);
          else weighted<R>(p.data(), denom, vb, v.stride(2), keys, d, orow, t * d);
        });
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(specstack_attention, lib) {
  lib.def("fixed(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal) -> Tensor");
  lib.def("set_wide(bool on) -> bool", &set_wide);
}

TORCH_LIBRARY_IMPL(specstack_attention, CPU, lib) { lib.impl("fixed", &fixed); }
