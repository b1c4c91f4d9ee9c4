// The w4a8 matmuls (specstack/models/w4a8.py has the format's definition and its reference):
//   y[r, n] = sum_g  (d[n, g] * dx[r, g]) * sum_{k in g} c[n, k] q[r, k]   +   m[n, g] * sx[r, g]
// q: the activations rounded to 8 bits per row and per group of 32 inputs, q = nearbyint(x * (127 / amax)),
// dx = amax / 127, sx = dx * sum(q). Two kinds of weight groups:
// - 4-bit (mm4): codes c in 0..15 with w = d * c + m (GGUF Q4_0/Q4_1/Q4_K), 16 bytes a group;
// - 8-bit (mm8): codes c in -127..127 with w = d * c and no m (GGUF Q8_0's layout), 32 bytes a group:
//   the layers a file keeps in more than 4 bits that have no layout of their own here, and unembeddings;
// - 6-bit (mm6k, the `k6a8` layer format): GGUF Q6_K's codes c in 0..63 with w = D * s * (c - 32), an
//   int8 s per 16 weights and D per 256, 24 bytes a group (4 bits in w4a8's nibbles, 2 in a plane
//   after each 4 groups' nibbles): a lane's integer sum is sum_16 s * (c - 32) * q, exact in int32;
// - 5-bit (mm5, the `q5a8` layer format): GGUF Q5_0's codes c in 0..31 with w = d * (c - 16), d per
//   group, 20 bytes a group (the fifth bits of 4 groups in two 64-bit words, then their nibbles).
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
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "w4a8_round.h"

namespace {

using specstack_w4a8::kGroup;
using specstack_w4a8::by_rows;
using specstack_w4a8::prefetch_ahead;
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

// A layer's group scales d and mins m (w = d c + m per group), in one of two layouts:
// - per group (GGUF Q4_0 / Q4_1, and layers quantised here): d, m float32 [out, groups] (m null for
//   8-bit groups);
// - super-blocks of 8 groups (GGUF Q4_K, the `k4a8` layer format): d = D * sc, m = M * mn with D, M
//   float32 [out, supers, 2] and the 6-bit sc, mn uint8 [out, 2, groups], 3 bytes a group instead of 8.
//   D * sc and M * mn are exact in float32 (an fp16 times a 6-bit integer), so a row's expansion is the
//   per-group layout's numbers bit for bit, and every path computes the same outputs from either.
struct RowScales;

struct Scales {
  const float* d = nullptr;  // per group, or (k6a8) D per super-block
  const float* m = nullptr;
  const float* sup = nullptr;
  const uint8_t* sub = nullptr;
  const int8_t* s16 = nullptr;  // k6a8: the int8 scale of each 16 weights
  int64_t supers = 0;

  RowScales row(int64_t n, int64_t groups) const;
};

// One output's scales, read where they are used: the per-group layout's floats, or D sc and M mn
// computed from the super-blocks (exact, so the same floats) a group, 8 or 16 groups at a time.
struct RowScales {
  const float* d = nullptr;
  const float* m = nullptr;
  const float* sup = nullptr;  // (D, M) per super-block of 8 groups
  const uint8_t* sc = nullptr;
  const uint8_t* mn = nullptr;
  const int8_t* s16 = nullptr;  // k6a8 (d then holds D per super-block)

  bool has_mins() const { return m != nullptr || sup != nullptr; }
  float d1(int64_t g) const { return sup ? sup[2 * (g / 8)] * static_cast<float>(sc[g]) : d[g]; }
  float m1(int64_t g) const { return sup ? sup[2 * (g / 8) + 1] * static_cast<float>(mn[g]) : m[g]; }
  // 8 groups' mins from g (a multiple of 8)
  __m256 m8(int64_t g) const {
    if (!sup) return _mm256_loadu_ps(m + g);
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + g)));
    return _mm256_mul_ps(_mm256_set1_ps(sup[2 * (g / 8) + 1]), _mm256_cvtepi32_ps(b));
  }
};

RowScales Scales::row(int64_t n, int64_t groups) const {
  RowScales r;
  if (s16 != nullptr) {
    r.d = d + n * supers;
    r.s16 = s16 + n * groups * 2;
  } else if (sup == nullptr) {
    r.d = d + n * groups;
    r.m = m == nullptr ? nullptr : m + n * groups;
  } else {
    r.sup = sup + n * supers * 2;
    r.sc = sub + n * 2 * groups;
    r.mn = r.sc + groups;
  }
  return r;
}

// One weight group as the avx2 path multiplies it: 32 codes (code j in byte j), the int16 factors
// of vpmaddwd's pair sums (ones, or a 6-bit group's two scales), and the group's float scale.
struct Group {
  __m256i w;
  __m256i mul;
  float d;
};

// 4-bit groups: 16 bytes -> 32 codes; byte j holds code j (low nibble) and code j + 16 (high nibble)
struct Q4 {
  static constexpr int64_t kBytes = kGroup / 2;
  static inline Group group(const uint8_t* wn, const RowScales& s, int64_t g) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wn + g * kBytes));
    const __m128i low = _mm_set1_epi8(0x0F);
    return {_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low)),
            _mm256_set1_epi16(1), s.d1(g)};
  }
  static inline __m256i products(__m256i w, __m256i a) { return _mm256_maddubs_epi16(w, a); }
};

