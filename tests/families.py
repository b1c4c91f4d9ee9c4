"""The model families the tiny test models cover (tests/conftest.py builds one of each): every parity
test runs on all of them, the engine tests on ENGINE_FAMILIES, which keeps the suite within CI's time
(and the tiny qwen2/qwen3 spread their logits too little for the cost rules' acceptance checks). The Qwen
blocks go through every drafter kind, alone and batched, in tests/lossless/test_qwen_families_engine.py, and
the real pair end to end against transformers in tests/parity/test_qwen_pair.py."""
ALL_FAMILIES = ("llama", "gpt2", "qwen2", "qwen3")
ENGINE_FAMILIES = ("llama", "gpt2")
