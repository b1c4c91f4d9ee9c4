// The w4a8 formats in the *wide layout*: the AVX-512-VNNI path's matmuls, with the outputs across the
// lanes (models/w4a8.py defines the formats and the layout, `to_wide`, and holds the reference).
//
// A layer's weights are repacked once after load into blocks of 16 outputs; in a block, each group of
// 32 inputs is 8 vectors of 16 lanes x 4 codes (lane o: output o's codes 4j .. 4j + 3 of the group), so
// `vpdpbusd` multiplies 16 outputs by 4 activation codes broadcast from memory, and after the group's 8
// vectors a lane holds its output's exact integer sum for the group. Why it is shaped so:
// - the float epilogue is one conversion and one multiply-add per group for 16 outputs of a row,
//   where the layers' own layout (w4a8.cpp) needs a lane shuffle, a multiply and a multiply-add per 4
//   groups of one output: that epilogue, not the integer products, bounded a call of several rows;
// - a group's codes are unpacked once for every row of a tile (up to kTile rows in registers), so a
//   call of 8 or 16 rows reads and unpacks each weight once per tile, and the products dominate;
// - no horizontal sums: a lane is an output, its 16 results are stored as they are;
// - one canonical order for every row, on every row count: y = sum_g fma(float(isum_g), d_g dx_g)
//   over the groups in order, plus (formats with mins) sum_g fma(m_g, sx_g) likewise, added last. A
//   row's numbers are its own whatever rows share the call (batch invariance, as in w4a8.cpp).
// The codes go into vpdpbusd unsigned: 4-bit as they are; 5-bit (c - 16), 6-bit (c - 32) and 8-bit
// (c xor 0x80 = c + 128) with the offset times each half group's activation sum taken off by starting
// the integer sums at minus that (`halves`, computed when the row is rounded).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "w4a8_round.h"

namespace {

using specstack_w4a8::kGroup;
using specstack_w4a8::by_rows;
using specstack_w4a8::prefetch_ahead;

constexpr int64_t kLanes = 16;  // outputs in a block
constexpr int kTile = 8;        // rows a tile keeps in registers while a block's groups stream

// The group formats of the wide layout: a block's bytes per group, the codes of a group as 8 unsigned
// vectors (quads 0..3 = the group's first 16 inputs, 4..7 its last 16) and the offset c0 of the codes.
enum class Form { kFour, kFive, kSix, kEight };

template <Form F> constexpr int64_t kBlockBytes = F == Form::kFour ? 256 : F == Form::kFive ? 320
                                                 : F == Form::kSix ? 384 : 512;
template <Form F> constexpr int32_t kOffset = F == Form::kFive ? 16 : F == Form::kSix ? 32 : F == Form::kEight ? 128 : 0;

// A block's group: 4-bit nibbles in 4 vectors (low nibbles quads 0..3, high nibbles quads 4..7), then
// (5-bit) 8 64-bit masks of fifth bits, one per quad, or (6-bit) 2 vectors of the top 2 bits, vector h's
// bits 2f..2f+1 of a byte belonging to quad 4h + f; 8-bit: 8 vectors of signed codes, one per quad.
template <Form F>
VNNI_FN inline void unpack(const uint8_t* wg, __m512i* w) {
  if constexpr (F == Form::kEight) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int j = 0; j < 8; ++j) w[j] = _mm512_xor_si512(_mm512_loadu_si512(wg + 64 * j), flip);
  } else {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m512i raw = _mm512_loadu_si512(wg + 64 * j);
      w[j] = _mm512_and_si512(raw, nib);
      w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
    }
    if constexpr (F == Form::kFive) {
      const __m512i sixteen = _mm512_set1_epi8(16);
      const uint64_t* bits = reinterpret_cast<const uint64_t*>(wg + 256);
      for (int j = 0; j < 8; ++j) w[j] = _mm512_mask_add_epi8(w[j], _cvtu64_mask64(bits[j]), w[j], sixteen);
    } else if constexpr (F == Form::kSix) {
      // field f of a byte moved to bits 4-5 by a 16-bit shift (no bits of the other byte land there),
      // then merged: code = nibble | (moved & 0x30) (0xF8: bits 0-3 from the first operand, the rest
      // from the second's 0x30)
      const __m512i top = _mm512_set1_epi8(0x30);
      for (int h = 0; h < 2; ++h) {
        const __m512i p = _mm512_loadu_si512(wg + 256 + 64 * h);
        const __m512i moved[4] = {_mm512_slli_epi16(p, 4), _mm512_slli_epi16(p, 2), p, _mm512_srli_epi16(p, 2)};
        for (int f = 0; f < 4; ++f) w[4 * h + f] = _mm512_ternarylogic_epi32(w[4 * h + f], moved[f], top, 0xF8);
      }
    }
  }
}

// The scales of a block (the wide layout of each format's tensors, models/w4a8.py `to_wide`)
struct BlockScales {
  const float* d = nullptr;    // [groups, 16]; k4a8: (D, M) [supers, 2, 16]; k6a8: D [supers, 16]
  const float* m = nullptr;    // w4a8: [groups, 16]
  const uint8_t* sub = nullptr;  // k4a8: (sc, mn) [groups, 2, 16]
  const int8_t* s16 = nullptr;   // k6a8: the two 16-input scales [groups, 2, 16]
};