// 8-bit groups: 32 signed codes; |c| times q with c's sign
struct Q8 {
  static constexpr int64_t kBytes = kGroup;
  static inline Group group(const uint8_t* wn, const RowScales& s, int64_t g) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wn + g * kBytes)), _mm256_set1_epi16(1), s.d1(g)};
  }
  static inline __m256i products(__m256i w, __m256i a) {
    return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
  }
};

// 6-bit groups (k6a8), 96 bytes a chunk of 4 groups: [the 4 groups' nibbles as Q4's | 32 bytes of
// high bits], byte j of the plane holding the top 2 bits of nibble-vector positions j, j + 32 (bits
// 0-1, 2-3; a position p is code p % 16 of the chunk's group p / 16) and of codes 16.. at the same
// positions (bits 4-5, 6-7): the vnni path widens a chunk with two shifts, this one a group with one.
// The codes go in as c - 32 with Q8's sign trick; vpmaddwd applies the two 16-weight scales.
struct Q6 {
  static constexpr int64_t kBytes = 24;
  static inline Group group(const uint8_t* wn, const RowScales& s, int64_t g) {
    const uint8_t* base = wn + (g / 4) * 96;
    const int64_t gi = g % 4;
    const __m128i nb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + gi * 16));
    const __m128i hb = _mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 64 + (gi & 1) * 16)),
                                     _mm_cvtsi32_si128(static_cast<int>(gi >> 1) * 2));
    const __m128i m15 = _mm_set1_epi8(0x0F), m3 = _mm_set1_epi8(3);
    const __m128i lo = _mm_or_si128(_mm_and_si128(nb, m15), _mm_slli_epi16(_mm_and_si128(hb, m3), 4));
    const __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(nb, 4), m15),
                                    _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 4), m3), 4));
    return {_mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(32)),
            _mm256_set_m128i(_mm_set1_epi16(s.s16[2 * g + 1]), _mm_set1_epi16(s.s16[2 * g])), s.d[g / 8]};
  }
  static inline __m256i products(__m256i w, __m256i a) { return Q8::products(w, a); }
};

// 5-bit groups (q5a8, GGUF Q5_0), a chunk of 4 groups in 80 bytes: two 64-bit words of fifth bits,
// then the 4 groups' nibbles as Q4's. Bit p of the first word is the fifth bit of nibble-vector position
// p (code p % 16 of the chunk's group p / 16), of the second the same for codes 16..31; the vnni path
// turns each word into a byte mask. A row's last groups, fewer than 4, are a chunk of their own (the
// two words, then their nibbles). The codes go in as c - 16 with Q8's sign trick.
struct Q5 {
  static constexpr int64_t kChunk = 80;
  static inline int64_t row_bytes(int64_t groups) {
    return groups / 4 * kChunk + (groups % 4 ? 16 + 16 * (groups % 4) : 0);
  }
  // the fifth bits of group gi of a chunk, bit j for code j
  static inline uint32_t fifth_bits(const uint8_t* chunk, int64_t gi) {
    uint64_t lo, hi;
    std::memcpy(&lo, chunk, 8);
    std::memcpy(&hi, chunk + 8, 8);
    return static_cast<uint32_t>((lo >> (16 * gi)) & 0xFFFF) | static_cast<uint32_t>(((hi >> (16 * gi)) & 0xFFFF) << 16);
  }
  static inline Group group(const uint8_t* wn, const RowScales& s, int64_t g) {
    const uint8_t* chunk = wn + (g / 4) * kChunk;
    const int64_t gi = g % 4;
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 16 + gi * 16));
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
    // bit j of the word -> 0x10 in byte j (llama.cpp's bytes_from_bits_32)
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(fifth_bits(chunk, gi))),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                          _mm256_set1_epi64x(-1));
    const __m256i codes = _mm256_or_si256(nibbles, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    return {_mm256_sub_epi8(codes, _mm256_set1_epi8(16)), _mm256_set1_epi16(1), s.d1(g)};
  }
  static inline __m256i products(__m256i w, __m256i a) { return Q8::products(w, a); }
};

template <class W> constexpr int64_t kGroupBytes = W::kBytes;
template <> constexpr int64_t kGroupBytes<Q5> = 20;
// the bytes of a row of codes
template <class W>
inline int64_t row_bytes(int64_t groups) {
  if constexpr (std::is_same_v<W, Q5>) return Q5::row_bytes(groups);
  else return groups * W::kBytes;
}

// one group of codes x 32 activation codes -> 8 lanes of partial integer sums, as floats (exact)
template <class W>
inline __m256 group_dot(const Group& w, const int8_t* q) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(W::products(w.w, a), w.mul));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum_g m[g] * sx[g]: eight groups a step, then the rest one by one (0 without mins)
inline float min_term(const RowScales& s, const float* sx, int64_t groups) {
  if (!s.has_mins()) return 0.f;
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) acc = _mm256_fmadd_ps(s.m8(g), _mm256_loadu_ps(sx + g), acc);
  float tail = 0.f;
  for (; g < groups; ++g) tail += s.m1(g) * sx[g];
  return hsum(acc) + tail;
}

