import os
import tempfile

# start-up cost fits (costmodel.startup_costs) go to a per-run folder, not the user's cache
os.environ["MLX_TREESPEC_CACHE"] = tempfile.mkdtemp(prefix="mlx_treespec_costs_")
