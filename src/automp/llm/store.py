"""Where quantized models come from and go to: built-in random-weight models, local transformers directories, and
automp's own save/load format.

Format (a directory): `model.safetensors` with every parameter and buffer of the quantized model (packed codes,
scales, fp16 embeddings/norms/lm_head, and non-persistent buffers such as rotary frequencies, so nothing has to be
recomputed) and `automp_llm.json` with the quantization config, the transformers config and class, each QuantLinear's
(and QuantEmbedding's) shape, tied-weight aliases (safetensors stores shared tensors once) and, for a model made by
`build`, the built-in's name (its weights are random: `automp llm generate` says so). Fused projections
(automp.llm.fuse) are saved as their members' own tensors, and `load` fuses them again. `load` builds the
architecture on the meta device (no weight memory, no init), puts empty shells where the quantized layers were and
assigns the saved tensors: no re-quantization, bitwise-identical buffers. Both files carry one save id, so files of
different saves are detected rather than loaded together.

A save replaces the whole directory: everything is written into a temporary sibling `.<name>.automp-tmp-<pid>-<id>`
and swapped in with one atomic exchange, so no file of an earlier save (a tokenizer the new model does not have)
survives, and an interrupted save leaves the previous model as it was. A save killed outright (kill -9) leaves its
temporary sibling behind; the next save into the same place removes those whose process is gone, and `load` never
reads them (it reads the directory it is given).
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import uuid
from dataclasses import asdict

import torch
import torch.nn as nn

from automp.files import fsync_path
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
    """A built-in model with seeded random weights, created on `device` (the global RNG is left as it was). Its
    `automp_builtin` attribute names it; `save` keeps the name and `load` gives it back."""
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
    model = model.to(dtype).eval()
    model.automp_builtin = name
    return model


def builtin_name(model: nn.Module) -> str | None:
    """The built-in (random-weight) model `model` was made from by `build`, possibly quantized, saved and loaded
    since; None for any other model."""
    name = getattr(model, "automp_builtin", None)
    return name if isinstance(name, str) else None


def unreadable(path: str, error: Exception, what: str = "safetensors", where: str = "automp.llm") -> ValueError:
    """The one-line error for a weights (or tokenizer) file that cannot be parsed: the file, and the parser's first
    line."""
    return ValueError(f"{where}: {path} is not a readable {what} file, truncated or damaged ({_first_line(error)})")


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _damaged_safetensors(directory: str) -> str | None:
    """The first *.safetensors file of `directory` whose header does not parse or does not cover the file, with the
    reason; None if all of them open."""
    from safetensors import SafetensorError, safe_open
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        if entry.endswith(".safetensors") and os.path.isfile(path):
            try:
                with safe_open(path, framework="pt"):
                    pass
            except SafetensorError as e:  # safetensors checks the header against the file size on opening
                return str(unreadable(path, e))
    return None


def load_source(source: str, device: torch.device | str = "cpu") -> nn.Module:
    """A built-in name, or a local transformers model directory (never downloads)."""
    if source in BUILTIN:
        return build(source, device)
    if not os.path.isdir(source):
        raise FileNotFoundError(f"automp.llm: {source!r} is neither a built-in model ({', '.join(BUILTIN)}) nor a "
                                f"directory")
    if os.path.isfile(os.path.join(source, META)):
        raise ValueError(f"automp.llm: {source} is already an automp quantized model (use `automp llm generate`)")
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    try:
        model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True)
    except SafetensorError as e:  # transformers does not say which file: name the damaged one
        raise ValueError(_damaged_safetensors(source) or f"automp.llm: cannot read the weights in {source}, "
                         f"truncated or damaged ({_first_line(e)})") from None
    except (OSError, RuntimeError, EOFError) as e:  # a damaged pytorch_model.bin: torch.load's error names no file
        binaries = sorted(f for f in os.listdir(source) if f.endswith(".bin"))
        if not binaries:
            raise
        raise ValueError(f"automp.llm: cannot read the weights in {os.path.join(source, binaries[0])}"
                         f"{' (or another .bin file there)' if len(binaries) > 1 else ''}, truncated or damaged "
                         f"({_first_line(e)})") from None
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


_TMP = re.compile(r"^\.(?P<name>.+)\.automp-tmp-(?P<pid>\d+)-[0-9a-f]+$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temps(parent: str, name: str) -> list[str]:
    """Remove the temporary siblings of `parent/name` that saves killed before they finished left behind (their
    process is gone); returns the removed paths. Those of running processes, this one included, are left alone."""
    removed = []
    for entry in os.listdir(parent):
        m = _TMP.match(entry)
        if m and m["name"] == name and int(m["pid"]) != os.getpid() and not _alive(int(m["pid"])):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
            removed.append(os.path.join(parent, entry))
    return removed


def _exchange(a: str, b: str) -> bool:
    """Swap two existing paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where this system or
    filesystem has no such call."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def _swap_in(tmp: str, dest: str) -> None:
    """Make the directory `tmp` be `dest`, which may hold an earlier save; the earlier files are deleted."""
    if not os.path.lexists(dest):
        os.rename(tmp, dest)
    elif _exchange(tmp, dest):
        shutil.rmtree(tmp)  # now the earlier save
    else:  # two renames: a crash between them leaves dest missing and both copies beside it
        old = f"{tmp}0"
        os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old)
    fsync_path(os.path.dirname(dest))


