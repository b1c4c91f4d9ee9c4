// The wide layout of w4a8's formats, as its kernels read it (models/w4a8_wide.py `to_wide` writes it):
// a block of 16 outputs, group by group, and each format's scales for a group's 16 outputs. Shared by
// the AVX-512-VNNI tiles (w4a8_wide.cpp) and the AMX ones (w4a8_amx.h), which must read the same numbers
// in the same order (their outputs are bit for bit the same).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "w4a8_round.h"

namespace specstack_wide {

constexpr int64_t kLanes = 16;  // outputs in a block

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
  const uint16_t* h = nullptr;   // q5a8, q8a8 where each scale is exact in fp16: d as fp16 [groups, 16]
  const float* m = nullptr;    // w4a8: [groups, 16]
  const uint8_t* sub = nullptr;  // k4a8: (sc, mn) [groups, 2, 16]
  const int8_t* s16 = nullptr;   // k6a8: the two 16-input scales [groups, 2, 16]
};

// How a block's group scales are stored: float scales (and mins), fp16 scales (no mins: a layer whose fp32
// scales are all exact in fp16, as a GGUF's Q5_0 and Q8_0 ones are, streams half the scale bytes for the
// same numbers), or k4a8's super-block scales with 6-bit sub-block scales and mins; compile-time, so that
// a tile's loop has no branch on them
enum class Scales { kPlain, kHalf, kPlainMins, kSub };

// whether a group adds its min term (m sx) to the sums
template <Scales S>
constexpr bool kMins = S == Scales::kPlainMins || S == Scales::kSub;

// f(std::integral_constant<Scales, S>) for the S a layer's scale tensors are stored as (the tiles' template)
template <class Fn>
inline void by_scales(const BlockScales& s, const Fn& f) {
  if (s.sub != nullptr) f(std::integral_constant<Scales, Scales::kSub>{});
  else if (s.m != nullptr) f(std::integral_constant<Scales, Scales::kPlainMins>{});
  else if (s.h != nullptr) f(std::integral_constant<Scales, Scales::kHalf>{});
  else f(std::integral_constant<Scales, Scales::kPlain>{});
}

// A block's part of each of a layer's scale tensors
inline BlockScales block_part(const BlockScales& s, int64_t b, int64_t groups) {
  BlockScales sb = s;
  const int64_t supers = groups / 8;
  if (s.sub != nullptr) {
    sb.d = s.d + b * supers * 2 * kLanes;
    sb.sub = s.sub + b * groups * 2 * kLanes;
  } else if (s.s16 != nullptr) {
    sb.d = s.d + b * supers * kLanes;
    sb.s16 = s.s16 + b * groups * 2 * kLanes;
  } else if (s.h != nullptr) {
    sb.h = s.h + b * groups * kLanes;
  } else {
    sb.d = s.d + b * groups * kLanes;
    if (s.m != nullptr) sb.m = s.m + b * groups * kLanes;
  }
  return sb;
}

// A group's scales for the block's 16 outputs: d, the min m (zero without), and k6a8's two 16-input
// scales s0, s1 as int32 lanes
struct GroupScales {
  __m512 d, m;
  __m512i s0, s1;
};

template <Form F, Scales S>
VNNI_FN inline GroupScales group_scales(const BlockScales& s, int64_t g) {
  GroupScales out{_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_si512(), _mm512_setzero_si512()};
  if constexpr (S == Scales::kSub) {  // k4a8: d = D sc, m = M mn (exact in fp32)
    const float* big = s.d + (g / 8) * 2 * kLanes;
    const uint8_t* sub = s.sub + g * 2 * kLanes;
    out.d = _mm512_mul_ps(_mm512_loadu_ps(big), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub)))));
    out.m = _mm512_mul_ps(_mm512_loadu_ps(big + kLanes), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + kLanes)))));
  } else if constexpr (S == Scales::kHalf) {  // exact: every fp16 is an fp32
    out.d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.h + g * kLanes)));
  } else if constexpr (F == Form::kSix) {
    out.d = _mm512_loadu_ps(s.d + (g / 8) * kLanes);
  } else {
    out.d = _mm512_loadu_ps(s.d + g * kLanes);
    if constexpr (S == Scales::kPlainMins) out.m = _mm512_loadu_ps(s.m + g * kLanes);
  }
  if constexpr (F == Form::kSix) {
    const __m128i* sc = reinterpret_cast<const __m128i*>(s.s16 + g * 2 * kLanes);
    out.s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(sc));
    out.s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(sc + 1));
  }
  return out;
}

// A group's exact integer sum for 16 outputs from its two halves' sums (6-bit: each times its scale)
template <Form F>
VNNI_FN inline __m512i group_sum(__m512i a, __m512i b, const GroupScales& gs) {
  return F == Form::kSix ? _mm512_add_epi32(_mm512_mullo_epi32(a, gs.s0), _mm512_mullo_epi32(b, gs.s1))
                         : _mm512_add_epi32(a, b);
}

}  // namespace specstack_wide