// R rows (R <= kRowTile) against one output channel
template <class W, int R>
inline void tile(const uint8_t* wn, const RowScales& sn, const int8_t* q, const float* dx,
                 const float* sx, int64_t k, int64_t groups, float* y, int64_t ldy) {
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_ahead(wn + g * kGroupBytes<W>);
    const Group w = W::group(wn, sn, g);
    for (int i = 0; i < R; ++i) {
      const __m256 scale = _mm256_set1_ps(w.d * dx[i * groups + g]);
      acc[i] = _mm256_fmadd_ps(scale, group_dot<W>(w, q + i * k + g * kGroup), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) y[i * ldy] = hsum(acc[i]) + min_term(sn, sx + i * groups, groups);
}

// The outputs split between threads; within a thread's share, blocks of kRowBlock rows (their codes
// stay in cache while its outputs are swept), each output's weight row against tiles of at most `tile`
// rows: f(output, first row, rows in the tile). A tile runs each of its rows through the same sequence of
// operations whatever the tile's size, so how rows are grouped never changes a row's numbers.
template <class F>
void sweep(int64_t n_out, int64_t rows, int64_t grain, int64_t tile, const F& f) {
  at::parallel_for(0, n_out, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int64_t r1 = std::min(rows, r0 + kRowBlock);
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t r = r0; r < r1; r += tile) f(n, r, std::min(tile, r1 - r));
    }
  });
}

template <class W>
at::Tensor matmul(const at::Tensor& x, const at::Tensor& codes, const Scales& scales) {
  const int64_t rows = x.size(0), k = x.size(1), n_out = codes.size(0);
  TORCH_CHECK(k % kGroup == 0 && codes.size(1) == row_bytes<W>(k / kGroup), "w4a8: codes do not fit x's width");
  const int64_t groups = k / kGroup;
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous();
  at::Tensor y = at::empty({rows, n_out}, x.options());
  if (rows == 0 || n_out == 0) return y;
  const specstack_w4a8::Rounded rounded = specstack_w4a8::round_scratch(rows, k, 0);
  quantize_rows(xc.data_ptr<float>(), rows, k, rounded.q, rounded.dx, rounded.sx);
  const uint8_t* w = static_cast<const uint8_t*>(cc.data_ptr());
  const int8_t* qp = rounded.q;
  const float* dxp = rounded.dx;
  const float* sxp = rounded.sx;
  float* yp = y.data_ptr<float>();
  const int64_t stride = row_bytes<W>(groups);
  sweep(n_out, rows, 32, kRowTile, [&](int64_t n, int64_t r, int64_t left) {
    const uint8_t* wn = w + n * stride;
    const RowScales sn = scales.row(n, groups);
    const int8_t* qr = qp + r * k;
    const float* dxr = dxp + r * groups;
    const float* sxr = sxp + r * groups;
    float* yr = yp + r * n_out + n;
    by_rows<kRowTile>(left, [&](auto rt) { tile<W, decltype(rt)::value>(wn, sn, qr, dxr, sxr, k, groups, yr, n_out); });
  });
  return y;
}

// the per-group layout's scales, checked; the tensors stay alive in `keep`
Scales group_scales(const at::Tensor& codes, const at::Tensor& d, const at::Tensor* m, int64_t groups,
                    std::vector<at::Tensor>& keep) {
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.dim() == 2 && d.size(0) == codes.size(0) && d.size(1) == groups,
              "w4a8: scales must be float32 [out, in / 32]");
  keep.push_back(d.contiguous());
  Scales s;
  s.d = keep.back().data_ptr<float>();
  if (m != nullptr) {
    TORCH_CHECK(m->scalar_type() == at::kFloat && m->sizes() == d.sizes(), "w4a8 mm4: mins must be float32 like d");
    keep.push_back(m->contiguous());
    s.m = keep.back().data_ptr<float>();
  }
  return s;
}

// the super-block layout's scales (k4a8), checked
Scales super_scales(const at::Tensor& codes, const at::Tensor& sup, const at::Tensor& sub, int64_t groups,
                    std::vector<at::Tensor>& keep) {
  const int64_t n = codes.size(0);
  TORCH_CHECK(sub.scalar_type() == at::kByte && sub.dim() == 3 && sub.size(0) == n && sub.size(1) == 2 &&
                  sub.size(2) == groups, "k4a8: sub-scales must be uint8 [out, 2, in / 32]");
  TORCH_CHECK(sup.scalar_type() == at::kFloat && sup.dim() == 3 && sup.size(0) == n && sup.size(2) == 2 &&
                  sup.size(1) * 8 == groups,
              "k4a8: super-block scales must be float32 [out, in / 256, 2]");
  keep.push_back(sup.contiguous());
  keep.push_back(sub.contiguous());
  Scales s;
  s.sup = keep[keep.size() - 2].data_ptr<float>();
  s.sub = keep.back().data_ptr<uint8_t>();
  s.supers = sup.size(1);
  return s;
}

