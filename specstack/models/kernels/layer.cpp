// The decoder's blocks in one call a forward (specstack/models/native_decoder.py says where it runs): a
// Block.forward of specstack/models/transformer.py for every layer, the same ATen operations in the same
// order on the same tensors, the linears through the w4a8 library's ops and attention through the
// fixed-order kernel's (both looked up once through the dispatcher), so a token's numbers are the eager
// blocks' bit for bit.
//
// Why it exists: a one-token step of a small model is dozens of small torch calls a layer, each paying
// Python's argument parsing and dispatch (microseconds) on top of its work, where the weights' read
// is tens of microseconds a layer. Here Python pays one call a forward, and the block's row operations
// (RMSNorm, the rotation, the SiLU-gated product, bias and residual adds, the cache's writes) are plain
// loops on the rows, without ATen's dispatch and allocations: the eager blocks call the same loops as
// ops (`rms_norm`, `rope`, `silu_mul`: models/row_ops.py), so both compute the same numbers.
// Built once per machine by specstack/models/native.py; it needs the w4a8 and attention libraries loaded.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "vec_math.h"

namespace {

using at::indexing::Slice;

c10::OperatorHandle find_op(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "");
}

using specstack_vec::exp8;
using specstack_vec::hsum;
constexpr int64_t kLanes = 8;
constexpr int64_t kRowWork = 1 << 15;  // floats a task of a row operation's parallel_for takes at least

// f(r0, r1) over rows 0..n of d floats each, split over threads for long calls only (a row's numbers
// never depend on the split: every row is computed on its own)
template <class F>
void over_rows(int64_t n, int64_t d, const F& f) {
  if (n * d <= kRowWork) return f(0, n);  // a decode step's rows: no parallel region to enter
  at::parallel_for(0, n, std::max<int64_t>(1, kRowWork / std::max<int64_t>(d, 1)), f);
}

// RMSNorm of rows x [n, d] (contiguous) into y: y = (x r) w with r = 1 / sqrt(sum(x^2) / d + eps), the sum
// 8 lanes each over its columns in order, the lanes in one fixed order, then the tail columns in order.
void rms_rows(const float* x, const float* w, int64_t n, int64_t d, float eps, float* y) {
  for (int64_t i = 0; i < n; ++i) {
    const float* xr = x + i * d;
    float* yr = y + i * d;
    __m256 acc = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + kLanes <= d; c += kLanes) {
      const __m256 v = _mm256_loadu_ps(xr + c);
      acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    float ss = hsum(acc);
    for (; c < d; ++c) ss += xr[c] * xr[c];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
    const __m256 rv = _mm256_set1_ps(r);
    for (c = 0; c + kLanes <= d; c += kLanes)
      _mm256_storeu_ps(yr + c, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + c), rv), _mm256_loadu_ps(w + c)));
    for (; c < d; ++c) yr[c] = (xr[c] * r) * w[c];
  }
}

// The rotation of one head's d floats: y = fma(roll(x, d / 2), sin, x cos) (sin signed: [-sin | sin]),
// the numbers of torch's addcmul(x * cos, x.roll(d / 2), sin), which fuses its multiply-add, bit for bit
void rope_head(const float* x, const float* cs, const float* sn, int64_t d, float* y) {
  const int64_t half = d / 2;
  int64_t j = 0;
  if (half % kLanes == 0) {
    for (; j < d; j += kLanes) {
      const __m256 rot = _mm256_loadu_ps(x + (j < half ? j + half : j - half));
      const __m256 xc = _mm256_mul_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(cs + j));
      _mm256_storeu_ps(y + j, _mm256_fmadd_ps(rot, _mm256_loadu_ps(sn + j), xc));
    }
  }
  for (; j < d; ++j) y[j] = std::fma(x[j < half ? j + half : j - half], sn[j], x[j] * cs[j]);
}

