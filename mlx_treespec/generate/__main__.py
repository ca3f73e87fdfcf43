"""`python -m mlx_treespec.generate`: the command line (mlx_treespec/cli.py)."""
from ..cli import main

main()