def check_destination(directory: str) -> None:
    """A save replaces the whole directory: only an empty one or an earlier save may be there, never a directory
    of other files (an output given as `.` or `~` must not delete them)."""
    if not os.path.exists(directory):
        return
    if not os.path.isdir(directory):
        raise NotADirectoryError(f"automp.llm.save: {directory} exists and is not a directory")
    if os.listdir(directory) and not os.path.isfile(os.path.join(directory, META)):
        raise FileExistsError(f"automp.llm.save: {directory} holds files that are not an automp quantized model; "
                              "refusing to replace it (give a new or empty directory)")


def save(model: nn.Module, directory: str, tokenizer=None) -> None:
    """Write a model quantized by automp.llm.quantize (and optionally its transformers tokenizer) to `directory`,
    replacing an earlier save there as a whole."""
    from safetensors.torch import save_file
    if not is_quantized(model):
        raise ValueError("automp.llm.save: the model was not quantized by automp.llm.quantize")
    arch_of(model)
    real = os.path.realpath(directory)
    check_destination(real)
    tensors, aliases = _unique_tensors(model)
    save_id = uuid.uuid4().hex
    meta = {"format": FORMAT, "version": VERSION, "save_id": save_id, "architecture": type(model).__name__,
            "config_class": type(model.config).__name__, "model_config": json.loads(model.config.to_json_string()),
            "quant": asdict(model.automp_quant), "aliases": aliases, "builtin": builtin_name(model),
            "layers": {n: m.spec() for n, m in model.named_modules() if isinstance(m, QuantLinear)},
            "embeddings": {n: m.spec() for n, m in model.named_modules() if isinstance(m, QuantEmbedding)}}
    parent, name = os.path.split(real)
    os.makedirs(parent, exist_ok=True)
    remove_stale_temps(parent, name)
    tmp = os.path.join(parent, f".{name}.automp-tmp-{os.getpid()}-{save_id[:8]}")
    os.mkdir(tmp)
    try:
        save_file(tensors, os.path.join(tmp, WEIGHTS), metadata={"save_id": save_id})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f, indent=1)
        for entry in os.listdir(tmp):
            if os.path.isfile(os.path.join(tmp, entry)):
                fsync_path(os.path.join(tmp, entry))
        _swap_in(tmp, real)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
    from safetensors import SafetensorError, safe_open
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
    try:
        with safe_open(path, framework="pt", device=str(device)) as f:
            same_save = (f.metadata() or {}).get("save_id") == meta["save_id"]
            tensors = {k: f.get_tensor(k) for k in f.keys()} if same_save else {}
    except SafetensorError as e:  # truncated or overwritten: safetensors checks the header against the file size
        raise unreadable(path, e, where="automp.llm.load") from None
    if not same_save:
        raise ValueError(f"automp.llm.load: {WEIGHTS} and {META} in {directory} come from different saves")
    _assign(model, tensors, meta["aliases"])
    model.automp_quant = quant
    if isinstance(meta.get("builtin"), str):  # absent in files saved before it was recorded
        model.automp_builtin = meta["builtin"]
    fuse_projections(model)  # the saved tensors are per layer: fusing again makes the views (quant.fuse permitting)
    return model.eval()


def has_tokenizer(directory: str) -> bool:
    """Whether a model directory holds tokenizer files. Without them transformers' AutoTokenizer still builds a
    tokenizer from the model config, one with an empty vocabulary: only its files make a tokenizer worth saving."""
    return any(os.path.isfile(os.path.join(directory, f)) for f in ("tokenizer_config.json", "tokenizer.json"))


def load_tokenizer(directory: str):
    """The transformers tokenizer saved beside the model, else the built-in byte tokenizer."""
    from automp.llm.generate import ByteTokenizer
    if has_tokenizer(directory):
        from transformers import AutoTokenizer
        for entry in _TOKENIZER_JSON:  # transformers' JSON errors do not say which file: check them here first
            path = os.path.join(directory, entry)
            if os.path.isfile(path):
                try:
                    with open(path, encoding="utf-8") as f:
                        json.load(f)
                except (ValueError, UnicodeDecodeError) as e:
                    raise unreadable(path, e, "JSON", "automp.llm.load") from None
        try:
            return AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError) as e:  # never a quiet fallback to bytes: the ids would mean other text
            raise ValueError(f"automp.llm.load: the tokenizer files in {directory} cannot be read "
                             f"({_first_line(e)}); repair them, or remove them to use the byte tokenizer") from None
    return ByteTokenizer()


_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json")