// silu(g) u of rows h [n, 2f] = [g | u] (contiguous) into y [n, f]: (g / (1 + exp(-g))) u, exp8's exp
void silu_mul_rows(const float* h, int64_t n, int64_t f, float* y) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float* g = h + i * 2 * f;
    const float* u = g + f;
    float* yr = y + i * f;
    int64_t c = 0;
    for (; c + kLanes <= f; c += kLanes) {
      const __m256 gv = _mm256_loadu_ps(g + c);
      const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, sign))));
      _mm256_storeu_ps(yr + c, _mm256_mul_ps(s, _mm256_loadu_ps(u + c)));
    }
    if (c < f) {  // the tail through the same vector operations, padded
      alignas(32) float gt[kLanes] = {}, ut[kLanes] = {}, yt[kLanes];
      std::copy(g + c, g + f, gt);
      std::copy(u + c, u + f, ut);
      const __m256 gv = _mm256_load_ps(gt);
      const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, sign))));
      _mm256_store_ps(yt, _mm256_mul_ps(s, _mm256_load_ps(ut)));
      std::copy(yt, yt + (f - c), yr + c);
    }
  }
}

// y += a elementwise (a bias of y's width broadcast over its rows when a has fewer elements): exact, as
// ATen's add is, whichever operand comes first
void add_into(at::Tensor& y, const at::Tensor& a) {
  float* yp = y.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const int64_t m = a.numel();
  if (m == 0) return;  // nothing to add (no rows)
  for (int64_t r = 0; r < y.numel() / m; ++r)
    for (int64_t j = 0; j < m; ++j) yp[r * m + j] += ap[j];
}

bool plain_floats(const at::Tensor& t) { return t.scalar_type() == at::kFloat && t.is_contiguous(); }

// -- the row operations as ops (models/row_ops.py): float32 tensors on the CPU --------------------------

// x [..., d] normalised over its last dimension with weight w [d]
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.dim() == 1 && x.dim() >= 1 &&
                  x.size(-1) == w.size(0), "rms_norm: float32 x [..., d] and w [d]");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty(xc.sizes(), xc.options());
  const int64_t d = w.size(0), n = d ? xc.numel() / d : 0;
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  over_rows(n, d, [&](int64_t r0, int64_t r1) { rms_rows(xp + r0 * d, wp, r1 - r0, d, static_cast<float>(eps), yp + r0 * d); });
  return y;
}

// x [B, T, H, D] rotated by the rows cos, sin [B, T, 1, D] of its tokens; contiguous out
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && x.size(3) % 2 == 0,
              "rope: float32 x [B, T, H, D] with D even");
  const int64_t b = x.size(0), t = x.size(1), h = x.size(2), d = x.size(3);
  TORCH_CHECK(cos.dim() == 4 && cos.size(0) == b && cos.size(1) == t && cos.size(2) == 1 && cos.size(3) == d &&
                  sin.sizes() == cos.sizes(), "rope: cos and sin [B, T, 1, D] for x [B, T, H, D]");
  const at::Tensor xc = x.stride(3) == 1 ? x : x.contiguous();
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor y = at::empty({b, t, h, d}, x.options());
  const float *xp = xc.data_ptr<float>(), *cp = cc.data_ptr<float>(), *sp = sc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t s0 = xc.stride(0), s1 = xc.stride(1), s2 = xc.stride(2);
  over_rows(b * t, h * d, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < h; ++j)
        rope_head(xp + (r / t) * s0 + (r % t) * s1 + j * s2, cp + r * d, sp + r * d, d, yp + (r * h + j) * d);
  });
  return y;
}

