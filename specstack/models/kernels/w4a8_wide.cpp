// The w4a8 formats in the *wide layout*: the AVX-512-VNNI path's matmuls, with the outputs across the
// lanes (models/w4a8.py defines the formats and the layout, `to_wide`, and holds the reference; the layout
// as the kernels read it is w4a8_wide_layout.h). The `_amx` ops run calls of many rows on the AMX tiles of
// w4a8_amx.h instead, with the same numbers.
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
#include <utility>

#include "w4a8_amx.h"
#include "w4a8_round.h"
#include "w4a8_wide_layout.h"

namespace {

using specstack_w4a8::kGroup;
using specstack_w4a8::by_rows;
using specstack_w4a8::prefetch_ahead;

using namespace specstack_wide;  // NOLINT: the layout's names are this file's vocabulary

constexpr int kTile = 8;        // rows a tile keeps in registers while a block's groups stream

// R rows against one block of 16 outputs. The rows' rounded activations are stored group by group, each
// group's R rows side by side (one pointer reaches every row, at offsets known when compiling): q the
// codes [groups][R][32], dx and sx [groups][R], halves each group's two sums of 16 codes [groups][R][2].
template <Form F, Scales S, int R>
VNNI_FN inline void tile(const uint8_t* wb, const BlockScales& s, const int8_t* q, const float* dx, const float* sx,
                         const int32_t* halves, int64_t groups, float* y, int64_t ldy) {
  constexpr bool mins = kMins<S>;
  __m512 acc[R], macc[R];
  for (int i = 0; i < R; ++i) { acc[i] = _mm512_setzero_ps(); macc[i] = _mm512_setzero_ps(); }
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = wb + g * kBlockBytes<F>;
    for (int64_t off = 0; off < kBlockBytes<F>; off += 64) prefetch_ahead(wg + off);
    __m512i w[8];
    unpack<F>(wg, w);
    const GroupScales gs = group_scales<F, S>(s, g);
    for (int i = 0; i < R; ++i) {
      const int32_t* qi = reinterpret_cast<const int32_t*>(q + (g * R + i) * kGroup);
      const int32_t* hi = halves + 2 * (g * R + i);
      // two chains (the group's two halves), each started at minus its offset times its activations
      __m512i a = _mm512_set1_epi32(-kOffset<F> * hi[0]), b = _mm512_set1_epi32(-kOffset<F> * hi[1]);
      for (int j = 0; j < 4; ++j) {
        a = _mm512_dpbusd_epi32(a, w[j], _mm512_set1_epi32(qi[j]));
        b = _mm512_dpbusd_epi32(b, w[j + 4], _mm512_set1_epi32(qi[j + 4]));
      }
      const __m512i isum = group_sum<F>(a, b, gs);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(gs.d, _mm512_set1_ps(dx[g * R + i])), acc[i]);
      if constexpr (mins) macc[i] = _mm512_fmadd_ps(gs.m, _mm512_set1_ps(sx[g * R + i]), macc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(y + i * ldy, mins ? _mm512_add_ps(acc[i], macc[i]) : acc[i]);
}

// Calls of at least this many rows take the AMX tiles on the `_amx` ops; fewer take the VNNI tiles, which
// cost less there: a group's AMX products and their stores cost about what 16 rows' VNNI products do
// (benchmarks/amx_tiles_ab.py), and whole forwards of the 1.5B gained from 32 rows, none at 16
// (bench-history 46). `set_amx_from` changes it for A/B runs and for tests (1: every call of
// a form the tiles take on AMX). Both give the same numbers, so it changes speed only.
int64_t& amx_from() {
  static int64_t rows = 32;
  return rows;
}

// The forms the AMX tiles take: 6-bit groups need two half-group products, two tile stores and two integer
// multiplies a row where the VNNI tiles fold the scales into their sums, and stayed slower at every row
// count measured (up to 64)
template <Form F>
constexpr bool kOnAmx = F != Form::kSix;

// The scale forms the AMX tiles take: fp16 scales (kHalf) have run on no AMX CPU yet, so their layers stay
// on the VNNI tiles (the same numbers) until a session on a Xeon with AMX checks them (test_w4a8_wide.py)
template <Scales S>
constexpr bool kOnAmxScales = S != Scales::kHalf;

int64_t set_amx_from(int64_t rows) {
  TORCH_CHECK(rows >= 1, "w4a8 wide: the AMX row threshold is a row count >= 1");
  return std::exchange(amx_from(), rows);
}

// Every row rounded on its own into its tile's records: a tile of up to `tile` rows stores each group's
// rows side by side (codes [groups][n][32], dx and sx [groups][n], for its n rows), which both tiles read;
// with `halves`, each group's two sums of 16 codes too ([groups][n][2], the VNNI tiles' offsets)
void round_tiles(const at::Tensor& xc, int64_t tile, const specstack_w4a8::Rounded& rounded, bool halves) {
  const int64_t rows = xc.size(0), k = xc.size(1), groups = k / kGroup;
  const float* xp = xc.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t first = r / tile * tile, i = r - first, n = std::min(tile, rows - first);
      specstack_w4a8::quantize_row_vnni(xp + r * k, k, rounded.q + first * k + i * kGroup, rounded.dx + first * groups + i,
                                        rounded.sx + first * groups + i, false,
                                        halves ? rounded.ints + first * 2 * groups + 2 * i : nullptr, n);
    }
  });
}

