// What the w4a8 libraries share (w4a8.cpp, the layers' own layout; w4a8_wide.cpp, the wide layout):
// the rounding of the activations, the software prefetch of the weight stream, the VNNI target and the
// row tiles' dispatch.
// native.py rebuilds a library when this header changes (its hash is one of the build's flags).
#pragma once

#include <immintrin.h>

#include <c10/util/Exception.h>

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#define VNNI_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

namespace specstack_w4a8 {

constexpr int64_t kGroup = 32;

// Software prefetch of the weight stream this many bytes ahead of the part being multiplied (0: off).
// A one-token matmul is a read of the weights at the memory's pace, and a core's hardware prefetchers
// alone keep too few lines in flight to reach it (docs/bench-history, "Prefetching the weight stream");
// each library's `set_prefetch` op changes it for A/B runs (benchmarks/prefetch_ab.py).
inline int64_t& prefetch_distance() {
  static int64_t bytes = 8192;
  return bytes;
}

inline void prefetch_ahead(const uint8_t* p) {
  if (const int64_t d = prefetch_distance()) _mm_prefetch(reinterpret_cast<const char*>(p) + d, _MM_HINT_T0);
}

// the `set_prefetch` op: the old distance back
inline int64_t set_prefetch(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "w4a8: the prefetch distance is a byte count >= 0");
  return std::exchange(prefetch_distance(), bytes);
}

// A calling thread's scratch for a matmul's rounded activations (codes, scales, sums, and `ints` int32s a
// row for a path's offsets), grown to its largest call and reused: a decode step makes a hundred small
// calls, and four allocations each were a visible share of its time outside the products. A call uses it
// until it returns (its worker threads only read it meanwhile).
struct Rounded {
  int8_t* q;
  float* dx;
  float* sx;
  int32_t* ints;
};

inline Rounded round_scratch(int64_t rows, int64_t k, int64_t ints) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> dx, sx;
  thread_local std::vector<int32_t> in;
  const auto grow = [](auto& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
    return v.data();
  };
  const int64_t groups = k / kGroup;
  return {grow(q, rows * k), grow(dx, rows * groups), grow(sx, rows * groups), grow(in, rows * ints)};
}

// f(std::integral_constant<int, R>) for R = rows (1 <= rows <= Most): a tile's row count as a constant
template <int Most, class F>
inline void by_rows(int64_t rows, const F& f) {
  if constexpr (Most > 1) {
    if (rows < Most) return by_rows<Most - 1>(rows, f);
  }
  f(std::integral_constant<int, Most>{});
}

// Round one row to 8 bits per group of 32 (the reference's operations: amax, 127 / amax, x * inv,
// round half to even, clamp), vectorised; q in natural order, or, with `interleave`, each chunk of 4
// whole groups as [low halves of groups 0..3 | high halves of groups 0..3] (w4a8.cpp's mm4 layout; the
// groups past the last whole chunk stay in natural order). `halves` (if given): each group's two sums of
// 16 codes, which the wide layout's kernels take their offsets from.
// `stride` (natural order only): consecutive groups' records (32 codes, dx, sx, the two halves) that many
// records apart, so that a tile of `stride` rows stores its rows' records of a group side by side (w4a8_wide.cpp).
VNNI_FN inline void quantize_row_vnni(const float* x, int64_t k, int8_t* q, float* dx, float* sx, bool interleave,
                                      int32_t* halves = nullptr, int64_t stride = 1) {
  const int64_t groups = k / kGroup, chunked = interleave ? groups / 4 * 4 : 0;
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512 hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 a = _mm512_loadu_ps(x + g * kGroup), b = _mm512_loadu_ps(x + g * kGroup + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(a, absmask), _mm512_and_ps(b, absmask)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512 ra = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(_mm512_mul_ps(a, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    const __m512 rb = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(_mm512_mul_ps(b, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    const __m512i ia = _mm512_cvtps_epi32(ra), ib = _mm512_cvtps_epi32(rb);
    const int32_t sa = _mm512_reduce_add_epi32(ia), sb = _mm512_reduce_add_epi32(ib);
    if (halves != nullptr) {
      halves[2 * g * stride] = sa;
      halves[2 * g * stride + 1] = sb;
    }
    int8_t* qa;
    int8_t* qb;
    if (g < chunked) {
      int8_t* base = q + (g / 4) * 128 + (g % 4) * 16;
      qa = base;
      qb = base + 64;
    } else {
      qa = q + g * stride * kGroup;
      qb = qa + 16;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qa), _mm512_cvtsepi32_epi8(ia));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(ib));
    const float d = amax / 127.f;
    dx[g * stride] = d;
    sx[g * stride] = d * static_cast<float>(sa + sb);
  }
}

}  // namespace specstack_w4a8
