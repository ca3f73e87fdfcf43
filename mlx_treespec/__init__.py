"""mlx_treespec: draft-tree speculative decoding for mlx-lm models."""
