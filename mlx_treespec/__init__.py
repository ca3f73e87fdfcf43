"""mlx_treespec: draft-tree speculative decoding for mlx-lm models.

    from mlx_treespec import stream_generate, generate

The names below are imported eagerly, as mlx-lm does, so `mlx_treespec.generate` is the function
whichever submodule was imported first (`from mlx_treespec.generate import stream_generate`
still reads the package that holds it).
"""
__version__ = "0.1.0"

from .draft import Draft, Drafter, Layout  # noqa: E402
from .generate import generate, make_drafter, stream_generate  # noqa: E402
from .loop import RoundStats, tree_generate_step  # noqa: E402
from .spec import DraftSpec  # noqa: E402
from .support import tree_support  # noqa: E402
from .tree import DraftTree  # noqa: E402
from .verify import TreeRound  # noqa: E402

__all__ = ["Draft", "DraftSpec", "DraftTree", "Drafter", "Layout", "RoundStats", "TreeRound", "generate",
           "make_drafter", "stream_generate", "tree_generate_step", "tree_support"]
