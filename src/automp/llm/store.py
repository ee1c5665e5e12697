"""Where quantized models come from and go to: built-in random-weight models, local transformers directories, and
automp's own save/load format.

Format (a directory): `model.safetensors` with every parameter and buffer of the quantized model (packed codes,
scales, fp16 embeddings/norms/lm_head, and non-persistent buffers such as rotary frequencies, so nothing has to be
recomputed) and `automp_llm.json` with the quantization config, the transformers config and class, each QuantLinear's
(and QuantEmbedding's) shape, and tied-weight aliases (safetensors stores shared tensors once). Fused projections
(automp.llm.fuse) are saved as their members' own tensors, and `load` fuses them again. `load` builds the
architecture on the meta device (no weight memory, no init), puts empty shells where the quantized layers were and
assigns the saved tensors: no re-quantization, bitwise-identical buffers. Both files are written through
automp.files.atomic_output, the JSON last, and carry one save id, so a half-replaced directory is detected rather
than loaded.
"""
from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict

import torch
import torch.nn as nn

from automp.files import atomic_output
from automp.llm.fuse import fuse_projections
from automp.llm.quantize import ARCHS, DTYPES, QuantConfig, QuantEmbedding, QuantLinear, arch_of, check_backend, \
    is_quantized, set_module

META = "automp_llm.json"
WEIGHTS = "model.safetensors"
FORMAT, VERSION = "automp-llm", 1

_BYTE_VOCAB = {"vocab_size": 256, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
BUILTIN = {  # name: (model class, config class, config); random weights, byte-level vocabularies where small
    "tiny-llama": ("LlamaForCausalLM", "LlamaConfig", dict(
        _BYTE_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024)),
    "tiny-gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(_BYTE_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=1024)),
    "llama-small": ("LlamaForCausalLM", "LlamaConfig", dict(
        _BYTE_VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024)),
    "llama-1b": ("LlamaForCausalLM", "LlamaConfig", dict(  # TinyLlama-1.1B's shape
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5)),
}


def build(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
          **overrides) -> nn.Module:
    """A built-in model with seeded random weights, created on `device` (the global RNG is left as it was)."""
    import transformers
    if name not in BUILTIN:
        raise ValueError(f"automp.llm: unknown built-in model {name!r}; built-ins: {', '.join(BUILTIN)}")
    model_cls, config_cls, kw = BUILTIN[name]
    config = getattr(transformers, config_cls)(**{**kw, **overrides})
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:
            model = getattr(transformers, model_cls)(config)
    return model.to(dtype).eval()


def load_source(source: str, device: torch.device | str = "cpu") -> nn.Module:
    """A built-in name, or a local transformers model directory (never downloads)."""
    if source in BUILTIN:
        return build(source, device)
    if not os.path.isdir(source):
        raise FileNotFoundError(f"automp.llm: {source!r} is neither a built-in model ({', '.join(BUILTIN)}) nor a "
                                f"directory")
    if os.path.isfile(os.path.join(source, META)):
        raise ValueError(f"automp.llm: {source} is already an automp quantized model (use `automp llm generate`)")
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True)
    arch_of(model)
    return model.to(device).eval()


