"""Weight-only quantized causal-LM inference: `quantize(model, "int4"|"int8")`, `generate`, `save` / `load`.

    model = automp.llm.quantize(model, "int4", group_size=128)      # transformers Llama / GPT-2, in place
    ids = automp.llm.generate(model, prompt_ids, max_new_tokens=64)  # static KV cache, CUDA-graph decode on GPU
    automp.llm.save(model, "out/");  model = automp.llm.load("out/", device="cuda")

Command line: `automp llm quantize | generate` (automp.llm.cli); `automp llm bench` is the benchmark suite
automp.bench.suites.llm.

Importing automp.llm does not import Triton (automp.kernels loads on first use), so a command can still turn the
Triton interpreter on (TRITON_INTERPRET=1) before the kernels load.
"""
from __future__ import annotations

from automp.llm.generate import ByteTokenizer, decode_info, generate
from automp.llm.quantize import QuantConfig, QuantLinear, check_backend, quantize
from automp.llm.store import build, load, save

__all__ = ["quantize", "generate", "save", "load", "build", "QuantConfig", "QuantLinear", "ByteTokenizer",
           "check_backend", "decode_info"]