// h [..., 2F] = [gate | up] -> silu(gate) up [..., F]
at::Tensor silu_mul(const at::Tensor& h) {
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.dim() >= 1 && h.size(-1) % 2 == 0,
              "silu_mul: float32 h [..., 2F]");
  const at::Tensor hc = h.contiguous();
  const int64_t f = h.size(-1) / 2, n = f ? hc.numel() / (2 * f) : 0;
  std::vector<int64_t> shape(hc.sizes().begin(), hc.sizes().end());
  shape.back() = f;
  at::Tensor y = at::empty(shape, hc.options());
  const float* hp = hc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  over_rows(n, 2 * f, [&](int64_t r0, int64_t r1) { silu_mul_rows(hp + r0 * 2 * f, r1 - r0, f, yp + r0 * f); });
  return y;
}

// transformer.py's Norm: the RMSNorm above, or a LayerNorm
at::Tensor norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps, bool rms) {
  if (rms) return rms_norm(x, w, eps);
  return at::layer_norm(x, {w.size(0)}, w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt, eps);
}

// One linear: its w4a8 op (x, codes, scales[, third]) -> y, and its bias added in place after it, as
// GroupMethod's bound forward does.
struct Linear {
  std::optional<c10::OperatorHandle> op;
  std::vector<at::Tensor> tensors;
  at::Tensor bias;  // undefined: none

  at::Tensor operator()(const at::Tensor& x) const {
    torch::jit::Stack stack;
    stack.reserve(tensors.size() + 1);
    stack.emplace_back(x.contiguous());
    for (const at::Tensor& t : tensors) stack.emplace_back(t);
    op->callBoxed(&stack);
    at::Tensor y = std::move(stack[0]).toTensor();
    if (bias.defined()) {
      if (plain_floats(y) && plain_floats(bias)) add_into(y, bias);
      else y.add_(bias);
    }
    return y;
  }
};

// x + y, into y (a fresh output of a linear): the residual stream's add
at::Tensor residual(const at::Tensor& x, at::Tensor y) {
  if (plain_floats(x) && plain_floats(y) && x.sizes() == y.sizes()) {
    add_into(y, x);
    return y;
  }
  return x + y;
}

struct Layer {
  int64_t nq, nkv, hd, q_dim, kv_dim;
  bool rms, gated;
  double eps;
  Linear qkv, o, up, down;
  at::Tensor attn_w, attn_b, mlp_w, mlp_b, q_norm, k_norm;  // undefined: none
};

// One run of rows of a packed block attended in one call: attention.py's RowRun
struct Run {
  int64_t start, stop, tokens, first, keys;
  bool causal;
  at::Tensor mask, gather, real;  // undefined: none
};

// What one forward's layers share: the rotation rows, where the cache takes the block's keys and values,
// and the attention's mask (a [B, T] block) or runs (a packed one).
struct Step {
  at::Tensor cos, sin;  // [B, T, 1, D], undefined without rotary positions
  at::Tensor k_all, v_all;  // the cache [layers, rows, Hkv, S, D]
  at::Tensor write_idx;  // slots of the one row's block (index_copy_), or undefined: rows, slots
  at::Tensor rows, slots;  // (row, slot) of each token of several rows
  bool one_row;  // several rows allocated, one live: write row 0 only
  int64_t b, t, s_used, live;  // live: the cache's rows (b = 1 for a packed block)
  at::Tensor mask;  // undefined: none
  bool is_causal;
  std::vector<Run> runs;  // empty: a [B, T] block
  c10::OperatorHandle attention;
};

// The block's keys and values into the cache's slots (cache.py's KVCache.write): token i of the block (qk
// [n, nq + nkv, hd] contiguous, roped; v the value columns of h [n, ...]) goes to row rows[i], slot slots[i]
// (several rows), or, without rows, to row i / t, slot slots[i % t] (the one-row layout's write_idx). A
// copy, as index_copy_ and index_put_ are.
void write_kv(const at::Tensor& kl, const at::Tensor& vl, const at::Tensor& qk, const at::Tensor& h, int64_t v_col,
              const int64_t* rows, const int64_t* slots, int64_t n, int64_t t, int64_t nq, int64_t nkv, int64_t hd) {
  const float* qp = qk.data_ptr<float>();
  const float* hp = h.data_ptr<float>();
  float* kp = kl.data_ptr<float>();
  float* vp = vl.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = rows ? rows[i] : i / t, slot = rows ? slots[i] : slots[i % t];
    for (int64_t j = 0; j < nkv; ++j) {
      std::copy_n(qp + (i * (nq + nkv) + nq + j) * hd, hd, kp + row * kl.stride(0) + j * kl.stride(1) + slot * kl.stride(2));
      std::copy_n(hp + i * h.stride(0) + v_col + j * hd, hd, vp + row * vl.stride(0) + j * vl.stride(1) + slot * vl.stride(2));
    }
  }
}

