// The w4a8 matmuls (specstack/models/w4a8.py has the format's definition and its reference):
//   y[r, n] = sum_g  (d[n, g] * dx[r, g]) * sum_{k in g} c[n, k] q[r, k]   +   m[n, g] * sx[r, g]
// q: the activations rounded to 8 bits per row and per group of 32 inputs, q = nearbyint(x * (127 / amax)),
// dx = amax / 127, sx = dx * sum(q). Two kinds of weight groups:
// - 4-bit (mm4): codes c in 0..15 with w = d * c + m (GGUF Q4_0/Q4_1/Q4_K), 16 bytes a group;
// - 8-bit (mm8): codes c in -127..127 with w = d * c and no m (GGUF Q8_0's layout), 32 bytes a group:
//   the layers a Q4_K_M file keeps in more than 4 bits (Q6_K), and the unembedding.
//
// Why it is shaped so:
// - each weight group is read (and unpacked) once for all the rows of the call: the rows share the
//   load, only the integer products are per row;
// - a row's output is computed by the same sequence of operations whatever other rows share the call
//   (its accumulator is its own, its groups are visited in order), so a row's numbers never depend on
//   its neighbours: the batch invariance speculation needs to be exact in this format;
// - vpmaddubsw multiplies unsigned by signed bytes: 4-bit codes are unsigned already; 8-bit ones go
//   in as |c| with q carrying c's sign (llama.cpp's trick). Pair sums stay below 2 * 127 * 127 < 2^15.
// Built once per machine by specstack/models/native.py with -mavx2 -mfma -fopenmp, contraction off.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowTile = 8;   // rows whose accumulators stay in registers together
constexpr int64_t kRowBlock = 16;  // rows whose codes stay in cache while a chunk of outputs is swept

void quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* q, float* dx, float* sx) {
  const int64_t groups = k / kGroup;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xb = x + r * k + g * kGroup;
      float amax = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* qb = q + r * k + g * kGroup;
      int32_t sum = 0;
      for (int64_t i = 0; i < kGroup; ++i) {
        const float v = std::fmin(127.f, std::fmax(-127.f, std::nearbyint(xb[i] * inv)));
        qb[i] = static_cast<int8_t>(v);
        sum += static_cast<int32_t>(v);
      }
      const float d = amax / 127.f;
      dx[r * groups + g] = d;
      sx[r * groups + g] = d * static_cast<float>(sum);
    }
  }
}

// 4-bit groups: 16 bytes -> 32 codes; byte j holds code j (low nibble) and code j + 16 (high nibble)
struct Q4 {
  static constexpr int64_t kBytes = kGroup / 2;
  static inline __m256i load(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i low = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
  }
  static inline __m256i products(__m256i w, __m256i a) { return _mm256_maddubs_epi16(w, a); }
};

// 8-bit groups: 32 signed codes; |c| times q with c's sign
struct Q8 {
  static constexpr int64_t kBytes = kGroup;
  static inline __m256i load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static inline __m256i products(__m256i w, __m256i a) {
    return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
  }
};

// one group of codes x 32 activation codes -> 8 lanes of partial integer sums, as floats (exact)
template <class W>
inline __m256 group_dot(__m256i w, const int8_t* q) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(W::products(w, a), _mm256_set1_epi16(1)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum_g m[g] * sx[g]: eight groups a step, then the rest one by one (0 without mins)
inline float min_term(const float* m, const float* sx, int64_t groups) {
  if (m == nullptr) return 0.f;
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(m + g), _mm256_loadu_ps(sx + g), acc);
  float tail = 0.f;
  for (; g < groups; ++g) tail += m[g] * sx[g];
  return hsum(acc) + tail;
}