int64_t groups_of(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % kGroup == 0,
              "w4a8: x must be a 2-D float32 tensor [M, K] with K divisible by 32");
  return x.size(1) / kGroup;
}

void check_codes(const at::Tensor& codes, bool four) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == (four ? at::kByte : at::kChar),
              four ? "w4a8: packed codes (4-, 5- or 6-bit) must be 2-D uint8" : "w4a8 mm8: codes must be 2-D int8");
}

// ---------------------------------------------------------------------------------------------------
// The AVX-512-VNNI path (Intel Ice Lake and later, AMD Zen 4 and later): the same format and the same
// integer group sums, 64 products an instruction (vpdpbusd: unsigned weight bytes times signed
// activation bytes, summed in fours into int32 lanes). Compiled for its own target here (the library
// itself is -mavx2), used only where the CPU reports avx512_vnni (specstack/models/w4a8.py chooses).
//
// Why it is shaped so:
// - a lane's integer sum belongs to one group, so the float epilogue scales whole vectors of lanes
//   (one conversion and one FMA for 64 or 128 codes) and reduces the lanes once per output: no float
//   work per group and no horizontal sum per group, which is what bounds the avx2 path;
// - 4-bit codes: 64 packed bytes are 4 groups whose low nibbles (codes 0..15 of each) and high nibbles
//   (codes 16..31) form two byte vectors; the activations of a call are laid out in that order when
//   they are rounded (`interleave`), so the codes are never shuffled;
// - 8-bit codes: c + 128 (an xor) is the unsigned operand, and each lane's 128 * sum(q) is subtracted by
//   starting its accumulator at minus that, computed once per row of the call;
// - a row's output is the same sequence of operations whatever other rows share the call (rows are
//   tiled, never mixed), so this path is batch-invariant as the avx2 one is. Its fp32 rounding differs
//   from avx2's: a process uses one path (w4a8.py), so a model's numbers are that path's.

constexpr int64_t kVnniTile = 4;
  // rows a tile keeps in registers while a weight row streams

// sum_g m[g] * sx[g] in 16 lanes (masked tail), added to `acc` lane-wise
VNNI_FN inline __m512 min_lanes(const RowScales& s, const float* sx, int64_t groups, __m512 acc) {
  int64_t g = 0;
  if (s.sup != nullptr) {  // whole super-blocks of 8: M mn, 16 groups (two super-blocks) or 8 at a time
    for (; g + 16 <= groups; g += 16) {
      const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s.mn + g))));
      const __m512 big = _mm512_insertf32x8(_mm512_set1_ps(s.sup[2 * (g / 8) + 1]), _mm256_set1_ps(s.sup[2 * (g / 8) + 3]), 1);
      acc = _mm512_fmadd_ps(_mm512_mul_ps(big, mn), _mm512_loadu_ps(sx + g), acc);
    }
    if (g < groups) acc = _mm512_fmadd_ps(_mm512_zextps256_ps512(s.m8(g)), _mm512_zextps256_ps512(_mm256_loadu_ps(sx + g)), acc);
    return acc;
  }
  for (; g + 16 <= groups; g += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(s.m + g), _mm512_loadu_ps(sx + g), acc);
  if (g < groups) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (groups - g)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, s.m + g), _mm512_maskz_loadu_ps(mask, sx + g), acc);
  }
  return acc;
}

// 4 groups' scales from g (a multiple of 4; with super-blocks, all 4 in one)
VNNI_FN inline __m128 group_d4(const RowScales& s, int64_t g) {
  if (s.sup == nullptr) return _mm_loadu_ps(s.d + g);
  int32_t four;
  std::memcpy(&four, s.sc + g, 4);
  return _mm_mul_ps(_mm_set1_ps(s.sup[2 * (g / 8)]), _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(four))));
}

// 4 groups' row scales dx from x4 (a multiple of 4 groups in), each over the 4 lanes that hold its
// group's sums (idx: lane l takes group l / 4)
VNNI_FN inline __m512 spread4(__m512i idx, const float* x4) {
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(x4)));
}