bool plain_index(const at::Tensor& t) { return t.defined() && t.scalar_type() == at::kLong && t.is_contiguous(); }

using AttentionCall = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                 bool);

at::Tensor attention_call(const Step& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& mask, bool causal) {
  return s.attention.typed<AttentionCall>().call(q, k, v, mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt,
                                                 causal);
}

// attention.py's attend over a packed block's runs: q [N, nq, hd] (the block's queries, packed), keys and
// values [live rows, Hkv, S, D] -> [N, nq, hd], one call a run, a padded run's queries gathered and its
// real outputs kept
at::Tensor attend_runs(const Step& s, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values) {
  const int64_t h = q.size(1), d = q.size(2);
  at::Tensor out = at::empty(q.sizes(), q.options());
  for (const Run& r : s.runs) {
    const int64_t rows = r.stop - r.start, n = r.tokens;
    const at::Tensor kr = keys.slice(0, r.start, r.stop).slice(2, 0, r.keys);
    const at::Tensor vr = values.slice(0, r.start, r.stop).slice(2, 0, r.keys);
    const at::Tensor qr = (r.gather.defined() ? q.index_select(0, r.gather) : q.slice(0, r.first, r.first + rows * n))
                              .view({rows, n, h, d}).transpose(1, 2);
    const at::Tensor a = attention_call(s, qr, kr, vr, r.mask, r.causal).transpose(1, 2).reshape({rows * n, h, d});
    if (r.gather.defined()) out.slice(0, r.first, r.first + r.real.size(0)).copy_(a.index_select(0, r.real));
    else out.slice(0, r.first, r.first + rows * n).copy_(a);
  }
  return out;
}