def _unique_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every parameter and buffer by name, each storage once; aliases map a tied name to the stored one."""
    tensors, aliases, seen = {}, {}, {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        key = (t.data_ptr(), tuple(t.shape), t.dtype, t.stride())
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            tensors[name] = t.detach().to("cpu", copy=True).contiguous()
    return tensors, aliases


def save(model: nn.Module, directory: str, tokenizer=None) -> None:
    """Write a model quantized by automp.llm.quantize (and optionally its transformers tokenizer) to `directory`."""
    from safetensors.torch import save_file
    if not is_quantized(model):
        raise ValueError("automp.llm.save: the model was not quantized by automp.llm.quantize")
    arch_of(model)
    tensors, aliases = _unique_tensors(model)
    save_id = uuid.uuid4().hex
    meta = {"format": FORMAT, "version": VERSION, "save_id": save_id, "architecture": type(model).__name__,
            "config_class": type(model.config).__name__, "model_config": json.loads(model.config.to_json_string()),
            "quant": asdict(model.automp_quant), "aliases": aliases,
            "layers": {n: m.spec() for n, m in model.named_modules() if isinstance(m, QuantLinear)},
            "embeddings": {n: m.spec() for n, m in model.named_modules() if isinstance(m, QuantEmbedding)}}
    os.makedirs(directory, exist_ok=True)
    with atomic_output(os.path.join(directory, META)) as meta_tmp:
        tmp_dir = os.path.dirname(meta_tmp)
        save_file(tensors, os.path.join(tmp_dir, WEIGHTS), metadata={"save_id": save_id})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp_dir)
        with open(meta_tmp, "w") as f:
            json.dump(meta, f, indent=1)


def _read_meta(directory: str) -> dict:
    path = os.path.join(directory, META)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"automp.llm.load: {directory} has no {META} (not saved by automp.llm.save)")
    with open(path) as f:
        try:
            meta = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"automp.llm.load: {path} is not valid JSON ({e})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"automp.llm.load: {path} is not an {FORMAT} v{VERSION} file "
                         f"(format {meta.get('format')!r}, version {meta.get('version')!r})")
    if meta["architecture"] not in ARCHS:
        raise TypeError(f"automp.llm.load: unsupported architecture {meta['architecture']}; supported: "
                        f"{', '.join(sorted(ARCHS))}")
    return meta


def _assign(model: nn.Module, tensors: dict[str, torch.Tensor], aliases: dict[str, str]) -> None:
    """Put each saved tensor in place of the meta placeholder of the same name (shapes must agree)."""
    slots = dict(model.named_parameters(remove_duplicate=False))
    slots.update(model.named_buffers(remove_duplicate=False))
    missing = sorted(set(slots) - set(tensors) - set(aliases))
    unexpected = sorted((set(tensors) | set(aliases)) - set(slots))
    if missing or unexpected:
        raise ValueError(f"automp.llm.load: saved tensors do not match the architecture: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    placed: dict[str, torch.Tensor] = {}
    for name in list(tensors) + list(aliases):
        parent, _, leaf = name.rpartition(".")
        module = model.get_submodule(parent)
        if name in aliases:
            value = placed[aliases[name]]
        else:
            value = tensors[name]
            if tuple(value.shape) != tuple(slots[name].shape):
                raise ValueError(f"automp.llm.load: {name} has shape {tuple(value.shape)}, the architecture "
                                 f"expects {tuple(slots[name].shape)}")
        if leaf in module._parameters:
            value = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=False)
            module._parameters[leaf] = value
        else:
            module._buffers[leaf] = value
        placed[name] = value
    for m in model.modules():  # transformers 4.x keeps a copy of the rotary frequencies as a plain attribute
        orig = getattr(m, "original_inv_freq", None)
        if isinstance(orig, torch.Tensor) and orig.is_meta and isinstance(getattr(m, "inv_freq", None), torch.Tensor):
            m.original_inv_freq = m.inv_freq.clone()


def load(directory: str, device: torch.device | str = "cpu") -> nn.Module:
    """Rebuild a model written by `save` on `device`, without re-quantizing."""
    import transformers
    from safetensors import safe_open
    meta = _read_meta(directory)
    quant = QuantConfig(**meta["quant"])
    device = torch.device(device)
    check_backend(quant.bits, device)
    config = getattr(transformers, meta["config_class"]).from_dict(meta["model_config"])
    with torch.device("meta"):
        model = getattr(transformers, meta["architecture"])(config)
        for path, spec in meta["layers"].items():
            set_module(model, path, QuantLinear(**spec, dtype=DTYPES[quant.dtype]))
        for path, spec in meta.get("embeddings", {}).items():  # absent in files saved before embeddings were
            set_module(model, path, QuantEmbedding(**spec, dtype=DTYPES[quant.dtype]))
    path = os.path.join(directory, WEIGHTS)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"automp.llm.load: {directory} has no {WEIGHTS}")
    with safe_open(path, framework="pt", device=str(device)) as f:
        if (f.metadata() or {}).get("save_id") != meta["save_id"]:
            raise ValueError(f"automp.llm.load: {WEIGHTS} and {META} in {directory} come from different saves")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    _assign(model, tensors, meta["aliases"])
    model.automp_quant = quant
    fuse_projections(model)  # the saved tensors are per layer: fusing again makes the views (quant.fuse permitting)
    return model.eval()


def load_tokenizer(directory: str):
    """The transformers tokenizer saved beside the model, else the built-in byte tokenizer."""
    from automp.llm.generate import ByteTokenizer
    if os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return ByteTokenizer()