// How a block's group scales are stored: float scales (and mins), or k4a8's super-block scales with 6-bit
// sub-block scales and mins; compile-time, so that a tile's loop has no branch on them
enum class Scales { kPlain, kPlainMins, kSub };

// R rows against one block of 16 outputs. The rows' rounded activations are stored group by group, each
// group's R rows side by side (one pointer reaches every row, at offsets known when compiling): q the
// codes [groups][R][32], dx and sx [groups][R], halves each group's two sums of 16 codes [groups][R][2].
template <Form F, Scales S, int R>
VNNI_FN inline void tile(const uint8_t* wb, const BlockScales& s, const int8_t* q, const float* dx, const float* sx,
                         const int32_t* halves, int64_t groups, float* y, int64_t ldy) {
  constexpr bool mins = S != Scales::kPlain;
  __m512 acc[R], macc[R];
  for (int i = 0; i < R; ++i) { acc[i] = _mm512_setzero_ps(); macc[i] = _mm512_setzero_ps(); }
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = wb + g * kBlockBytes<F>;
    for (int64_t off = 0; off < kBlockBytes<F>; off += 64) prefetch_ahead(wg + off);
    __m512i w[8];
    unpack<F>(wg, w);
    __m512 d, m = _mm512_setzero_ps();
    if constexpr (S == Scales::kSub) {  // k4a8: d = D sc, m = M mn (exact in fp32)
      const float* big = s.d + (g / 8) * 2 * kLanes;
      const uint8_t* sub = s.sub + g * 2 * kLanes;
      d = _mm512_mul_ps(_mm512_loadu_ps(big), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub)))));
      m = _mm512_mul_ps(_mm512_loadu_ps(big + kLanes), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + kLanes)))));
    } else if constexpr (F == Form::kSix) {
      d = _mm512_loadu_ps(s.d + (g / 8) * kLanes);
    } else {
      d = _mm512_loadu_ps(s.d + g * kLanes);
      if constexpr (S == Scales::kPlainMins) m = _mm512_loadu_ps(s.m + g * kLanes);
    }
    __m512i s0 = _mm512_setzero_si512(), s1 = s0;
    if constexpr (F == Form::kSix) {
      const __m128i* sc = reinterpret_cast<const __m128i*>(s.s16 + g * 2 * kLanes);
      s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(sc));
      s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(sc + 1));
    }
    for (int i = 0; i < R; ++i) {
      const int32_t* qi = reinterpret_cast<const int32_t*>(q + (g * R + i) * kGroup);
      const int32_t* hi = halves + 2 * (g * R + i);
      // two chains (the group's two halves), each started at minus its offset times its activations
      __m512i a = _mm512_set1_epi32(-kOffset<F> * hi[0]), b = _mm512_set1_epi32(-kOffset<F> * hi[1]);
      for (int j = 0; j < 4; ++j) {
        a = _mm512_dpbusd_epi32(a, w[j], _mm512_set1_epi32(qi[j]));
        b = _mm512_dpbusd_epi32(b, w[j + 4], _mm512_set1_epi32(qi[j + 4]));
      }
      const __m512i isum = F == Form::kSix ? _mm512_add_epi32(_mm512_mullo_epi32(a, s0), _mm512_mullo_epi32(b, s1))
                                           : _mm512_add_epi32(a, b);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(dx[g * R + i])), acc[i]);
      if constexpr (mins) macc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[g * R + i]), macc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(y + i * ldy, mins ? _mm512_add_ps(acc[i], macc[i]) : acc[i]);
}

template <Form F>
at::Tensor matmul(const at::Tensor& x, const at::Tensor& codes, const BlockScales& s) {
  const int64_t rows = x.size(0), k = x.size(1), n_out = codes.size(0), groups = k / kGroup;
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({rows, n_out}, x.options());
  if (rows == 0 || n_out == 0) return y;
  const specstack_w4a8::Rounded rounded = specstack_w4a8::round_scratch(rows, k, 2 * groups);
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = rounded.q;
  float* dxp = rounded.dx;
  float* sxp = rounded.sx;
  int32_t* hp = rounded.ints;  // each group's two halves' sums
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {  // each row rounded on its own, into its tile's records
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t first = r / kTile * kTile, i = r - first, n = std::min<int64_t>(kTile, rows - first);
      specstack_w4a8::quantize_row_vnni(xp + r * k, k, qp + first * k + i * kGroup, dxp + first * groups + i,
                                        sxp + first * groups + i, false, hp + first * 2 * groups + 2 * i, n);
    }
  });
  const uint8_t* w = static_cast<const uint8_t*>(codes.data_ptr());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n_out / kLanes, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      BlockScales sb = s;  // this block's part of each tensor
      const int64_t supers = groups / 8;
      if (s.sub != nullptr) {
        sb.d = s.d + b * supers * 2 * kLanes;
        sb.sub = s.sub + b * groups * 2 * kLanes;
      } else if (s.s16 != nullptr) {
        sb.d = s.d + b * supers * kLanes;
        sb.s16 = s.s16 + b * groups * 2 * kLanes;
      } else {
        sb.d = s.d + b * groups * kLanes;
        if (s.m != nullptr) sb.m = s.m + b * groups * kLanes;
      }
      const uint8_t* wb = w + b * groups * kBlockBytes<F>;
      for (int64_t r = 0; r < rows; r += kTile) {
        by_rows<kTile>(std::min<int64_t>(kTile, rows - r), [&](auto rt) {
          constexpr int R = decltype(rt)::value;
          const auto run = [&](auto tile_fn) {
            tile_fn(wb, sb, qp + r * k, dxp + r * groups, sxp + r * groups, hp + r * 2 * groups, groups,
                    yp + r * n_out + b * kLanes, n_out);
          };
          if (s.sub != nullptr) run(tile<F, Scales::kSub, R>);
          else if (s.m != nullptr) run(tile<F, Scales::kPlainMins, R>);
          else run(tile<F, Scales::kPlain, R>);
        });
      }
    }
  });
  return y;
}