at::Tensor block(const Layer& L, int64_t layer, at::Tensor x, const Step& s) {
  const int64_t b = s.b, t = s.t;
  const at::Tensor h = L.qkv(norm(x, L.attn_w, L.attn_b, L.eps, L.rms));
  at::Tensor qk = h.slice(1, 0, L.q_dim + L.kv_dim).view({b, t, L.nq + L.nkv, L.hd});
  if (L.q_norm.defined())
    qk = at::cat({rms_norm(qk.slice(2, 0, L.nq), L.q_norm, L.eps), rms_norm(qk.slice(2, L.nq), L.k_norm, L.eps)}, 2);
  if (s.cos.defined()) qk = rope(qk, s.cos, s.sin);
  // cache.py's KVCache.write
  at::Tensor kl = s.k_all.select(0, layer), vl = s.v_all.select(0, layer);
  const bool several = !s.write_idx.defined();
  if (qk.is_contiguous() && h.stride(1) == 1 && kl.scalar_type() == at::kFloat && vl.scalar_type() == at::kFloat &&
      kl.stride(3) == 1 && vl.stride(3) == 1 &&
      (several ? plain_index(s.rows) && plain_index(s.slots) : plain_index(s.write_idx))) {
    write_kv(kl, vl, qk, h, L.q_dim + L.kv_dim, several ? s.rows.data_ptr<int64_t>() : nullptr,
             (several ? s.slots : s.write_idx).data_ptr<int64_t>(), b * t, t, L.nq, L.nkv, L.hd);
  } else {
    const at::Tensor k = qk.slice(2, L.nq).transpose(1, 2).to(kl.scalar_type());
    const at::Tensor v = h.slice(1, L.q_dim + L.kv_dim).view({b, t, L.nkv, L.hd}).transpose(1, 2).to(vl.scalar_type());
    if (!several) {
      (s.one_row ? kl.slice(0, 0, 1) : kl).index_copy_(2, s.write_idx, k);
      (s.one_row ? vl.slice(0, 0, 1) : vl).index_copy_(2, s.write_idx, v);
    } else {
      kl.index_put_({s.rows, Slice(), s.slots}, k.transpose(1, 2).reshape({-1, L.nkv, L.hd}));
      vl.index_put_({s.rows, Slice(), s.slots}, v.transpose(1, 2).reshape({-1, L.nkv, L.hd}));
    }
  }
  const at::Tensor keys = kl.slice(0, 0, s.live).slice(2, 0, s.s_used);
  const at::Tensor values = vl.slice(0, 0, s.live).slice(2, 0, s.s_used);
  // attention.py's attend with the fixed-order kernel: one block of rows, or a packed block's runs
  const at::Tensor q = qk.slice(2, 0, L.nq).to(keys.scalar_type());
  const at::Tensor a = s.runs.empty()
                           ? attention_call(s, q.transpose(1, 2), keys, values, s.mask, s.is_causal).transpose(1, 2)
                           : attend_runs(s, q.select(0, 0), keys, values);
  x = residual(x, L.o(a.reshape({b * t, L.nq * L.hd}).to(x.scalar_type())));
  const at::Tensor m = L.up(norm(x, L.mlp_w, L.mlp_b, L.eps, L.rms));
  return residual(x, L.down(L.gated ? silu_mul(m) : at::gelu(m, "tanh")));
}

at::Tensor optional_tensor(const at::Tensor& t) { return t.numel() ? t : at::Tensor(); }

