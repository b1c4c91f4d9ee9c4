"""Issue 30, item 3 measured before building it: torch.compile (Inductor) on the part of a block that
has fixed shapes (output projection, residual, norm, MLP; attention and the cache stay eager), for the
w8a8 format of a registered model. The block's weights go in as tensors and fbgemm's packed layers
through a custom op with an opaque handle, so one graph serves every layer (no graph breaks, no
per-layer recompiles). Prints, per row count: the eager modules' time for all layers, the same code
as a plain function, the compiled function, whether the compiled numbers equal eager's, and whether
a compiled row's output depends on the rows beside it (it must not, for w8a8 to stay lossless).

    python benchmarks/compile_regions.py [--model smollm2-135m] [--rows 1,4,16]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from specstack.models import w8a8
from specstack.models.loading import load_model
from specstack.models.row_ops import rms_norm
from specstack.models.transformer import Block

_OP = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
_PACKS: list[torch.ScriptObject] = []


@torch.library.custom_op("specstack_bench::w8a8_mm", mutates_args=())
def w8a8_mm(q: torch.Tensor, handle: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return _OP(q, 1.0, w8a8.X_ZERO, _PACKS[int(handle)])


@w8a8_mm.register_fake
def _(q: torch.Tensor, handle: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape[0], scales.shape[0])


def mm(x: torch.Tensor, handle: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    q, row = w8a8.quantize_rows(x)
    return w8a8_mm(q, handle, scales) * row


def post(x: torch.Tensor, a: torch.Tensor, eps: float, *w: torch.Tensor) -> torch.Tensor:
    oh, os_, nw, uh, us, dh, ds = w
    x = x + mm(a, oh, os_)
    gate, up = mm(rms_norm(x, nw, eps), uh, us).chunk(2, dim=-1)
    return x + mm(F.silu(gate) * up, dh, ds)


def eager_post(blk: Block, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    _, _, o_proj, mlp_norm, up_proj, down_proj = blk.parts
    x = x + o_proj.forward(a)
    gate, up = up_proj.forward(mlp_norm.forward(x)).chunk(2, dim=-1)
    return x + down_proj.forward(F.silu(gate) * up)


def best_ms(f, n: int = 50) -> float:
    f()
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    m = load_model(args.model, "w8a8", tokenizer=False).model
    cfg, eps = m.config, m.config.norm_eps
    if not cfg.block.gated:
        raise SystemExit("specstack: error: this measurement is written for gated (Llama/Qwen) blocks")

    def handle(lin) -> torch.Tensor:
        _PACKS.append(w8a8.prepack(lin.weight, lin.scales))
        return torch.tensor(len(_PACKS) - 1)

    weights = [(handle(b.o), b.o.scales, b.mlp_norm.weight, handle(b.up), b.up.scales, handle(b.down), b.down.scales)
               for b in m.layers]
    compiled = torch.compile(post, dynamic=True)
    with torch.inference_mode():
        for t in (int(r) for r in args.rows.split(",")):
            x, a = torch.randn(t, cfg.d_model), torch.randn(t, cfg.q_dim)
            t0 = time.perf_counter()
            c = [compiled(x, a, eps, *w) for w in weights]
            first = time.perf_counter() - t0
            e = [eager_post(b, x, a) for b in m.layers]
            same = all(torch.equal(p, q) for p, q in zip(e, c, strict=True))
            diff = max(float((p - q).abs().max()) for p, q in zip(e, c, strict=True))
            ms = [best_ms(lambda x=x, a=a: [eager_post(b, x, a) for b in m.layers]),
                  best_ms(lambda x=x, a=a: [post(x, a, eps, *w) for w in weights]),
                  best_ms(lambda x=x, a=a: [compiled(x, a, eps, *w) for w in weights])]
            print(f"rows {t}: {len(weights)} layers' post-attention: eager modules {ms[0]:.2f} ms, function "
                  f"{ms[1]:.2f}, compiled {ms[2]:.2f} ({ms[0] / ms[2]:.2f} x); compiled == eager: {same} "
                  f"(max diff {diff:.2e}); first call {first:.1f} s", flush=True)
        x, a = torch.randn(16, cfg.d_model), torch.randn(16, cfg.q_dim)
        whole = compiled(x, a, eps, *weights[0])
        alone = torch.cat([compiled(x[i : i + 1], a[i : i + 1], eps, *weights[0]) for i in range(16)])
        print(f"compiled rows invariant (16 rows together against one by one): {torch.equal(whole, alone)} "
              f"(max diff {float((whole - alone).abs().max()):.2e})")


if __name__ == "__main__":
    main()
