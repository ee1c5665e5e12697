"""Weight-only int8 / int4 quantization of transformers causal LMs, for memory-bound batch-1 decoding.

At batch 1 a decoder step reads every weight once and does two flops per weight, so its time is the weight bytes
over memory bandwidth: int8 halves it and int4 quarters it (plus the per-group scales). `quantize` swaps every
projection (attention q/k/v/o or GPT-2's c_attn/c_proj, and the MLP) for a `QuantLinear` holding the packed codes;
the Triton kernels (automp.kernels.quant_gemv / quant_gemm) dequantize in registers, so the weights cross memory in
their packed form. Embeddings, norms and lm_head stay in fp16/bf16 by default (lm_head optionally quantized): a small
share of a large model's bytes, and the layers where rounding costs the most accuracy. The input embedding can be
quantized too (`quantize_embeddings`, a `QuantEmbedding`): it costs no time (a decode step reads one row per token),
but it is 6% of TinyLlama-1.1B's fp16 bytes and with lm_head it is what keeps int4 weights above 30% of fp16 memory.
The linears that read one activation (q/k/v, gate/up) then share one kernel call per group (automp.llm.fuse: at
batch 1 each call costs its latency whatever its size), their buffers row slices of one tensor, saved as before.

AWQ (activation-aware scale search, optional) lives in automp.llm.awq.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

_KERNELS = _INTERPRET = None
SCHEMES = {"int8": 8, "int4": 4}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
MIN_GROUP = 32


def kernels():
    """automp.kernels, imported on first use: importing automp.llm (or its CLI) must not import Triton, so a command
    can still turn the Triton interpreter on (TRITON_INTERPRET=1 is read when Triton is imported)."""
    global _KERNELS, _INTERPRET
    if _KERNELS is None:
        import automp.kernels
        from automp.kernels.gemv import INTERPRET
        _KERNELS, _INTERPRET = automp.kernels, INTERPRET
    return _KERNELS


@dataclass(frozen=True)
class QuantConfig:
    """How `quantize` treats a model (saved with it, so `load` rebuilds the same thing)."""
    scheme: str = "int4"               # "int4" | "int8"
    group_size: int | None = 128       # power of two >= 32 dividing every K, or None for one scale per row
    awq: bool = False
    quantize_lm_head: bool = False
    dtype: str = "float16"             # activations and the unquantized weights: "float16" | "bfloat16"
    quantize_embeddings: bool = False  # the input embedding too (QuantEmbedding)
    edge_scheme: str | None = None     # lm_head and the input embedding, where quantized: None = `scheme`
    fuse: bool = True                  # q/k/v and gate/up as one kernel call each (automp.llm.fuse)

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"automp.llm.quantize: scheme must be one of {sorted(SCHEMES)}, got {self.scheme!r}")
        g = self.group_size
        if g is not None and (not isinstance(g, int) or g < MIN_GROUP or g & (g - 1)):
            raise ValueError(f"automp.llm.quantize: group_size must be a power of two >= {MIN_GROUP} or None "
                             f"(per-channel), got {g!r}")
        if self.edge_scheme is not None and self.edge_scheme not in SCHEMES:
            raise ValueError(f"automp.llm.quantize: edge_scheme must be one of {sorted(SCHEMES)} or None, got "
                             f"{self.edge_scheme!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"automp.llm.quantize: dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def bits(self) -> int:
        return SCHEMES[self.scheme]

    @property
    def edge_bits(self) -> int:
        """Bits of lm_head and the input embedding: on a small model int4 there cost +2.7% perplexity where int8
        cost +0.01% (BENCHMARKS.md section 6), for a few percent of a large model's bytes."""
        return SCHEMES[self.edge_scheme or self.scheme]


@dataclass(frozen=True)
class Group:
    """Linears (paths inside a decoder block) that read one activation, and the op that produces it (for AWQ)."""
    linears: tuple[str, ...]
    prev: str | None


@dataclass(frozen=True)
class Arch:
    blocks: str              # path of the ModuleList of decoder blocks
    groups: tuple[Group, ...]
    conv1d: bool             # weights stored [in, out] (GPT-2's transformers Conv1D)