// The AMX tiles (w4a8_amx.h), in tiles of up to 16 rows
template <Form F>
void matmul_amx(const at::Tensor& xc, const uint8_t* w, const BlockScales& s, float* yp, int64_t n_out) {
  const int64_t rows = xc.size(0), k = xc.size(1);
  const int64_t tile = std::min(rows, specstack_amx::kTileRows);
  // one tile's rows more: a last tile of fewer rows is read as a whole one (its extra rows dropped)
  const specstack_w4a8::Rounded rounded = specstack_w4a8::round_scratch(rows + tile, k, 0);
  round_tiles(xc, tile, rounded, false);
  at::parallel_for(0, n_out / kLanes, 1, [&](int64_t b0, int64_t b1) {
    by_scales(s, [&](auto sc) {
      if constexpr (kOnAmxScales<decltype(sc)::value>)
        specstack_amx::blocks<F, decltype(sc)::value>(w, s, rounded.q, rounded.dx, rounded.sx, rows, k, b0, b1, yp, n_out);
    });
  });
}

template <Form F>
at::Tensor matmul(const at::Tensor& x, const at::Tensor& codes, const BlockScales& s, bool amx) {
  const int64_t rows = x.size(0), k = x.size(1), n_out = codes.size(0), groups = k / kGroup;
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({rows, n_out}, x.options());
  if (rows == 0 || n_out == 0) return y;
  if constexpr (kOnAmx<F>) {
    if (amx && rows >= amx_from() && s.h == nullptr) {
      matmul_amx<F>(xc, static_cast<const uint8_t*>(codes.data_ptr()), s, y.data_ptr<float>(), n_out);
      return y;
    }
  }
  const specstack_w4a8::Rounded rounded = specstack_w4a8::round_scratch(rows, k, 2 * groups);
  round_tiles(xc, kTile, rounded, true);
  const int8_t* qp = rounded.q;
  const float* dxp = rounded.dx;
  const float* sxp = rounded.sx;
  const int32_t* hp = rounded.ints;  // each group's two halves' sums
  const uint8_t* w = static_cast<const uint8_t*>(codes.data_ptr());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n_out / kLanes, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const BlockScales sb = block_part(s, b, groups);
      const uint8_t* wb = w + b * groups * kBlockBytes<F>;
      for (int64_t r = 0; r < rows; r += kTile) {
        by_rows<kTile>(std::min<int64_t>(kTile, rows - r), [&](auto rt) {
          by_scales(s, [&](auto sc) {
            tile<F, decltype(sc)::value, decltype(rt)::value>(wb, sb, qp + r * k, dxp + r * groups, sxp + r * groups,
                                                              hp + r * 2 * groups, groups, yp + r * n_out + b * kLanes, n_out);
          });
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

template <bool Amx>
at::Tensor mm4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
  const int64_t n = codes.size(0), groups = check(x, codes, kBlockBytes<Form::kFour>);
  BlockScales s;
  s.d = part<float>(d, n * groups, "scales");
  s.m = part<float>(m, n * groups, "mins");
  return matmul<Form::kFour>(x, codes, s, Amx);
}

template <bool Amx>
at::Tensor mm4k(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sup, const at::Tensor& sub) {
  const int64_t n = codes.size(0), groups = check(x, codes, kBlockBytes<Form::kFour>);
  TORCH_CHECK(groups % 8 == 0, "k4a8: in_features must be a multiple of 256");
  BlockScales s;
  s.d = part<float>(sup, n * groups / 8 * 2, "super-block scales");
  s.sub = part<uint8_t>(sub, n * groups * 2, "sub-block scales");
  return matmul<Form::kFour>(x, codes, s, Amx);
}

// the formats with one float scale per group and no mins: q5a8 (kFive), q8a8 (kEight); the scales fp32, or
// fp16 where the layer's are exact in it (models/w4a8_wide.py `HALF_SCALES`)
template <Form F, bool Amx>
at::Tensor scaled(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d) {
  const int64_t n = codes.size(0), groups = check(x, codes, kBlockBytes<F>);
  BlockScales s;
  if (d.scalar_type() == at::kHalf)
    s.h = reinterpret_cast<const uint16_t*>(part<at::Half>(d, n * groups, "scales"));
  else
    s.d = part<float>(d, n * groups, "scales");
  return matmul<F>(x, codes, s, Amx);
}

template <bool Amx>
at::Tensor mm6k(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& big, const at::Tensor& s16) {
  const int64_t n = codes.size(0), groups = check(x, codes, kBlockBytes<Form::kSix>);
  TORCH_CHECK(groups % 8 == 0, "k6a8: in_features must be a multiple of 256");
  BlockScales s;
  s.d = part<float>(big, n * groups / 8, "super-block scales");
  s.s16 = part<int8_t>(s16, n * groups * 2, "sub-block scales");
  return matmul<Form::kSix>(x, codes, s, Amx);
}

}  // namespace

// Each format's op on the VNNI tiles, and with the suffix `_amx` on the AMX tiles for calls of many rows
// (models/w4a8.py's `amx` path; only a process whose CPU and kernel grant AMX runs them)
TORCH_LIBRARY(specstack_w4a8_wide, lib) {
  lib.def("mm4(Tensor x, Tensor codes, Tensor d, Tensor m) -> Tensor");
  lib.def("mm4k(Tensor x, Tensor codes, Tensor sup, Tensor sub) -> Tensor");
  lib.def("mm5(Tensor x, Tensor codes, Tensor d) -> Tensor");
  lib.def("mm6k(Tensor x, Tensor codes, Tensor big, Tensor s16) -> Tensor");
  lib.def("mm8(Tensor x, Tensor codes, Tensor d) -> Tensor");
  lib.def("mm4_amx(Tensor x, Tensor codes, Tensor d, Tensor m) -> Tensor");
  lib.def("mm4k_amx(Tensor x, Tensor codes, Tensor sup, Tensor sub) -> Tensor");
  lib.def("mm5_amx(Tensor x, Tensor codes, Tensor d) -> Tensor");
  lib.def("mm6k_amx(Tensor x, Tensor codes, Tensor big, Tensor s16) -> Tensor");
  lib.def("mm8_amx(Tensor x, Tensor codes, Tensor d) -> Tensor");
  lib.def("set_prefetch(int bytes) -> int", &specstack_w4a8::set_prefetch);
  lib.def("set_amx_from(int rows) -> int", &set_amx_from);
}

TORCH_LIBRARY_IMPL(specstack_w4a8_wide, CPU, lib) {
  lib.impl("mm4", &mm4<false>);
  lib.impl("mm4k", &mm4k<false>);
  lib.impl("mm5", &scaled<Form::kFive, false>);
  lib.impl("mm6k", &mm6k<false>);
  lib.impl("mm8", &scaled<Form::kEight, false>);
  lib.impl("mm4_amx", &mm4<true>);
  lib.impl("mm4k_amx", &mm4k<true>);
  lib.impl("mm5_amx", &scaled<Form::kFive, true>);
  lib.impl("mm6k_amx", &mm6k<true>);
  lib.impl("mm8_amx", &scaled<Form::kEight, true>);
}
