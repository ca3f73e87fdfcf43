"""mlx_treespec: draft-tree speculative decoding for mlx-lm models.

    from mlx_treespec import stream_generate, generate
"""
import importlib

__version__ = "0.1.0"

# Resolved on first use, so `python -m mlx_treespec.generate` runs the module once, cleanly.
_EXPORTS = {
    "DraftTree": "tree", "RoundStats": "generate", "TreeRound": "verify", "generate": "generate",
    "stream_generate": "generate", "tree_generate_step": "generate", "tree_support": "support",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
