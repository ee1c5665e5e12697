"""Model protection for deployed ONNX models: obfuscation (opaque names, scaled and split weights, identity ops,
opaque branches, shuffled order) and optional weight encryption with a key needed at load time.

    from automp import protect
    # key.txt: 64 hex characters, e.g. `openssl rand -hex 32 > key.txt`
    model, report = protect.obfuscate("model.onnx", protect.ObfuscateConfig(seed=0, key="key.txt"))
    sess = protect.session("protected.onnx", "key.txt")

Obfuscation-grade, not a security audit: see automp.protect.obfuscate for what it does and does not hide.
"""
from automp.protect.cli import main
from automp.protect.encrypt import WrongKeyError, is_encrypted, load, read_key, session
from automp.protect.obfuscate import ObfuscateConfig, obfuscate
from automp.protect.report import ProtectReport

__all__ = ["obfuscate", "ObfuscateConfig", "ProtectReport", "load", "session", "read_key", "is_encrypted",
           "WrongKeyError", "main"]
