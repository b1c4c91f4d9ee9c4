// The decoder's blocks in one call a forward (specstack/models/native_decoder.py says where it runs): a
// Block.forward of specstack/models/transformer.py for every layer, the same ATen operations in the same
// order on the same tensors, the linears through the w4a8 library's ops and attention through the
// fixed-order kernel's (both looked up once through the dispatcher), so a token's numbers are the eager
// blocks' bit for bit.
//
// Why it exists: a one-token step of a small model is dozens of small torch calls a layer, each paying
// Python's argument parsing and dispatch (microseconds) on top of its work, where the weights' read
// is tens of microseconds a layer. Here those calls cost only ATen's C++ dispatch, and Python pays one
// call a forward instead of one per operation.
// Built once per machine by specstack/models/native.py; it needs the w4a8 and attention libraries loaded.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using at::indexing::Slice;

c10::OperatorHandle find_op(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "");
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
    if (bias.defined()) y.add_(bias);
    return y;
  }
};

// transformer.py's Norm: RMSNorm through LayerNorm's kernel on [x, -x] (rms_norm), or a LayerNorm
at::Tensor norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps, bool rms) {
  const int64_t d = w.size(0);
  if (!rms) return at::layer_norm(x, {d}, w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt, eps);
  return at::layer_norm(at::cat({x, x.neg()}, -1), {2 * d}, std::nullopt, std::nullopt, eps).slice(-1, 0, d) * w;
}

struct Layer {
  int64_t nq, nkv, hd, q_dim, kv_dim;
  bool rms, gated;
  double eps;
  Linear qkv, o, up, down;
  at::Tensor attn_w, attn_b, mlp_w, mlp_b, q_norm, k_norm;  // undefined: none
};

// What one forward's layers share: the rotation rows, where the cache takes the block's keys and values,
// and the attention's mask.
struct Step {
  at::Tensor cos, sin;  // [B, T, 1, D], undefined without rotary positions
  at::Tensor k_all, v_all;  // the cache [layers, rows, Hkv, S, D]
  at::Tensor write_idx;  // slots of the one row's block (index_copy_), or undefined: rows, slots
  at::Tensor rows, slots;  // (row, slot) of each token of several rows
  bool one_row;  // several rows allocated, one live: write row 0 only
  int64_t b, t, s_used;
  at::Tensor mask;  // undefined: none
  bool is_causal;
  c10::OperatorHandle attention;
};

at::Tensor block(const Layer& L, int64_t layer, at::Tensor x, const Step& s) {
  const int64_t b = s.b, t = s.t;
  const at::Tensor h = L.qkv(norm(x, L.attn_w, L.attn_b, L.eps, L.rms));
  at::Tensor qk = h.slice(1, 0, L.q_dim + L.kv_dim).view({b, t, L.nq + L.nkv, L.hd});
  if (L.q_norm.defined())
    qk = at::cat({norm(qk.slice(2, 0, L.nq), L.q_norm, {}, L.eps, true), norm(qk.slice(2, L.nq), L.k_norm, {}, L.eps, true)}, 2);
  if (s.cos.defined()) qk = at::addcmul(qk * s.cos, qk.roll({L.hd / 2}, {-1}), s.sin);
  // cache.py's KVCache.write
  at::Tensor kl = s.k_all.select(0, layer), vl = s.v_all.select(0, layer);
  const at::Tensor k = qk.slice(2, L.nq).transpose(1, 2).to(kl.scalar_type());
  const at::Tensor v = h.slice(1, L.q_dim + L.kv_dim).view({b, t, L.nkv, L.hd}).transpose(1, 2).to(vl.scalar_type());
  if (s.write_idx.defined()) {
    (s.one_row ? kl.slice(0, 0, 1) : kl).index_copy_(2, s.write_idx, k);
    (s.one_row ? vl.slice(0, 0, 1) : vl).index_copy_(2, s.write_idx, v);
  } else {
    kl.index_put_({s.rows, Slice(), s.slots}, k.transpose(1, 2).reshape({-1, L.nkv, L.hd}));
    vl.index_put_({s.rows, Slice(), s.slots}, v.transpose(1, 2).reshape({-1, L.nkv, L.hd}));
  }
  const at::Tensor keys = kl.slice(0, 0, b).slice(2, 0, s.s_used), values = vl.slice(0, 0, b).slice(2, 0, s.s_used);
  // attention.py's attend (one block of rows) with the fixed-order kernel
  const at::Tensor q = qk.slice(2, 0, L.nq).to(keys.scalar_type());
  const at::Tensor a = s.attention.typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const std::optional<at::Tensor>&, bool)>()
                           .call(q.transpose(1, 2), keys, values,
                                 s.mask.defined() ? std::optional<at::Tensor>(s.mask) : std::nullopt, s.is_causal);
  x = x + L.o(a.transpose(1, 2).reshape({b * t, L.nq * L.hd}).to(x.scalar_type()));
  at::Tensor m = L.up(norm(x, L.mlp_w, L.mlp_b, L.eps, L.rms));
  if (L.gated) {
    const std::vector<at::Tensor> gu = m.chunk(2, -1);
    m = at::silu(gu[0]) * gu[1];
  } else {
    m = at::gelu(m, "tanh");
  }
  return x + L.down(m);
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

  // x [B*T, d] through every layer; the outputs of the layers in `hidden` (1-based, as
  // Transformer.forward's hidden_layers) returned beside the last one's.
  std::tuple<at::Tensor, std::vector<at::Tensor>> forward(
      at::Tensor x, std::optional<at::Tensor> cos, std::optional<at::Tensor> sin, at::Tensor k_all, at::Tensor v_all,
      std::optional<at::Tensor> write_idx, std::optional<at::Tensor> rows, std::optional<at::Tensor> slots,
      bool one_row, int64_t b, int64_t t, int64_t s_used, std::optional<at::Tensor> mask, bool is_causal,
      std::vector<int64_t> hidden) {
    TORCH_CHECK(write_idx.has_value() || (rows.has_value() && slots.has_value()),
                "Decoder.forward: the cache's write slots (write_idx, or rows and slots)");
    TORCH_CHECK(attention_.has_value(), "Decoder.forward: no layers");
    Step s{cos.value_or(at::Tensor()), sin.value_or(at::Tensor()), std::move(k_all), std::move(v_all),
           write_idx.value_or(at::Tensor()), rows.value_or(at::Tensor()), slots.value_or(at::Tensor()), one_row,
           b, t, s_used, mask.value_or(at::Tensor()), is_causal, *attention_};
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
  lib.class_<Decoder>("Decoder")
      .def(torch::init<>())
      .def("add_layer", &Decoder::add_layer)
      .def("size", &Decoder::size)
      .def("forward", &Decoder::forward);
}