// R rows (R <= kRowTile) against one output channel
template <class W, int R>
inline void tile(const uint8_t* wn, const float* dn, const float* mn, const int8_t* q, const float* dx,
                 const float* sx, int64_t k, int64_t groups, float* y, int64_t ldy) {
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i w = W::load(wn + g * W::kBytes);
    const float d = dn[g];
    for (int i = 0; i < R; ++i) {
      const __m256 scale = _mm256_set1_ps(d * dx[i * groups + g]);
      acc[i] = _mm256_fmadd_ps(scale, group_dot<W>(w, q + i * k + g * kGroup), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) y[i * ldy] = hsum(acc[i]) + min_term(mn, sx + i * groups, groups);
}

template <class W>
at::Tensor matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const float* mins) {
  const int64_t rows = x.size(0), k = x.size(1), n_out = codes.size(0);
  TORCH_CHECK(k % kGroup == 0 && codes.size(1) == k / kGroup * W::kBytes, "w4a8: codes do not fit x's width");
  const int64_t groups = k / kGroup;
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.dim() == 2 && d.size(0) == n_out && d.size(1) == groups,
              "w4a8: scales must be float32 [out, in / 32]");
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous(), dc = d.contiguous();
  at::Tensor y = at::empty({rows, n_out}, x.options());
  if (rows == 0 || n_out == 0) return y;
  at::Tensor q = at::empty({rows, k}, x.options().dtype(at::kChar));
  at::Tensor dx = at::empty({rows, groups}, x.options());
  at::Tensor sx = at::empty({rows, groups}, x.options());
  quantize_rows(xc.data_ptr<float>(), rows, k, q.data_ptr<int8_t>(), dx.data_ptr<float>(), sx.data_ptr<float>());
  const uint8_t* w = static_cast<const uint8_t*>(cc.data_ptr());
  const float* dp = dc.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dxp = dx.data_ptr<float>();
  const float* sxp = sx.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = groups * W::kBytes;
  at::parallel_for(0, n_out, 32, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int64_t r1 = std::min(rows, r0 + kRowBlock);
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* wn = w + n * row_bytes;
        const float* dn = dp + n * groups;
        const float* mn = mins == nullptr ? nullptr : mins + n * groups;
        for (int64_t r = r0; r < r1; r += kRowTile) {
          const int64_t left = std::min<int64_t>(kRowTile, r1 - r);
          const int8_t* qr = qp + r * k;
          const float* dxr = dxp + r * groups;
          const float* sxr = sxp + r * groups;
          float* yr = yp + r * n_out + n;
          switch (left) {
            case 8: tile<W, 8>(wn, dn, mn, qr, dxr, sxr, k, groups, yr, n_out); break;
            case 7: tile<W, 7>(wn, dn, mn, qr, dxr, sxr, k, groups, yr, n_out); break;
            case 6: tile<W, 6>(wn, dn, mn, qr, dxr, sxr, k, groups, yr, n_out); break;
            case 5: tile<W, 5>(wn, dn, mn, qr, dxr, sxr, k, groups, yr, n_out); break;
            case 4: tile<W, 4>(wn, dn, mn, qr, dxr, sxr, k, groups, yr, n_out); break;
            case 3: tile<W, 3>(wn, dn, mn, qr, dxr, sxr, k, groups, yr, n_out); break;
            case 2: tile<W, 2>(wn, dn, mn, qr, dxr, sxr, k, groups, yr, n_out); break;
            default: tile<W, 1>(wn, dn, mn, qr, dxr, sxr, k, groups, yr, n_out); break;
          }
        }
      }
    }
  });
  return y;
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "w4a8: x must be a 2-D float32 tensor");
}

at::Tensor mm4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
  check_x(x);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "w4a8 mm4: codes must be 2-D uint8");
  TORCH_CHECK(m.scalar_type() == at::kFloat && m.sizes() == d.sizes(), "w4a8 mm4: mins must be float32 like d");
  const at::Tensor mc = m.contiguous();
  return matmul<Q4>(x, codes, d, mc.data_ptr<float>());
}

at::Tensor mm8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d) {
  check_x(x);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar, "w4a8 mm8: codes must be 2-D int8");
  return matmul<Q8>(x, codes, d, nullptr);
}

// the activations' rounding alone (the tests hold it to the reference's, bit for bit)
std::tuple<at::Tensor, at::Tensor, at::Tensor> w4a8_quantize(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % kGroup == 0,
              "w4a8_quantize: x must be float32 [M, K] with K divisible by 32");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({rows, k}, x.options().dtype(at::kChar));
  at::Tensor dx = at::empty({rows, k / kGroup}, x.options());
  at::Tensor sx = at::empty({rows, k / kGroup}, x.options());
  quantize_rows(xc.data_ptr<float>(), rows, k, q.data_ptr<int8_t>(), dx.data_ptr<float>(), sx.data_ptr<float>());
  return {q, dx, sx};
}

}  // namespace

TORCH_LIBRARY(specstack_w4a8, lib) {
  lib.def("mm4(Tensor x, Tensor codes, Tensor d, Tensor m) -> Tensor");
  lib.def("mm8(Tensor x, Tensor codes, Tensor d) -> Tensor");
  lib.def("quantize(Tensor x) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specstack_w4a8, CPU, lib) {
  lib.impl("mm4", &mm4);
  lib.impl("mm8", &mm8);
  lib.impl("quantize", &w4a8_quantize);
}