ARCHS = {
    "LlamaForCausalLM": Arch("model.layers", (
        Group(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm"),
        Group(("self_attn.o_proj",), "self_attn.v_proj"),
        Group(("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm"),
        Group(("mlp.down_proj",), "mlp.up_proj")), conv1d=False),
    "GPT2LMHeadModel": Arch("transformer.h", (
        Group(("attn.c_attn",), "ln_1"),
        Group(("attn.c_proj",), "attn.c_attn"),
        Group(("mlp.c_fc",), "ln_2"),
        Group(("mlp.c_proj",), None)), conv1d=True),
}


def arch_of(model: nn.Module) -> Arch:
    name = type(model).__name__
    if name not in ARCHS:
        raise TypeError(f"automp.llm: unsupported architecture {name}; supported: {', '.join(sorted(ARCHS))}")
    return ARCHS[name]


def check_backend(bits: int, device: torch.device | str, interpret: bool | None = None) -> None:
    """int4 needs the Triton kernel: on CUDA, or on the CPU under TRITON_INTERPRET=1 (set before automp.kernels is
    imported). Without it the op would silently dequantize the whole weight in fp32 on every call."""
    if interpret is None:
        kernels()
        interpret = _INTERPRET
    if bits == 4 and torch.device(device).type != "cuda" and not interpret:
        raise RuntimeError(f"automp.llm: int4 weights need a CUDA device, or TRITON_INTERPRET=1 set before automp "
                           f"is imported to run the kernels on the CPU (slow); got device {torch.device(device)}")


def _quantizer(bits: int):
    """The weight quantizer for `bits` (int8 per group or row, or packed int4): (codes, scales) of a float [N, K]."""
    return kernels().quantize_weight_int8 if bits == 8 else kernels().quantize_weight_int4


def _register_packed(module: nn.Module, rows: int, k: int, bits: int, group_size: int | None,
                     device: torch.device | str | None) -> None:
    """Empty `qw` and `scales` buffers in the layout _quantizer returns for a [rows, k] weight (load fills them)."""
    cols = k if bits == 8 else (k + 1) // 2
    n_groups = 1 if group_size is None else -(-k // group_size)
    module.register_buffer("qw", torch.empty(rows, cols, dtype=torch.int8 if bits == 8 else torch.uint8, device=device))
    module.register_buffer("scales", torch.empty(rows, n_groups, dtype=torch.float32, device=device))


def project(x: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
            input_scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x @ dequant(qw, scales)^T + bias in x's dtype, computed in `dtype`: one row through the GEMV kernel, more
    through the GEMM kernel."""
    k = _KERNELS or kernels()
    out_dtype = x.dtype
    a = x.reshape(-1, x.shape[-1]).to(dtype)
    if input_scale is not None:
        a = a * input_scale
    if a.shape[0] == 1:
        y = k.quant_gemv(qw, scales, a[0])[None]
    else:
        y = k.quant_gemm(a, qw, scales)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], qw.shape[0]).to(out_dtype)


class QuantLinear(nn.Module):
    """y = x @ dequant(qw, scales)^T + bias (an nn.Linear with packed weights; layouts in automp.kernels.quant).

    One row (batch-1 decoding) goes through the GEMV kernel, more rows through the GEMM kernel. Inputs of another
    float dtype are cast to `dtype` and the output back, so the module also runs inside an fp32 model.
    """

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int | None, bias: bool = False,
                 input_scale: bool = False, dtype: torch.dtype = torch.float16,
                 device: torch.device | str | None = None, awq_alpha: float | None = None):
        super().__init__()
        self.in_features, self.out_features, self.bits, self.group_size = in_features, out_features, bits, group_size
        self.dtype, self.awq_alpha = dtype, awq_alpha
        _register_packed(self, out_features, in_features, bits, group_size, device)
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)
        self.register_buffer("input_scale", torch.empty(in_features, dtype=dtype, device=device)
                             if input_scale else None)
        self._fused, self._fused_slot = None, 0  # a FusedGroup (automp.llm.fuse, a plain object) and this row block

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, bits: int, group_size: int | None,
                    dtype: torch.dtype, inv_input_scale: torch.Tensor | None = None,
                    awq_alpha: float | None = None) -> "QuantLinear":
        """From a float [N, K] weight (already multiplied by the AWQ scale when inv_input_scale is given)."""
        n, k = weight.shape
        q = cls(k, n, bits, group_size, bias is not None, inv_input_scale is not None, dtype, weight.device, awq_alpha)
        q.qw, q.scales = _quantizer(bits)(weight, group_size)
        if bias is not None:
            q.bias = bias.detach().to(dtype).clone()
        if inv_input_scale is not None:
            q.input_scale = inv_input_scale.to(dtype)
        return q

    def spec(self) -> dict:
        """Constructor arguments (what `load` needs to rebuild an empty module)."""
        return {"in_features": self.in_features, "out_features": self.out_features, "bits": self.bits,
                "group_size": self.group_size, "bias": self.bias is not None,
                "input_scale": self.input_scale is not None, "awq_alpha": self.awq_alpha}

    def dequantized(self) -> torch.Tensor:
        """The float32 [N, K] weight this module multiplies by (input scale folded in)."""
        w = kernels().dequantize_weight(self.qw, self.scales, self.in_features)
        return w * self.input_scale.float() if self.input_scale is not None else w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_backend(self.bits, x.device)
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
    """An nn.Embedding whose table is stored as QuantLinear stores a weight (rows = tokens, K = embedding dim): the
    looked-up rows are gathered in their packed form and dequantized (plain torch ops: a handful of rows per decode
    step, nothing a kernel would win)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bits: int, group_size: int | None,
                 dtype: torch.dtype = torch.float16, device: torch.device | str | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.bits, self.group_size = num_embeddings, embedding_dim, bits, \
            group_size
        self.dtype = dtype
        _register_packed(self, num_embeddings, embedding_dim, bits, group_size, device)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bits: int, group_size: int | None,
                    dtype: torch.dtype) -> "QuantEmbedding":
        v, d = weight.shape
        q = cls(v, d, bits, group_size, dtype, weight.device)
        q.qw, q.scales = _quantizer(bits)(weight.detach().float(), group_size)
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


def input_embedding(model: nn.Module) -> tuple[torch.device, torch.dtype, int, bool]:
    """(device, activation dtype, bytes, tied to the output head) of the model's input embedding, quantized or not."""
    emb = model.get_input_embeddings()
    if isinstance(emb, QuantEmbedding):
        return emb.qw.device, emb.dtype, sum(t.numel() * t.element_size() for t in (emb.qw, emb.scales)), False
    head = model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is emb.weight
    return emb.weight.device, emb.weight.dtype, emb.weight.numel() * emb.weight.element_size(), tied


# ----------------------------------------------------------------------------------------------- model surgery
def set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def _dense(module: nn.Module, conv1d: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 copies of (weight [N, K], bias [N]) of an nn.Linear or a transformers Conv1D ([K, N] weight)."""
    w = module.weight.detach()
    w = (w.t() if conv1d else w).float().clone()
    b = module.bias.detach().float().clone() if getattr(module, "bias", None) is not None else None
    return w, b


def target_paths(model: nn.Module, config: QuantConfig) -> list[str]:
    """Every module `quantize` replaces, checked for group-size compatibility before anything changes."""
    arch = arch_of(model)
    blocks = model.get_submodule(arch.blocks)
    paths = [f"{arch.blocks}.{i}.{lin}" for i in range(len(blocks)) for g in arch.groups for lin in g.linears]
    if config.quantize_lm_head:
        paths.append("lm_head")
    if config.quantize_embeddings:
        emb = model.get_input_embeddings()
        if isinstance(emb, QuantEmbedding):
            raise ValueError("automp.llm.quantize: the input embedding is already quantized (quantize the original "
                             "model)")
        if not config.quantize_lm_head and input_embedding(model)[3]:
            raise ValueError("automp.llm.quantize: the input embedding is tied to lm_head: quantizing it alone would "
                             "keep the fp16 matrix for the head (no memory saved); pass quantize_lm_head=True too")
        d = emb.weight.shape[1]
        if config.group_size is not None and d % config.group_size:
            raise ValueError(f"automp.llm.quantize: group_size {config.group_size} does not divide the embedding "
                             f"dim {d}; use a power of two dividing {d}, or group_size=None (one scale per row)")
    for p in paths:
        m = model.get_submodule(p)
        if isinstance(m, QuantLinear):
            raise ValueError(f"automp.llm.quantize: {p} is already quantized (quantize the original model)")
        k = m.weight.shape[0] if arch.conv1d and p != "lm_head" else m.weight.shape[1]
        if config.group_size is not None and k % config.group_size:
            raise ValueError(f"automp.llm.quantize: group_size {config.group_size} does not divide K={k} of layer "
                             f"{p}; use a power of two dividing {k}, or group_size=None (one scale per row)")
    return paths


# ----------------------------------------------------------------------------------------------- entry point
def quantize(model: nn.Module, scheme: str = "int4", group_size: int | None = 128, calib: torch.Tensor | None = None,
             awq: bool = False, quantize_lm_head: bool = False, dtype: str = "float16",
             quantize_embeddings: bool = False, edge_scheme: str | None = None, fuse: bool = True) -> nn.Module:
    """Quantize `model` (LlamaForCausalLM or GPT2LMHeadModel) in place to weight-only int8/int4 and return it.

    calib: int64 token ids [B, T] (or [T]) for the AWQ scale search (required with awq=True). Every argument and
    every layer is checked before the model is touched. The rest of the model is cast to `dtype`. fuse: the linears
    that read one activation (q/k/v, gate/up) run as one kernel call each (automp.llm.fuse; same results).
    """
    config = QuantConfig(scheme, group_size, awq, quantize_lm_head, dtype, quantize_embeddings, edge_scheme, fuse)
    arch = arch_of(model)
    target_paths(model, config)
    if awq:
        if calib is None:
            raise ValueError("automp.llm.quantize: awq=True needs calib (int64 token ids [B, T])")
        calib = torch.as_tensor(calib)
        if calib.dtype != torch.int64 or calib.dim() not in (1, 2) or calib.numel() == 0:
            raise ValueError(f"automp.llm.quantize: calib must be non-empty int64 token ids [B, T], got "
                             f"{calib.dtype} {tuple(calib.shape)}")
        calib = calib.reshape(-1, calib.shape[-1])
    act = DTYPES[dtype]
    from automp.llm.awq import collect_inputs, scale_block, search_scale  # awq imports this module
    inputs = collect_inputs(model, arch, calib) if awq else {}
    blocks = model.get_submodule(arch.blocks)
    for i, block in enumerate(blocks):
        prefix = f"{arch.blocks}.{i}."
        dense = {f"{prefix}{lin}": list(_dense(model.get_submodule(f"{prefix}{lin}"), arch.conv1d))
                 for g in arch.groups for lin in g.linears}
        scales: dict[int, torch.Tensor] = {}
        alphas: dict[str, float] = {}
        for gi, g in enumerate(arch.groups if awq else ()):  # searched on the unscaled weights, then applied
            names = [f"{prefix}{lin}" for lin in g.linears]
            scales[gi], alpha = search_scale(inputs[names[0]], [dense[n][0] for n in names], config.bits,
                                             group_size)
            alphas.update({n: alpha for n in names})
        explicit = scale_block(block, prefix, arch, dense, scales)
        for name, (w, b) in dense.items():
            set_module(model, name, QuantLinear.from_weight(w, b, config.bits, group_size, act, explicit.get(name),
                                                            alphas.get(name)))
    if quantize_lm_head:
        head = model.get_submodule("lm_head")
        w, b = _dense(head, conv1d=False)
        set_module(model, "lm_head", QuantLinear.from_weight(w, b, config.edge_bits, group_size, act))
        model.config.tie_word_embeddings = False  # the fp16 input embedding and the quantized head are now separate
    if quantize_embeddings:
        emb = model.get_input_embeddings()
        model.set_input_embeddings(QuantEmbedding.from_weight(emb.weight, config.edge_bits, group_size, act))
    for p in model.parameters():
        p.data = p.data.to(act)
    for attr in ("dtype", "torch_dtype"):
        if attr in model.config.to_dict():
            setattr(model.config, attr, act)
    model.automp_quant = config
    from automp.llm.fuse import fuse_projections
    fuse_projections(model)
    return model.eval()


def is_quantized(model: nn.Module) -> bool:
    return isinstance(getattr(model, "automp_quant", None), QuantConfig)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every distinct parameter and buffer (tied weights once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