// The checks every op makes: x [M, K] float32 with K a multiple of 32; codes [N, bytes] with N a multiple
// of 16 and the bytes the format's; each scale tensor the numel the wide layout has, float32 or bytes.
int64_t check(const at::Tensor& x, const at::Tensor& codes, int64_t group_bytes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % kGroup == 0,
              "w4a8 wide: x must be a 2-D float32 tensor [M, K] with K divisible by 32");
  const int64_t groups = x.size(1) / kGroup;
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.size(0) % kLanes == 0 &&
                  codes.size(1) * kLanes == groups * group_bytes,
              "w4a8 wide: codes must be contiguous [N, bytes] with N a multiple of 16, in the wide layout for x's width");
  return groups;
}

template <class T>
const T* part(const at::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK(t.is_contiguous() && t.numel() == numel && t.scalar_type() == c10::CppTypeToScalarType<T>::value,
              "w4a8 wide: ", what, " do not match the codes (the wide layout, contiguous)");
  return t.data_ptr<T>();
}

at::Tensor mm4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
  const int64_t n = codes.size(0), groups = check(x, codes, kBlockBytes<Form::kFour>);
  BlockScales s;
  s.d = part<float>(d, n * groups, "scales");
  s.m = part<float>(m, n * groups, "mins");
  return matmul<Form::kFour>(x, codes, s);
}

at::Tensor mm4k(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sup, const at::Tensor& sub) {
  const int64_t n = codes.size(0), groups = check(x, codes, kBlockBytes<Form::kFour>);
  TORCH_CHECK(groups % 8 == 0, "k4a8: in_features must be a multiple of 256");
  BlockScales s;
  s.d = part<float>(sup, n * groups / 8 * 2, "super-block scales");
  s.sub = part<uint8_t>(sub, n * groups * 2, "sub-block scales");
  return matmul<Form::kFour>(x, codes, s);
}

// the formats with one float scale per group and no mins: q5a8 (kFive), q8a8 (kEight)
template <Form F>
at::Tensor scaled(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d) {
  const int64_t n = codes.size(0), groups = check(x, codes, kBlockBytes<F>);
  BlockScales s;
  s.d = part<float>(d, n * groups, "scales");
  return matmul<F>(x, codes, s);
}

at::Tensor mm6k(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& big, const at::Tensor& s16) {
  const int64_t n = codes.size(0), groups = check(x, codes, kBlockBytes<Form::kSix>);
  TORCH_CHECK(groups % 8 == 0, "k6a8: in_features must be a multiple of 256");
  BlockScales s;
  s.d = part<float>(big, n * groups / 8, "super-block scales");
  s.s16 = part<int8_t>(s16, n * groups * 2, "sub-block scales");
  return matmul<Form::kSix>(x, codes, s);
}

}  // namespace

TORCH_LIBRARY(specstack_w4a8_wide, lib) {
  lib.def("mm4(Tensor x, Tensor codes, Tensor d, Tensor m) -> Tensor");
  lib.def("mm4k(Tensor x, Tensor codes, Tensor sup, Tensor sub) -> Tensor");
  lib.def("mm5(Tensor x, Tensor codes, Tensor d) -> Tensor");
  lib.def("mm6k(Tensor x, Tensor codes, Tensor big, Tensor s16) -> Tensor");
  lib.def("mm8(Tensor x, Tensor codes, Tensor d) -> Tensor");
  lib.def("set_prefetch(int bytes) -> int", &specstack_w4a8::set_prefetch);
}

TORCH_LIBRARY_IMPL(specstack_w4a8_wide, CPU, lib) {
  lib.impl("mm4", &mm4);
  lib.impl("mm4k", &mm4k);
  lib.impl("mm5", &scaled<Form::kFive>);
  lib.impl("mm6k", &mm6k);
  lib.impl("mm8", &scaled<Form::kEight>);
}
