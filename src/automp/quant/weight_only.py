"""Weight-only int8 / int4 layers: `WeightOnlyLinear` (one class for automp.deploy and automp.llm) and
`QuantEmbedding`.

At batch 1 a decoder step reads every weight once and does two flops per weight, so its time is the weight bytes over
memory bandwidth: int8 halves it and int4 quarters it (plus the per-group scales). On CUDA the Triton kernels
(automp.kernels.quant_gemv / quant_gemm) dequantize in registers, so the weights cross memory in their packed form.
On a CPU the layer dequantizes with torch and multiplies in float32: the kernels' only CPU path is the Triton
interpreter, seconds per token, which is a way to test the kernels, not to run a model. `FORCE_KERNELS` sends CPU
tensors through the kernel ops anyway (tests that check the kernels inside a model).

Layouts (qw, scales) are automp.kernels.quant's. Buffer names and `spec()` are what automp.llm.store saves, so a
saved model loads into this class unchanged. automp.kernels is imported on first use, not here: importing automp.llm
must not import Triton, so that a command can still turn the interpreter on (TRITON_INTERPRET is read at import).
"""
from __future__ import annotations

import torch
import torch.nn as nn

HALF = (torch.float16, torch.bfloat16)
MIN_GROUP = 32
FORCE_KERNELS = False  # True: CPU tensors go through the kernel ops too (under TRITON_INTERPRET=1, the interpreter)
_KERNELS = None


def valid_group(group_size: object) -> bool:
    """Whether `group_size` is one the layers take: None (one scale per row) or a power of two >= MIN_GROUP."""
    g = group_size
    return g is None or (isinstance(g, int) and g >= MIN_GROUP and not g & (g - 1))


def kernels():
    """automp.kernels, imported on first use (see the module docstring)."""
    global _KERNELS
    if _KERNELS is None:
        import automp.kernels
        _KERNELS = automp.kernels
    return _KERNELS


def quantizer(bits: int):
    """The weight quantizer for `bits` (int8 per group or row, or packed int4): (codes, scales) of a float [N, K]."""
    if bits not in (4, 8):
        raise ValueError(f"automp.quant: weight-only bits must be 4 or 8, got {bits}")
    return kernels().quantize_weight_int8 if bits == 8 else kernels().quantize_weight_int4


def fake_quant(w: torch.Tensor, bits: int, group_size: int | None) -> torch.Tensor:
    """w quantized and dequantized (float32): what a layer built from w multiplies by."""
    q, s = quantizer(bits)(w, group_size)
    return kernels().dequantize_weight(q, s, w.shape[1])