// 4-bit groups, R rows against one output channel. q: the rows' interleaved codes (stride k).
template <int R>
VNNI_FN inline void tile4_vnni(const uint8_t* wn, const RowScales& sn, const int8_t* q,
                               const float* dx, const float* sx, int64_t k, int64_t groups,
                               float* y, int64_t ldy) {
  const int64_t chunks = groups / 4;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[R];
  __m128 tail[R];
  for (int i = 0; i < R; ++i) { acc[i] = _mm512_setzero_ps(); tail[i] = _mm_setzero_ps(); }
  for (int64_t c = 0; c < chunks; ++c) {
    prefetch_ahead(wn + c * 64);
    const __m512i raw = _mm512_loadu_si512(wn + c * 64);
    const __m512i low = _mm512_and_si512(raw, nib), high = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
    // the 4 groups' weight scales, one per 4 lanes (a lane's sum belongs to group lane / 4)
    const __m512 d16 = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(group_d4(sn, 4 * c)));
    for (int i = 0; i < R; ++i) {
      const int8_t* qc = q + i * k + c * 128;
      __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), low, _mm512_loadu_si512(qc));
      s = _mm512_dpbusd_epi32(s, high, _mm512_loadu_si512(qc + 64));
      const __m512 sc = _mm512_mul_ps(d16, spread4(idx, dx + i * groups + 4 * c));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc[i]);
    }
  }
  for (int64_t g = chunks * 4; g < groups; ++g) {  // groups past the last whole chunk: natural order
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wn + g * 16));
    const __m128i n4 = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(raw, n4), high = _mm_and_si128(_mm_srli_epi16(raw, 4), n4);
    for (int i = 0; i < R; ++i) {
      const int8_t* qg = q + i * k + g * kGroup;
      __m128i s = _mm_dpbusd_epi32(_mm_setzero_si128(), low, _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg)));
      s = _mm_dpbusd_epi32(s, high, _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16)));
      tail[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(s), _mm_set1_ps(sn.d1(g) * dx[i * groups + g]), tail[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    const __m512 all = min_lanes(sn, sx + i * groups, groups, acc[i]);
    y[i * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(all, _mm512_castps128_ps512(tail[i])));
  }
}

// 8-bit groups, R rows against one output channel. q natural order; neg: minus 128 * the sum of each
// lane's 4 activation codes (stride k / 4).
template <int R>
VNNI_FN inline void tile8_vnni(const uint8_t* wn, const float* dn, const int8_t* q, const int32_t* neg,
                               const float* dx, int64_t k, int64_t groups, float* y,
                               int64_t ldy) {
  const int64_t chunks = groups / 4;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i lo2 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i hi2 = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
  __m512 acc[R];
  __m256 tail[R];
  for (int i = 0; i < R; ++i) { acc[i] = _mm512_setzero_ps(); tail[i] = _mm256_setzero_ps(); }
  for (int64_t c = 0; c < chunks; ++c) {
    prefetch_ahead(wn + c * 128);
    prefetch_ahead(wn + c * 128 + 64);
    const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(wn + c * 128), flip);
    const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(wn + c * 128 + 64), flip);
    const __m512 d4 = _mm512_castps128_ps512(_mm_loadu_ps(dn + 4 * c));
    const __m512 d0 = _mm512_permutexvar_ps(lo2, d4), d1 = _mm512_permutexvar_ps(hi2, d4);
    for (int i = 0; i < R; ++i) {
      const int8_t* qc = q + i * k + c * 128;
      const int32_t* nc = neg + i * (k / 4) + c * 32;
      const __m512i s0 = _mm512_dpbusd_epi32(_mm512_loadu_si512(nc), w0, _mm512_loadu_si512(qc));
      const __m512i s1 = _mm512_dpbusd_epi32(_mm512_loadu_si512(nc + 16), w1, _mm512_loadu_si512(qc + 64));
      const __m512 x4 = _mm512_castps128_ps512(_mm_loadu_ps(dx + i * groups + 4 * c));  // 8 lanes a group here
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d0, _mm512_permutexvar_ps(lo2, x4)), acc[i]);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d1, _mm512_permutexvar_ps(hi2, x4)), acc[i]);
    }
  }
  const __m256i flip8 = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = chunks * 4; g < groups; ++g) {
    const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wn + g * kGroup)), flip8);
    for (int i = 0; i < R; ++i) {
      const __m256i s = _mm256_dpbusd_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(neg + i * (k / 4) + g * 8)), w,
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * k + g * kGroup)));
      tail[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dn[g] * dx[i * groups + g]), tail[i]);
    }
  }
  for (int i = 0; i < R; ++i) y[i * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], _mm512_castps256_ps512(tail[i])));
}

// 6-bit groups (k6a8), R rows against one output channel. q: the rows' interleaved codes (as mm4's);
// neg: minus 32 * the sum of each lane's 4 activation codes (stride k / 4), so a lane's vpdpbusd sum is
// sum (c - 32) q over its 4 codes, |.| <= 4 * 32 * 127: the two 16-code halves of each group are packed
// to int16 side by side (vpackssdw, exact) and vpmaddwd multiplies each by its scale and adds pairs,
// leaving 4 lanes a group as mm4 has them (so the same dx lanes).
template <int R>
VNNI_FN inline void tile6_vnni(const uint8_t* wn, const RowScales& sn, const int8_t* q, const int32_t* neg,
                               const float* dx, int64_t k, int64_t groups, float* y, int64_t ldy) {
  const int64_t chunks = groups / 4;
  const __m512i nib = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  // int16 element e of 32 takes scale (e / 8) * 2 + (e % 8 >= 4) of the chunk's 8
  const __m512i spread = _mm512_set_epi16(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4,
                                          3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    prefetch_ahead(wn + c * 96);
    prefetch_ahead(wn + c * 96 + 64);
    const uint8_t* base = wn + c * 96;
    const __m512i raw = _mm512_loadu_si512(base);
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 64));
    // the plane's fields moved to bits 4-5 of each byte (a 16-bit shift moves no field of one byte onto
    // bits 4-5 of the other), then masked in: low = nibble | (h & 3) << 4, high = nibble | (h >> 4 & 3) << 4
    // (0xF8: a ternary-logic select, bits 0-3 from the first operand and the rest from the second's 0x30)
    const __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(hb), _mm256_srli_epi16(hb, 2), 1);
    const __m512i low = _mm512_ternarylogic_epi32(_mm512_and_si512(raw, nib), _mm512_slli_epi16(h, 4), top, 0xF8);
    const __m512i high = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(raw, 4), nib), h, top, 0xF8);
    const __m128i s8 = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sn.s16 + 8 * c)));
    const __m512i sc = _mm512_permutexvar_epi16(spread, _mm512_castsi128_si512(s8));
    const __m512 big = _mm512_set1_ps(sn.d[c / 2]);
    for (int i = 0; i < R; ++i) {
      const int8_t* qc = q + i * k + c * 128;
      const int32_t* nc = neg + i * (k / 4) + c * 32;
      const __m512i s0 = _mm512_dpbusd_epi32(_mm512_loadu_si512(nc), low, _mm512_loadu_si512(qc));
      const __m512i s1 = _mm512_dpbusd_epi32(_mm512_loadu_si512(nc + 16), high, _mm512_loadu_si512(qc + 64));
      const __m512i t = _mm512_madd_epi16(_mm512_packs_epi32(s0, s1), sc);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(big, spread4(idx, dx + i * groups + 4 * c)), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) y[i * ldy] = _mm512_reduce_add_ps(acc[i]);
}

