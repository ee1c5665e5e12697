"""Which aten ops may run in low precision, and why.

Four lists, as in every mixed-precision system since NVIDIA's AMP:
- ALLOW: Tensor Core ops. They are where the speed is and accumulate in fp32 inside the hardware, so they are the
  seeds of low precision.
- DENY: ops whose result loses meaning in 8 (bf16) or 11 (fp16) mantissa bits or overflows fp16's 65504 range:
  exponentials, logs, large reductions, normalisation statistics, losses. They run in FP32 and their inputs are
  cast up.
- INFER: elementwise math that is as accurate as its inputs; it follows them so that a chain of them does not
  bounce between dtypes.
- CLEAR: data movement with no arithmetic; dtype passes straight through, never a cast of its own.
Anything else is UNKNOWN: it stays FP32 and the report names it, because guessing wrong is a silent accuracy bug.
"""
from __future__ import annotations

import enum
from typing import Any


class Category(enum.Enum):
    ALLOW = "allow"
    DENY = "deny"
    INFER = "infer"
    CLEAR = "clear"
    GATHER = "gather"  # lookups whose worth in low precision depends on table size: the cost model decides
    UNKNOWN = "unknown"


# One line per op: the reason it sits where it does.
_WHY: dict[str, tuple[Category, str]] = {}


def _put(cat: Category, why: str, *names: str) -> None:
    for n in names:
        if n in _WHY:
            raise ValueError(f"op {n!r} is on two lists: {_WHY[n][0].name} and {cat.name}")
        _WHY[n] = (cat, why)


_put(Category.ALLOW, "matrix multiply: Tensor Cores, fp32 accumulation", "mm", "addmm", "bmm", "baddbmm", "matmul",
     "linear", "addbmm", "_scaled_mm", "dot", "mv", "einsum")
_put(Category.ALLOW, "convolution: Tensor Cores (implicit GEMM), fp32 accumulation", "convolution",
     "convolution_backward", "_convolution", "conv1d", "conv2d", "conv3d", "cudnn_convolution", "conv_transpose2d")
_put(Category.ALLOW, "attention: fused kernels keep softmax statistics in fp32 internally",
     "scaled_dot_product_attention", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
     "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
     "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention_backward",
     "_scaled_dot_product_cudnn_attention_backward", "_scaled_dot_product_flash_attention_for_cpu_backward")

_put(Category.DENY, "softmax: exp of unbounded logits overflows fp16", "softmax", "_softmax", "_softmax_backward_data",
     "_safe_softmax")
_put(Category.DENY, "log-softmax: needs fp32 log-sum-exp", "log_softmax", "_log_softmax", "_log_softmax_backward_data",
     "logsumexp")
_put(Category.DENY, "loss: summed over a batch, small per-sample terms vanish", "nll_loss_forward", "nll_loss_backward",
     "nll_loss", "nll_loss2d_forward", "nll_loss2d_backward", "cross_entropy_loss", "mse_loss", "mse_loss_backward",
     "binary_cross_entropy", "binary_cross_entropy_backward", "binary_cross_entropy_with_logits", "smooth_l1_loss",
     "smooth_l1_loss_backward", "l1_loss", "huber_loss", "huber_loss_backward", "kl_div", "soft_margin_loss")
_put(Category.DENY, "normalisation: mean/variance statistics need fp32", "native_layer_norm",
     "native_layer_norm_backward", "layer_norm", "native_batch_norm", "native_batch_norm_backward",
     "_native_batch_norm_legit", "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
     "batch_norm", "cudnn_batch_norm", "cudnn_batch_norm_backward", "native_group_norm", "native_group_norm_backward",
     "group_norm", "rms_norm", "_fused_rms_norm", "_fused_rms_norm_backward", "var_mean", "var", "std", "norm",
     "linalg_vector_norm", "batch_norm_backward", "_batch_norm_with_update", "_batch_norm_no_update",
     "_batch_norm_with_update_functional")
_put(Category.DENY, "exponential/log/power: range and precision loss", "exp", "exp2", "expm1", "log", "log2", "log10",
     "log1p", "pow", "reciprocal", "rsqrt", "sqrt", "erfinv", "lgamma", "digamma", "xlogy")
_put(Category.DENY, "sum-type reduction: accumulating many terms in fp16 loses the small ones", "sum", "mean",
     "cumsum", "cumprod", "prod", "_foreach_norm", "embedding_dense_backward", "index_add", "_unsafe_masked_index_put_accumulate", "scatter_add",
     "index_put", "_index_put_impl", "scatter_reduce", "nansum", "dist", "cdist", "cosine_similarity", "renorm")

