"""mlx_treespec: draft-tree speculative decoding for mlx-lm models.

    from mlx_treespec import stream_generate, generate
"""
from .generate import RoundStats, generate, stream_generate, tree_generate_step
from .support import tree_support
from .tree import DraftTree
from .verify import TreeRound

__version__ = "0.1.0"

__all__ = ["DraftTree", "RoundStats", "TreeRound", "generate", "stream_generate",
           "tree_generate_step", "tree_support"]