// 5-bit groups (q5a8), R rows against one output channel. q: the rows' interleaved codes (as mm4's);
// neg: minus 16 * the sum of each lane's 4 activation codes (stride k / 4). A chunk's two words of fifth
// bits are byte masks of its two nibble vectors (a masked add of 16), so a lane's vpdpbusd sums start
// from both its halves' offsets and end as sum (c - 16) q over the group's 8 codes it holds.
template <int R>
VNNI_FN inline void tile5_vnni(const uint8_t* wn, const RowScales& sn, const int8_t* q, const int32_t* neg,
                               const float* dx, int64_t k, int64_t groups, float* y,
                               int64_t ldy) {
  const int64_t chunks = groups / 4;
  const __m512i nib = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
  const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[R];
  __m128 tail[R];
  for (int i = 0; i < R; ++i) { acc[i] = _mm512_setzero_ps(); tail[i] = _mm_setzero_ps(); }
  for (int64_t c = 0; c < chunks; ++c) {
    prefetch_ahead(wn + c * Q5::kChunk);
    prefetch_ahead(wn + c * Q5::kChunk + 64);
    const uint8_t* base = wn + c * Q5::kChunk;
    uint64_t lo, hi;
    std::memcpy(&lo, base, 8);
    std::memcpy(&hi, base + 8, 8);
    const __m512i raw = _mm512_loadu_si512(base + 16);
    const __m512i l4 = _mm512_and_si512(raw, nib), h4 = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
    const __m512i low = _mm512_mask_add_epi8(l4, _cvtu64_mask64(lo), l4, sixteen);
    const __m512i high = _mm512_mask_add_epi8(h4, _cvtu64_mask64(hi), h4, sixteen);
    const __m512 d16 = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(sn.d + 4 * c)));
    for (int i = 0; i < R; ++i) {
      const int8_t* qc = q + i * k + c * 128;
      const int32_t* nc = neg + i * (k / 4) + c * 32;
      __m512i s = _mm512_add_epi32(_mm512_loadu_si512(nc), _mm512_loadu_si512(nc + 16));
      s = _mm512_dpbusd_epi32(s, low, _mm512_loadu_si512(qc));
      s = _mm512_dpbusd_epi32(s, high, _mm512_loadu_si512(qc + 64));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d16, spread4(idx, dx + i * groups + 4 * c)), acc[i]);
    }
  }
  const uint8_t* last = wn + chunks * Q5::kChunk;  // the last groups: natural order, a chunk of their own
  for (int64_t g = chunks * 4; g < groups; ++g) {
    const int64_t gi = g - chunks * 4;
    const uint32_t bits = Q5::fifth_bits(last, gi);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(last + 16 + gi * 16));
    const __m128i n4 = _mm_set1_epi8(0x0F), s16 = _mm_set1_epi8(16);
    const __m128i l4 = _mm_and_si128(raw, n4), h4 = _mm_and_si128(_mm_srli_epi16(raw, 4), n4);
    const __m128i low = _mm_mask_add_epi8(l4, static_cast<__mmask16>(bits & 0xFFFF), l4, s16);
    const __m128i high = _mm_mask_add_epi8(h4, static_cast<__mmask16>(bits >> 16), h4, s16);
    for (int i = 0; i < R; ++i) {
      const int8_t* qg = q + i * k + g * kGroup;
      const int32_t* ng = neg + i * (k / 4) + g * 8;
      __m128i s = _mm_add_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ng)),
                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(ng + 4)));
      s = _mm_dpbusd_epi32(s, low, _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg)));
      s = _mm_dpbusd_epi32(s, high, _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16)));
      tail[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(s), _mm_set1_ps(sn.d[g] * dx[i * groups + g]), tail[i]);
    }
  }
  for (int i = 0; i < R; ++i) y[i * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], _mm512_castps128_ps512(tail[i])));
}