class Decoder : public torch::CustomClassHolder {
 public:
  // dims: n_heads, n_kv_heads, head_dim, q_dim, kv_dim, rms (0/1), gated (0/1); ops: the 4 linears' op
  // names (qkv, o, up, down); tensors: their stored tensors in that order, counts[i] of them for linear
  // i; biases: 4 (empty: none); norms: attn weight, attn bias, mlp weight, mlp bias, q norm, k norm
  // (empty: none).
  void add_layer(std::vector<int64_t> dims, double eps, std::vector<std::string> ops, std::vector<at::Tensor> tensors,
                 std::vector<int64_t> counts, std::vector<at::Tensor> biases, std::vector<at::Tensor> norms) {
    TORCH_CHECK(dims.size() == 7 && ops.size() == 4 && counts.size() == 4 && biases.size() == 4 && norms.size() == 6,
                "Decoder.add_layer: 7 dims, 4 ops, 4 counts, 4 biases and 6 norms");
    Layer L;
    L.nq = dims[0];
    L.nkv = dims[1];
    L.hd = dims[2];
    L.q_dim = dims[3];
    L.kv_dim = dims[4];
    L.rms = dims[5] != 0;
    L.gated = dims[6] != 0;
    L.eps = eps;
    Linear* linears[4] = {&L.qkv, &L.o, &L.up, &L.down};
    size_t at = 0;
    for (int i = 0; i < 4; ++i) {
      linears[i]->op = find_op(ops[i]);
      TORCH_CHECK(counts[i] >= 0 && at + counts[i] <= tensors.size(), "Decoder.add_layer: tensor counts do not fit");
      linears[i]->tensors.assign(tensors.begin() + at, tensors.begin() + at + counts[i]);
      at += counts[i];
      linears[i]->bias = optional_tensor(biases[i]);
    }
    L.attn_w = norms[0];
    L.attn_b = optional_tensor(norms[1]);
    L.mlp_w = norms[2];
    L.mlp_b = optional_tensor(norms[3]);
    L.q_norm = optional_tensor(norms[4]);
    L.k_norm = optional_tensor(norms[5]);
    layers_.push_back(std::move(L));
    if (!attention_) attention_ = find_op("specstack_attention::fixed");  // here, not in forward: no race
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // x [B*T, d] (a packed block: [N, d], b = 1, t = N) through every layer; the outputs of the layers in
  // `hidden` (1-based, as Transformer.forward's hidden_layers) returned beside the last one's. live: the
  // cache's rows; runs (a packed block's, attention.py's RowRun): 6 numbers each in run_dims (start, stop,
  // tokens, first, keys, causal) and 3 tensors in run_tensors (mask, gather, real; empty: none).
  std::tuple<at::Tensor, std::vector<at::Tensor>> forward(
      at::Tensor x, std::optional<at::Tensor> cos, std::optional<at::Tensor> sin, at::Tensor k_all, at::Tensor v_all,
      std::optional<at::Tensor> write_idx, std::optional<at::Tensor> rows, std::optional<at::Tensor> slots,
      bool one_row, int64_t b, int64_t t, int64_t s_used, int64_t live, std::optional<at::Tensor> mask, bool is_causal,
      std::vector<int64_t> run_dims, std::vector<at::Tensor> run_tensors, std::vector<int64_t> hidden) {
    TORCH_CHECK(write_idx.has_value() || (rows.has_value() && slots.has_value()),
                "Decoder.forward: the cache's write slots (write_idx, or rows and slots)");
    TORCH_CHECK(attention_.has_value(), "Decoder.forward: no layers");
    TORCH_CHECK(run_dims.size() % 6 == 0 && run_tensors.size() == run_dims.size() / 2,
                "Decoder.forward: 6 numbers and 3 tensors a run");
    TORCH_CHECK(run_dims.empty() || (b == 1 && !mask.has_value()), "Decoder.forward: runs are a packed block's");
    std::vector<Run> runs;
    for (size_t i = 0; i < run_dims.size() / 6; ++i) {
      const int64_t* r = run_dims.data() + 6 * i;
      TORCH_CHECK(0 <= r[0] && r[0] < r[1] && r[1] <= live && r[2] > 0 && r[3] >= 0 && r[4] <= s_used,
                  "Decoder.forward: a run outside the block or the cache");
      runs.push_back({r[0], r[1], r[2], r[3], r[4], r[5] != 0, optional_tensor(run_tensors[3 * i]),
                      optional_tensor(run_tensors[3 * i + 1]), optional_tensor(run_tensors[3 * i + 2])});
    }
    Step s{cos.value_or(at::Tensor()), sin.value_or(at::Tensor()), std::move(k_all), std::move(v_all),
           write_idx.value_or(at::Tensor()), rows.value_or(at::Tensor()), slots.value_or(at::Tensor()), one_row,
           b, t, s_used, live, mask.value_or(at::Tensor()), is_causal, std::move(runs), *attention_};
    std::vector<at::Tensor> out;
    for (int64_t i = 0; i < size(); ++i) {
      x = block(layers_[i], i, std::move(x), s);
      if (std::find(hidden.begin(), hidden.end(), i + 1) != hidden.end()) out.push_back(x);
    }
    return {x, out};
  }

 private:
  std::vector<Layer> layers_;
  std::optional<c10::OperatorHandle> attention_;
};

}  // namespace

TORCH_LIBRARY(specstack_layer, lib) {
  lib.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  lib.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  lib.def("silu_mul(Tensor h) -> Tensor");
  lib.class_<Decoder>("Decoder")
      .def(torch::init<>())
      .def("add_layer", &Decoder::add_layer)
      .def("size", &Decoder::size)
      .def("forward", &Decoder::forward);
}

TORCH_LIBRARY_IMPL(specstack_layer, CPU, lib) {
  lib.impl("rms_norm", &rms_norm);
  lib.impl("rope", &rope);
  lib.impl("silu_mul", &silu_mul);
}