def register_packed(module: nn.Module, rows: int, k: int, bits: int, group_size: int | None,
                    device: torch.device | str | None) -> None:
    """Empty `qw` and `scales` buffers in the layout `quantizer` returns for a [rows, k] weight (load fills them)."""
    cols = k if bits == 8 else (k + 1) // 2
    n_groups = 1 if group_size is None else -(-k // group_size)
    module.register_buffer("qw", torch.empty(rows, cols, dtype=torch.int8 if bits == 8 else torch.uint8, device=device))
    module.register_buffer("scales", torch.empty(rows, n_groups, dtype=torch.float32, device=device))


def use_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda or FORCE_KERNELS


def project(x: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
            input_scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x @ dequant(qw, scales)^T + bias, returned in x's dtype.

    Kernels (CUDA): computed in `dtype`; one row through the GEMV kernel; 2..64 rows through the rows kernel (one
    pass over the packed weights for all rows, CUDA cores), the planes kernel (tensor cores, each code decoded once)
    or the GEMM kernel, whichever automp.kernels.crossover measured fastest for this shape; more rows through the
    GEMM kernel. CPU: the dequantized weight times x in
    float32 (see the module docstring)."""
    out_dtype = x.dtype
    a = x.reshape(-1, x.shape[-1])
    if use_kernels(x):
        k = kernels()
        a = a.to(dtype)
        if input_scale is not None:
            a = a * input_scale
        if a.shape[0] == 1:
            y = k.quant_gemv(qw, scales, a[0])[None]
        else:
            y = k.crossover.KERNELS[k.crossover.choose(a, qw, scales)](a, qw, scales)
    else:
        a = a.float()
        if input_scale is not None:
            a = a * input_scale.float()
        y = a @ kernels().dequantize_weight(qw, scales, a.shape[1]).T
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], qw.shape[0]).to(out_dtype)


class WeightOnlyLinear(nn.Module):
    """y = x @ dequant(qw, scales)^T + bias: an nn.Linear with int8 or packed int4 weights grouped along K.

    Activations of another float dtype are cast to `dtype` for the kernels and the output cast back, so the module
    also runs inside an fp32 model. `input_scale` (AWQ) multiplies the input where no op before it could absorb it.
    A member of a fused group (automp.llm.fuse) is served by the group's one kernel call.
    """

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int | None, bias: bool = False,
                 input_scale: bool = False, dtype: torch.dtype = torch.float16,
                 device: torch.device | str | None = None, awq_alpha: float | None = None):
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"WeightOnlyLinear: bits must be 4 or 8, got {bits}")
        if dtype not in HALF:
            raise TypeError(f"WeightOnlyLinear: compute dtype must be float16 or bfloat16, got {dtype}")
        self.in_features, self.out_features, self.bits, self.group_size = in_features, out_features, bits, group_size
        self.dtype, self.awq_alpha = dtype, awq_alpha
        register_packed(self, out_features, in_features, bits, group_size, device)
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)
        self.register_buffer("input_scale", torch.empty(in_features, dtype=dtype, device=device)
                             if input_scale else None)
        self._fused, self._fused_slot = None, 0  # a FusedGroup (automp.llm.fuse, a plain object) and this row block

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, bits: int, group_size: int | None,
                    dtype: torch.dtype = torch.float16, inv_input_scale: torch.Tensor | None = None,
                    awq_alpha: float | None = None) -> "WeightOnlyLinear":
        """From a float [N, K] weight (already multiplied by the AWQ scale when inv_input_scale is given)."""
        n, k = weight.shape
        q = cls(k, n, bits, group_size, bias is not None, inv_input_scale is not None, dtype, weight.device, awq_alpha)
        q.qw, q.scales = quantizer(bits)(weight.detach(), group_size)
        if bias is not None:
            q.bias = bias.detach().to(dtype).clone()
        if inv_input_scale is not None:
            q.input_scale = inv_input_scale.to(dtype)
        return q

    @property
    def group(self) -> int | None:
        return self.group_size

    def spec(self) -> dict:
        """Constructor arguments (what automp.llm.store.load needs to rebuild an empty module)."""
        return {"in_features": self.in_features, "out_features": self.out_features, "bits": self.bits,
                "group_size": self.group_size, "bias": self.bias is not None,
                "input_scale": self.input_scale is not None, "awq_alpha": self.awq_alpha}

    def dequantized(self) -> torch.Tensor:
        """The float32 [N, K] weight this module multiplies by (input scale folded in)."""
        w = kernels().dequantize_weight(self.qw, self.scales, self.in_features)
        return w * self.input_scale.float() if self.input_scale is not None else w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = getattr(self, "_fused", None)
        if group is not None and group.active:  # one call for the whole group (automp.llm.fuse.FusedGroup)
            return group(self._fused_slot, x)
        return project(x, self.qw, self.scales, self.bias, self.input_scale, self.dtype)

    # A fused member's qw / scales / bias are row slices of its group's tensors (automp.llm.fuse). Anything that
    # replaces one of them (.to / .cuda / .half through _apply, an assignment, load_state_dict(assign=True)) would
    # leave the group computing from the old tensors, so it dissolves the group: every member then computes from
    # its own buffers (still right, one call each) until fuse_projections fuses it again. In-place writes
    # (load_state_dict's copy_) go through the views into the group's tensors: nothing to do.
    def _unfuse(self) -> None:
        group = self.__dict__.get("_fused")
        if group is not None:
            group.dissolve()
            self.__dict__["_fused"] = None

    def _apply(self, fn, *args, **kwargs):
        before = (self.qw, self.scales, self.bias)
        try:
            return super()._apply(fn, *args, **kwargs)
        finally:
            if any(a is not b for a, b in zip(before, (self.qw, self.scales, self.bias))):
                self._unfuse()

    def __setattr__(self, name: str, value) -> None:
        if name in ("qw", "scales", "bias", "input_scale"):
            self._unfuse()
        super().__setattr__(name, value)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}, "
                f"group_size={self.group_size}, bias={self.bias is not None}, awq_alpha={self.awq_alpha}")


class QuantEmbedding(nn.Module):
    """An nn.Embedding whose table is stored as WeightOnlyLinear stores a weight (rows = tokens, K = embedding dim):
    the looked-up rows are gathered in their packed form and dequantized (plain torch ops: a handful of rows per
    decode step, nothing a kernel would win)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bits: int, group_size: int | None,
                 dtype: torch.dtype = torch.float16, device: torch.device | str | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.bits, self.group_size, self.dtype = bits, group_size, dtype
        register_packed(self, num_embeddings, embedding_dim, bits, group_size, device)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bits: int, group_size: int | None,
                    dtype: torch.dtype) -> "QuantEmbedding":
        v, d = weight.shape
        q = cls(v, d, bits, group_size, dtype, weight.device)
        q.qw, q.scales = quantizer(bits)(weight.detach().float(), group_size)
        return q

    def spec(self) -> dict:
        return {"num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim, "bits": self.bits,
                "group_size": self.group_size}

    def dequantized(self) -> torch.Tensor:
        """The float32 [V, D] table this module looks rows up in."""
        return kernels().dequantize_weight(self.qw, self.scales, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = kernels().dequantize_weight(self.qw[flat], self.scales[flat], self.embedding_dim)
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int{self.bits}, group_size={self.group_size}"
