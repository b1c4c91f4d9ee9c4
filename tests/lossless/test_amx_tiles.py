"""w4a8 models on the `amx` path with the AMX tiles taking every call of 3 rows or more and the VNNI tiles
the rest (models/kernels/w4a8_wide.cpp `set_amx_from`): one-token steps, chains, trees, prompts and batches
then run on different instructions, and every token's logits must still be those of its one-token steps,
bit for bit, and every method's greedy output `ar`'s. test_batch_invariant.py's checks, on a tiny llama in
w4a8 and a tiny Q4_K_M-typed GGUF (k4a8, q8a8, and k6a8 on the VNNI tiles). Runs where the CPU and its
kernel grant AMX."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from test_batch_invariant import (  # noqa: F401  (the fixture, and the checks collected again here)
    GGUF,
    invariant_models,
    test_a_chain_scores_each_token_as_one_token_steps_do,
    test_a_tree_scores_each_path_as_one_token_steps_do,
    test_batched_rows_equal_autoregressive,
    test_rows_of_a_batch_score_as_each_row_alone,
    test_speculation_equals_autoregressive,
)

from specstack.models import w4a8

AMX = w4a8.kernel_for(torch.device("cpu")).name == "amx"
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not AMX, reason="this process's w4a8 path is not amx (no AMX-INT8 here)")]


@pytest.fixture(autouse=True)
def tiles_from_three_rows() -> Iterator[None]:
    before = torch.ops.specstack_w4a8_wide.set_amx_from(3)
    try:
        yield
    finally:
        torch.ops.specstack_w4a8_wide.set_amx_from(before)


@pytest.fixture(params=[("w4a8", "llama"), GGUF], ids="-".join)
def lm(request, invariant_models):  # noqa: F811  (the imported fixture, by name)
    return invariant_models[request.param]
