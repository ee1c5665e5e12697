"""The LLM accuracy bench as a CPU proxy, for a machine without a GPU: the bench's byte-level llama-small
trained here for 4 minutes, then each quantization variant's weights dequantized into the FP32 model (the
quantization error, without running the Triton kernels under the interpreter: fp16 and fp32 activations gave the
same perplexity to 4 digits on the H100). Held-out perplexity per variant, relative to FP32.

    PYTHONPATH=src python scripts/llm_accuracy_cpu.py
"""
import copy

import torch

from automp.bench.suites import llm as bench
from automp.llm.quantize import QuantEmbedding, QuantLinear, quantize
from automp.llm.store import build

train_text, held_text = bench.stdlib_docstrings(3_000_000)
train, held = bench.as_tokens(train_text, "cpu"), bench.as_tokens(held_text, "cpu")
torch.manual_seed(0)
model = build("llama-small", "cpu", torch.float32)
print(bench.train_lm(model, train, 4000, 256, 8, seconds=240.0), flush=True)

def dequantized(q):
    ref = copy.deepcopy(model)
    for name, m in q.named_modules():
        if isinstance(m, QuantLinear):
            ref.get_submodule(name).weight.data = m.dequantized()
        elif isinstance(m, QuantEmbedding):
            ref.get_submodule(name).weight.data = m.dequantized()
    return ref

base = bench.perplexity(model, held, 256, 32)
print(f"fp32 {base:.4f}", flush=True)
for name, kw in [("int8", dict(scheme="int8")), ("int4", dict(scheme="int4")),
                 ("int8-all", dict(scheme="int8", quantize_lm_head=True, quantize_embeddings=True)),
                 ("int4-all", dict(scheme="int4", quantize_lm_head=True, quantize_embeddings=True)),
                 ("int4-edges-int8", dict(scheme="int4", quantize_lm_head=True, quantize_embeddings=True,
                                          edge_scheme="int8"))]:
    q = quantize(copy.deepcopy(model), group_size=128, **kw)
    ppl = bench.perplexity(dequantized(q), held, 256, 32)
    print(f"{name}-g128 {ppl:.4f} {100 * (ppl / base - 1):+.2f}%", flush=True)
