"""The shipped demo target, drafter and hybrid target (see bench/DEMO_PAIR.md).

Three small models trained on Python source code, sharing one 4096-token byte-level BPE
tokenizer, each an mlx-lm folder that ``mlx_lm.load`` opens offline:

* ``target``: Qwen3 (mlx-lm ``qwen3``), 8 layers, hidden 384, ~14.2M parameters;
* ``drafter``: Qwen3, 2 layers, hidden 256, ~2.6M parameters;
* ``hybrid``: Qwen3.5 text model (mlx-lm ``qwen3_5``): GatedDeltaNet linear attention
  with full attention every 4th layer, 8 layers, hidden 256, ~4.1M parameters.

    >>> import mlx_lm
    >>> from mlx_treespec.demo import demo_path
    >>> model, tokenizer = mlx_lm.load(demo_path("target"))
"""

from pathlib import Path

NAMES = ("target", "drafter", "hybrid")


def demo_path(name: str) -> str:
    """Folder of the shipped demo model ``name`` ("target", "drafter" or "hybrid")."""
    if name not in NAMES:
        raise ValueError(f"unknown demo model {name!r}; expected one of {NAMES}")
    path = Path(__file__).resolve().parent / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"demo model folder missing or incomplete: {path}")
    return str(path)


__all__ = ["NAMES", "demo_path"]
