// The wide layout's matmuls on AMX-INT8 (w4a8_wide.cpp's `_amx` ops call them for calls of many rows):
// the same exact integer sums per group as the AVX-512-VNNI tiles, by tile products, and the same float
// epilogue, so each output is bit for bit what the VNNI tiles give (tests/unit/test_w4a8_amx.py).
//
// A block's group is 8 quads of 16 outputs x 4 codes (w4a8_wide_layout.h): exactly an AMX B tile of 8
// rows of 64 bytes, so unpacking its codes to int8 and storing the 8 vectors makes the tile (8-bit codes
// are one already, loaded in place). Up to 16 rows' activations of the group are an A tile (16 rows of
// 32 codes), and one tile product gives the 16 x 16 integer sums of the group: where the VNNI tiles run
// 8 `vpdpbusd` a row, one instruction does 16 rows.
// 4-bit codes go in unsigned (`tdpbsud`), 5-bit ones signed with their offset taken off (c - 16), 8-bit ones
// as they are, so no activation sums are needed. 6-bit groups stay on the VNNI tiles (w4a8_wide.cpp
// `kOnAmx`: two half-group products each, with their scales, cost more than the VNNI tiles).
//
// Why the sums leave the tiles after every group: the float epilogue (y = sum_g fma(float(isum_g),
// d_g dx_g) in the groups' order, plus the mins' sum) must be the VNNI tiles' sequence of operations, or
// a row's numbers would depend on the path its call took. That epilogue, a tile store and a vector
// multiply-add per row and group, is most of the work; the tile products are not.
//
// Tiles and the Linux permission: the process asks for AMX's state once (torch.cpu._init_amx, models/
// native.py `has_amx`) before any op runs; each worker configures its tiles for its part of a call and
// releases them after it. The library is linked with every symbol bound at load (native.py LDFLAGS:
// -z now): a call through the PLT that ran the dynamic linker's lazy binding between the configuration
// and a tile load cleared the configuration (SIGILL on the load).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "w4a8_round.h"
#include "w4a8_wide_layout.h"

#define AMX_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")))

