"""The shipped demo target, drafter and hybrid target (see bench/DEMO_PAIR.md).

Three small models trained on Python source code, sharing one 4096-token byte-level BPE
tokenizer, each an mlx-lm folder that ``mlx_lm.load`` opens offline:

* ``target``: Qwen3 (mlx-lm ``qwen3``), 8 layers, hidden 384, ~14.2M parameters;
* ``drafter``: Qwen3, 2 layers, hidden 256, ~2.6M parameters;
* ``hybrid``: Qwen3.5 text model (mlx-lm ``qwen3_5``): GatedDeltaNet linear attention
  with full attention every 4th layer, 8 layers, hidden 256, ~4.1M parameters;
* ``hybrid_drafter``: a Qwen3.5 draft model for the hybrid (one GatedDeltaNet layer, one full
  attention layer, hidden 256, ~1.9M parameters, 8-bit), trained on the hybrid's own greedy text.

and drafting heads trained on the targets' hidden states (bench/DEMO_PAIR.md, "The drafting
heads"): ``dflash`` (a DFlash block drafter for the target), ``hybrid_dflash`` (for the hybrid),
``eagle3`` (an EAGLE-3 head for the target); the hybrid's MTP layer lives in its own folder.

    >>> import mlx_lm
    >>> from mlx_treespec.demo import demo_path
    >>> model, tokenizer = mlx_lm.load(demo_path("target"))
"""

from pathlib import Path

NAMES = ("target", "drafter", "hybrid", "hybrid_drafter")  # mlx-lm model folders
HEADS = ("dflash", "hybrid_dflash", "eagle3")  # drafting heads (no tokenizer: they use the target's)


def demo_path(name: str) -> str:
    """Folder of the shipped demo model or head ``name`` (NAMES, HEADS)."""
    if name not in NAMES + HEADS:
        raise ValueError(f"unknown demo model {name!r}; expected one of {NAMES + HEADS}")
    path = Path(__file__).resolve().parent / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"demo model folder missing or incomplete: {path}")
    return str(path)


__all__ = ["NAMES", "HEADS", "demo_path"]