// `times` * (the sum of each 4 consecutive codes) of a row's codes, in their stored order
VNNI_FN void lane_offsets(const int8_t* q, int64_t n, int32_t times, int32_t* neg) {
  const __m512i ones = _mm512_set1_epi8(1);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(q + i));
    _mm512_storeu_si512(neg + i / 4, _mm512_mullo_epi32(s, _mm512_set1_epi32(times)));
  }
  for (; i < n; i += 4) neg[i / 4] = times * (q[i] + q[i + 1] + q[i + 2] + q[i + 3]);
}

// the weight groups a vnni matmul takes
enum class Bits { kFour, kFive, kSix, kEight };

template <Bits B>
at::Tensor matmul_vnni(const at::Tensor& x, const at::Tensor& codes, const Scales& scales) {
  constexpr bool kEight = B == Bits::kEight;  // natural order, 8 lanes a group; else interleaved, 4
  const int64_t rows = x.size(0), k = x.size(1), n_out = codes.size(0);
  TORCH_CHECK(k % kGroup == 0, "w4a8: x's width must be a multiple of 32");
  const int64_t groups = k / kGroup;
  const int64_t row_bytes = B == Bits::kFour ? groups * kGroup / 2 : B == Bits::kFive ? Q5::row_bytes(groups)
                            : B == Bits::kSix ? groups * 24 : groups * kGroup;
  TORCH_CHECK(codes.size(1) == row_bytes, "w4a8: codes do not fit x's width");
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous();
  at::Tensor y = at::empty({rows, n_out}, x.options());
  if (rows == 0 || n_out == 0) return y;
  const specstack_w4a8::Rounded rounded = specstack_w4a8::round_scratch(rows, k, B == Bits::kFour ? 0 : k / 4);
  const float* xp = xc.data_ptr<float>();
  int8_t* qw = rounded.q;
  float* dxw = rounded.dx;
  float* sxw = rounded.sx;
  int32_t* negw = rounded.ints;  // the offsets' lane sums (not the 4-bit format's)
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {  // the rows' rounding, each row on its own
    for (int64_t r = r0; r < r1; ++r) {
      specstack_w4a8::quantize_row_vnni(xp + r * k, k, qw + r * k, dxw + r * groups, sxw + r * groups, !kEight);
      if (B != Bits::kFour) lane_offsets(qw + r * k, k, kEight ? -128 : B == Bits::kSix ? -32 : -16, negw + r * (k / 4));
    }
  });
  const uint8_t* w = static_cast<const uint8_t*>(cc.data_ptr());
  float* yp = y.data_ptr<float>();
  sweep(n_out, rows, 16, kVnniTile, [&](int64_t n, int64_t r, int64_t left) {
    const uint8_t* wn = w + n * row_bytes;
    const RowScales sn = scales.row(n, groups);
    const int8_t* qr = qw + r * k;
    const float* dxr = dxw + r * groups;
    const int32_t* nr = negw + r * (k / 4);
    float* yr = yp + r * n_out + n;
    by_rows<kVnniTile>(left, [&](auto rt) {
      constexpr int R = decltype(rt)::value;
      if constexpr (B == Bits::kFour) tile4_vnni<R>(wn, sn, qr, dxr, sxw + r * groups, k, groups, yr, n_out);
      else if constexpr (B == Bits::kFive) tile5_vnni<R>(wn, sn, qr, nr, dxr, k, groups, yr, n_out);
      else if constexpr (B == Bits::kSix) tile6_vnni<R>(wn, sn, qr, nr, dxr, k, groups, yr, n_out);
      else tile8_vnni<R>(wn, sn.d, qr, nr, dxr, k, groups, yr, n_out);
    });
  });
  return y;
}

// A path's rounding of the activations alone, in natural order (the tests hold each to the reference's,
// bit for bit)
void round_avx2(const float* x, int64_t k, int8_t* q, float* dx, float* sx) { quantize_rows(x, 1, k, q, dx, sx); }
void round_vnni(const float* x, int64_t k, int8_t* q, float* dx, float* sx) { specstack_w4a8::quantize_row_vnni(x, k, q, dx, sx, false); }

template <void (*Round)(const float*, int64_t, int8_t*, float*, float*)>
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_op(const at::Tensor& x) {
  const int64_t groups = groups_of(x);
  const at::Tensor xc = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({rows, k}, x.options().dtype(at::kChar));
  at::Tensor dx = at::empty({rows, groups}, x.options());
  at::Tensor sx = at::empty({rows, groups}, x.options());
  for (int64_t r = 0; r < rows; ++r)
    Round(xc.data_ptr<float>() + r * k, k, q.data_ptr<int8_t>() + r * k, dx.data_ptr<float>() + r * groups,
          sx.data_ptr<float>() + r * groups);
  return {q, dx, sx};
}

