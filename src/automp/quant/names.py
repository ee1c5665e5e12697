"""The names every quantization entry point takes and reports (automp.quant, automp.llm, automp.deploy.quantized,
their command lines), in one table: a scheme or a dtype is spelled the same way everywhere."""
from __future__ import annotations

import torch

SCHEMES = {"int8": 8, "int4": 4}  # a weight-only scheme -> its bits
PRECISIONS = ("int8", "int8-weight", "int4-weight")  # a torch module's: W8A8, then each weight-only scheme
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}  # compute dtypes around the quantized weights
SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16"}  # how reports name them


def dtype_name(dtype: torch.dtype) -> str:
    """The DTYPES name of a torch dtype ("float16" for torch.float16)."""
    return next(name for name, d in DTYPES.items() if d == dtype)
