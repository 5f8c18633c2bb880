"""kvtier: a storage engine for LLM KV cache outside GPU memory.

The package's job is :mod:`kvtier.vllm`: ``KvtierTier``, vLLM 0.33's out-of-tree secondary
tier (see ``docs/vllm.md``). Importing ``kvtier`` or ``kvtier.vllm`` loads nothing native and
starts nothing: the extension module ``kvtier._native`` is loaded on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["ConfigError", "KvtierError", "PathError", "native"]


def native():
    """The extension module ``kvtier._native`` (loaded on the first call)."""
    from kvtier import _native

    return _native


def __getattr__(name: str):
    # The exception classes live in the extension module; reach them without loading it at
    # import time.
    if name in ("ConfigError", "KvtierError", "PathError"):
        return getattr(native(), name)
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