namespace specstack_amx {

using namespace specstack_wide;  // NOLINT: the layout's names are this file's vocabulary
using specstack_w4a8::kGroup;

constexpr int64_t kTileRows = 16;  // rows of an A (activations) and C (sums) tile

// The tile configuration (palette 1) as ldtilecfg reads it
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0 and 1: sums (16 lanes of int32 a row); 2 and 3: activations (a group's 32 codes a row); 4 and
// 5: codes (8 quads of 16 outputs x 4). Two sets, so that consecutive groups' products overlap.
AMX_FN inline void configure(int64_t rows) {
  TileConfig c;
  for (int t = 0; t < 2; ++t) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = 64;
    c.rows[t + 2] = static_cast<uint8_t>(rows);
    c.colsb[t + 2] = kGroup;
    c.rows[t + 4] = kGroup / 4;
    c.colsb[t + 4] = 64;
  }
  // gcc 12 does not see ldtilecfg read the struct and drops the stores above as dead (the tiles were
  // then unconfigured: SIGILL on the first tile load); an empty asm that takes its address keeps them
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// A group's codes as the B tile (5-bit signed, their offset taken off): 8 rows of 64 bytes at the result
template <Form F>
AMX_FN inline const int8_t* codes_tile(const uint8_t* wg, int8_t* buf) {
  if constexpr (F == Form::kEight) {
    return reinterpret_cast<const int8_t*>(wg);  // signed codes in the tile's layout already
  } else {
    __m512i w[8];
    unpack<F>(wg, w);
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(kOffset<F>));
    for (int j = 0; j < 8; ++j) _mm512_store_si512(buf + 64 * j, kOffset<F> ? _mm512_sub_epi8(w[j], offset) : w[j]);
    return buf;
  }
}

constexpr int kBatch = 8;  // groups whose products are in flight before their epilogues

// One product into sums (16 rows x 16 lanes of int32, a row 64 bytes apart): tiles C, A, B of the
// configuration, the activations from qa (rows `stride` bytes apart), the codes' tile from bt. A macro: the
// tile intrinsics take the tiles' numbers as literals.
#define SPECSTACK_AMX_PRODUCT(NAME, C, A, B)                                              \
  template <Form F>                                                                     \
  AMX_FN inline void NAME(const int8_t* qa, int64_t stride, const int8_t* bt, int32_t* sums) { \
    _tile_loadd(B, bt, 64);                                                             \
    _tile_loadd(A, qa, stride);                                                         \
    _tile_zero(C);                                                                      \
    if constexpr (F == Form::kFour) _tile_dpbsud(C, A, B); /* unsigned 4-bit codes */   \
    else _tile_dpbssd(C, A, B);                                                         \
    _tile_stored(C, sums, 64);                                                          \
  }
SPECSTACK_AMX_PRODUCT(product0, 0, 2, 4)
SPECSTACK_AMX_PRODUCT(product1, 1, 3, 5)
#undef SPECSTACK_AMX_PRODUCT

// R rows (one A tile's, R <= 16) against one block of 16 outputs. The rows' rounded activations are stored
// group by group, each group's R rows side by side (the VNNI tiles' layout, w4a8_wide.cpp): q the codes
// [groups][R][32] (a group's A tile is 32 R contiguous bytes), dx and sx [groups][R]. The groups go in
// batches of kBatch, in a pipeline of three stages: batch t's codes are unpacked while batch t - 1's
// products run and batch t - 2's epilogues (in the groups' order, the rows' sums in registers) read their
// results. A tile load of bytes just stored by vector stores, and a vector load of a tile's just stored
// sums, each wait for the stores to reach the cache: one stage apart, they have.
template <Form F, Scales S, int R>
AMX_FN inline void row_tile(const uint8_t* wb, const BlockScales& s, const int8_t* q, const float* dx, const float* sx,
                            int64_t groups, float* y, int64_t ldy) {
  static_assert(F != Form::kSix, "6-bit groups stay on the VNNI tiles (w4a8_wide.cpp kOnAmx)");
  constexpr int64_t kSums = kTileRows * kLanes;
  constexpr int64_t kCodes = F == Form::kEight ? 1 : 8 * 64;  // 8-bit codes are tiles in place
  alignas(64) int8_t codes[2][kBatch][kCodes];
  alignas(64) int32_t sums[2][kBatch][kSums];
  const int8_t* bt[2][kBatch];
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t batches = (groups + kBatch - 1) / kBatch;
  for (int64_t t = 0; t < batches + 2; ++t) {
    if (t < batches) {  // unpack batch t
      const int64_t g0 = t * kBatch, nb = std::min<int64_t>(kBatch, groups - g0);
      for (int64_t j = 0; j < nb; ++j) {
        const uint8_t* wg = wb + (g0 + j) * kBlockBytes<F>;
        for (int64_t off = 0; off < kBlockBytes<F>; off += 64) specstack_w4a8::prefetch_ahead(wg + off);
        bt[t % 2][j] = codes_tile<F>(wg, codes[t % 2][j]);
      }
    }
    if (t >= 1 && t <= batches) {  // batch t - 1's products
      const int64_t u = t - 1, g0 = u * kBatch, nb = std::min<int64_t>(kBatch, groups - g0);
      for (int64_t j = 0; j < nb; ++j) {
        const int8_t* qa = q + (g0 + j) * R * kGroup;
        const int8_t* b = bt[u % 2][j];
        int32_t* out = sums[u % 2][j];
        if (j % 2 == 0) {
          product0<F>(qa, kGroup, b, out);
        } else {
          product1<F>(qa, kGroup, b, out);
        }
      }
    }
    if (t >= 2) {  // batch t - 2's epilogues
      const int64_t u = t - 2, g0 = u * kBatch, nb = std::min<int64_t>(kBatch, groups - g0);
      for (int64_t j = 0; j < nb; ++j) {
        const int64_t g = g0 + j;
        const int32_t* in = sums[u % 2][j];
        const GroupScales gs = group_scales<F, S>(s, g);
        for (int i = 0; i < R; ++i) {
          const __m512i isum = _mm512_load_si512(in + i * kLanes);
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(gs.d, _mm512_set1_ps(dx[g * R + i])), acc[i]);
        }
      }
    }
  }
  if constexpr (kMins<S>) {  // the mins' sums, in their own order as the VNNI tiles keep them
    __m512 macc[R];
    for (int i = 0; i < R; ++i) macc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 m = group_scales<F, S>(s, g).m;
      for (int i = 0; i < R; ++i) macc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[g * R + i]), macc[i]);
    }
    for (int i = 0; i < R; ++i) acc[i] = _mm512_add_ps(acc[i], macc[i]);
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(y + i * ldy, acc[i]);
}

// Blocks b0 .. b1 of 16 outputs for every row of a call, in row tiles of up to 16 (each tile's records as
// `row_tile` reads them, tile after tile; a last tile of fewer rows has its A tiles read past its rows,
// into the scratch's padding, and those rows' sums dropped).
template <Form F, Scales S>
AMX_FN void blocks(const uint8_t* w, const BlockScales& s, const int8_t* q, const float* dx, const float* sx,
                   int64_t rows, int64_t k, int64_t b0, int64_t b1, float* y, int64_t n_out) {
  const int64_t groups = k / kGroup, tile_rows = std::min(rows, kTileRows);
  configure(tile_rows);
  for (int64_t b = b0; b < b1; ++b) {
    const BlockScales sb = block_part(s, b, groups);
    const uint8_t* wb = w + b * groups * kBlockBytes<F>;
    for (int64_t r0 = 0; r0 < rows; r0 += tile_rows) {
      specstack_w4a8::by_rows<kTileRows>(std::min(tile_rows, rows - r0), [&](auto rt) {
        row_tile<F, S, decltype(rt)::value>(wb, sb, q + r0 * k, dx + r0 * groups, sx + r0 * groups, groups,
                                            y + r0 * n_out + b * kLanes, n_out);
      });
    }
  }
  _tile_release();
}

}  // namespace specstack_amx