// The ops of one path (its 4-bit and 8-bit matmuls), checked alike: per-group scales (mm4, mm8) or
// Q4_K's super-blocks (mm4k).
// the k6a8 layout's scales (GGUF Q6_K), checked
Scales six_scales(const at::Tensor& codes, const at::Tensor& big, const at::Tensor& s16, int64_t groups,
                  std::vector<at::Tensor>& keep) {
  const int64_t n = codes.size(0);
  TORCH_CHECK(groups % 8 == 0, "k6a8: in_features must be a multiple of 256");
  TORCH_CHECK(big.scalar_type() == at::kFloat && big.dim() == 2 && big.size(0) == n && big.size(1) * 8 == groups,
              "k6a8: super-block scales must be float32 [out, in / 256]");
  TORCH_CHECK(s16.scalar_type() == at::kChar && s16.dim() == 2 && s16.size(0) == n && s16.size(1) == 2 * groups,
              "k6a8: sub-block scales must be int8 [out, in / 16]");
  keep.push_back(big.contiguous());
  keep.push_back(s16.contiguous());
  Scales s;
  s.d = keep[keep.size() - 2].data_ptr<float>();
  s.s16 = keep.back().data_ptr<int8_t>();
  s.supers = big.size(1);
  return s;
}

using MatmulFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const Scales&);

template <MatmulFn MM4, MatmulFn MM8, MatmulFn MM6, MatmulFn MM5>
struct PathOps {
  static at::Tensor mm5(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d) {
    std::vector<at::Tensor> keep;
    check_codes(codes, true);
    return MM5(x, codes, group_scales(codes, d, nullptr, groups_of(x), keep));
  }
  static at::Tensor mm4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
    std::vector<at::Tensor> keep;
    check_codes(codes, true);
    return MM4(x, codes, group_scales(codes, d, &m, groups_of(x), keep));
  }
  static at::Tensor mm4k(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sup, const at::Tensor& sub) {
    std::vector<at::Tensor> keep;
    check_codes(codes, true);
    return MM4(x, codes, super_scales(codes, sup, sub, groups_of(x), keep));
  }
  static at::Tensor mm8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d) {
    std::vector<at::Tensor> keep;
    check_codes(codes, false);
    return MM8(x, codes, group_scales(codes, d, nullptr, groups_of(x), keep));
  }
  static at::Tensor mm6k(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& big, const at::Tensor& s16) {
    std::vector<at::Tensor> keep;
    check_codes(codes, true);
    return MM6(x, codes, six_scales(codes, big, s16, groups_of(x), keep));
  }
};
using Avx2Ops = PathOps<matmul<Q4>, matmul<Q8>, matmul<Q6>, matmul<Q5>>;
using VnniOps = PathOps<matmul_vnni<Bits::kFour>, matmul_vnni<Bits::kEight>, matmul_vnni<Bits::kSix>,
                        matmul_vnni<Bits::kFive>>;

}  // namespace

TORCH_LIBRARY(specstack_w4a8, lib) {
  lib.def("mm4(Tensor x, Tensor codes, Tensor d, Tensor m) -> Tensor");
  lib.def("mm8(Tensor x, Tensor codes, Tensor d) -> Tensor");
  lib.def("quantize(Tensor x) -> (Tensor, Tensor, Tensor)");
  lib.def("mm4k(Tensor x, Tensor codes, Tensor sup, Tensor sub) -> Tensor");
  lib.def("mm4_vnni(Tensor x, Tensor codes, Tensor d, Tensor m) -> Tensor");
  lib.def("mm4k_vnni(Tensor x, Tensor codes, Tensor sup, Tensor sub) -> Tensor");
  lib.def("mm8_vnni(Tensor x, Tensor codes, Tensor d) -> Tensor");
  lib.def("quantize_vnni(Tensor x) -> (Tensor, Tensor, Tensor)");
  lib.def("mm6k(Tensor x, Tensor codes, Tensor big, Tensor s16) -> Tensor");
  lib.def("mm6k_vnni(Tensor x, Tensor codes, Tensor big, Tensor s16) -> Tensor");
  lib.def("mm5(Tensor x, Tensor codes, Tensor d) -> Tensor");
  lib.def("mm5_vnni(Tensor x, Tensor codes, Tensor d) -> Tensor");
  lib.def("set_prefetch(int bytes) -> int", &specstack_w4a8::set_prefetch);
}

TORCH_LIBRARY_IMPL(specstack_w4a8, CPU, lib) {
  lib.impl("mm4", &Avx2Ops::mm4);
  lib.impl("mm8", &Avx2Ops::mm8);
  lib.impl("quantize", &quantize_op<round_avx2>);
  lib.impl("mm4k", &Avx2Ops::mm4k);
  lib.impl("mm4_vnni", &VnniOps::mm4);
  lib.impl("mm4k_vnni", &VnniOps::mm4k);
  lib.impl("mm8_vnni", &VnniOps::mm8);
  lib.impl("quantize_vnni", &quantize_op<round_vnni>);
  lib.impl("mm6k", &Avx2Ops::mm6k);
  lib.impl("mm6k_vnni", &VnniOps::mm6k);
  lib.impl("mm5", &Avx2Ops::mm5);
  lib.impl("mm5_vnni", &VnniOps::mm5);
}