_put(Category.INFER, "elementwise: as accurate as its inputs", "add", "sub", "mul", "div", "neg", "abs", "relu",
     "gelu", "silu", "sigmoid", "tanh", "hardtanh", "leaky_relu", "elu", "hardswish", "hardsigmoid", "mish",
     "threshold_backward", "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward",
     "hardtanh_backward", "leaky_relu_backward", "elu_backward", "hardswish_backward", "where", "clamp", "clamp_min",
     "clamp_max", "maximum", "minimum", "sign", "square", "addcmul", "addcdiv", "lerp", "erf", "sin", "cos",
     "dropout", "native_dropout", "native_dropout_backward", "bernoulli", "masked_fill", "fill", "rsub", "fma",
     "relu6", "softplus", "softplus_backward", "glu", "logit", "frac", "trunc", "round", "floor", "ceil",
     "max_pool2d_with_indices_backward", "avg_pool2d", "avg_pool2d_backward", "_adaptive_avg_pool2d",
     "_adaptive_avg_pool2d_backward", "adaptive_avg_pool2d", "upsample_nearest2d", "upsample_bilinear2d",
     "upsample_nearest2d_backward", "constant_pad_nd", "copy", "lift_fresh_copy", "amax", "amin", "max", "min",
     "argmax", "argmin", "topk", "sort", "eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "logical_not")

_put(Category.CLEAR, "data movement: no arithmetic, no cast needed", "view", "_unsafe_view", "reshape", "transpose",
     "t", "permute", "expand", "squeeze", "unsqueeze", "slice", "select", "slice_scatter", "select_scatter",
     "cat", "stack", "split", "split_with_sizes", "chunk", "unbind", "clone", "contiguous", "alias",
     "as_strided", "flatten", "unflatten", "narrow", "index_select", "gather", "repeat", "tile", "roll", "flip",
     "max_pool2d_with_indices", "max_pool2d", "max_pool1d", "_low_memory_max_pool_with_offsets",
     "_low_memory_max_pool_offsets_to_indices", "_unsafe_masked_index", "max_pool3d_with_indices", "pixel_shuffle",
     "detach", "diagonal", "view_as", "expand_as", "_reshape_alias", "new_zeros", "new_empty", "zeros_like",
     "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "split_copy", "diagonal_backward",
     "index", "masked_select", "view_copy", "permute_copy", "squeeze_copy", "unsqueeze_copy", "t_copy",
     "transpose_copy", "expand_copy", "slice_copy", "select_copy", "alias_copy", "pad")

_put(Category.CLEAR, "creation or explicit cast: the dtype is fixed by the op's own argument", "full", "zeros",
     "ones", "empty", "empty_strided", "scalar_tensor", "arange", "rand", "randn", "randint",
     "convert_element_type", "_to_copy", "to", "lift_fresh", "_unsafe_index", "iota", "copy_", "_assert_tensor_metadata")

_put(Category.GATHER, "table lookup: low precision only if casting the table costs less than it saves",
     "embedding", "_embedding_bag", "embedding_bag")


# DENY ops whose outputs are bounded whatever the input (softmax in [0, 1], a normalised activation within a few
# units times its affine weight): fp16's 65504 range holds them, so they may be *stored* fp16 even though they are
# computed in FP32. exp, pow and sums are not: their results are what overflows.
RANGE_SAFE = frozenset({"softmax", "_softmax", "_safe_softmax", "native_layer_norm", "layer_norm", "rms_norm",
                        "_fused_rms_norm", "native_batch_norm", "_native_batch_norm_legit",
                        "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training", "batch_norm",
                        "cudnn_batch_norm", "_batch_norm_with_update", "_batch_norm_with_update_functional",
                        "_batch_norm_no_update", "native_group_norm", "group_norm"})


def op_name(target: Any) -> str:
    """The bare aten name of an fx call target: aten.mm.default -> 'mm', prims.convert_element_type -> same."""
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def classify_name(name: str) -> Category:
    """Category of an aten-style op name ('mm', 'softmax', ...). Used by the ONNX fp16 pass too."""
    entry = _WHY.get(name) or _WHY.get(name.rstrip("_"))
    return entry[0] if entry else Category.UNKNOWN


def classify(target: Any) -> Category:
    return classify_name(op_name(target))


def reason(target: Any) -> str:
    entry = _WHY.get(op_name(target)) or _WHY.get(op_name(target).rstrip("_"))
    return entry[1] if entry else f"unknown op {op_name(target)!r}: kept FP32 (not on any list)"


def names(cat: Category) -> frozenset[str]:
    return frozenset(n for n, (c, _) in _WHY.items() if c is cat)
