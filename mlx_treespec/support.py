"""The gate: which targets can verify trees, and every reason a target cannot.

`tree_support(model)` inspects the model once, before any forward, and lists each blocker with
its layer index, all of them at once, so a user learns everything that stands in the way from a
single error.
"""
from dataclasses import dataclass
from typing import List, Optional

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from .cache import cache_kind
from .verify import GDN_CLASSES

# Families whose attention, masks and caches are verified (tests/test_generate.py) to run trees.
ATTENTION_FAMILIES = {
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3", "gemma3_text", "gemma4",
    "gemma4_text", "phi3",
}
# Hybrid families whose recurrent layers fork over a tree (mlx_treespec.gdn).
RECURRENT_FAMILIES = {"qwen3_5", "qwen3_5_moe", "qwen3_next"}

# Layer classes known to carry state that cannot fork over a tree, with the reason.
_RECURRENT_CLASSES = {
    "Mamba": "Mamba state-space recurrence",
    "MambaBlock": "Mamba state-space recurrence",
    "Mamba2Block": "Mamba2 state-space recurrence",
    "Mamba2Mixer": "Mamba2 state-space recurrence",
    "Mamba2": "Mamba2 state-space recurrence",
    "Rwkv7TimeMixing": "RWKV7 time-mixing recurrence",
    "RecurrentBlock": "RG-LRU recurrence",
    "ShortConv": "short convolution state",
}


# Building blocks that carry no sequence state (what is left of a layer once its mixer is named).
_PLAIN_MODULES = {"Linear", "QuantizedLinear", "RMSNorm", "LayerNorm", "Embedding", "MLP",
                  "SwitchGLU", "SwitchLinear", "QuantizedSwitchLinear", "Identity", "Dropout"}


@dataclass(frozen=True)
class Blocker:
    layer: Optional[int]  # None: the whole model
    reason: str

    def __str__(self):
        where = "model" if self.layer is None else f"layer {self.layer}"
        return f"{where}: {self.reason}"


class UnsupportedTarget(ValueError):
    def __init__(self, blockers):
        self.blockers = list(blockers)
        lines = "\n".join(f"  - {b}" for b in self.blockers)
        super().__init__(
            f"this target cannot verify draft trees ({len(self.blockers)} blocker(s)):\n{lines}\n"
            "use a supported family or run plain decoding (no --draft-model / --drafter)"
        )


def _model_type(model):
    args = getattr(model, "args", None)
    return getattr(model, "model_type", None) or getattr(args, "model_type", None)


def _gdn_ready():
    try:
        from . import gdn  # noqa: F401

        return hasattr(gdn, "gdn_layer_tree_forward")
    except ImportError:
        return False


def tree_support(model) -> List[Blocker]:
    """Every reason this model cannot run tree verify; empty when it can."""
    blockers = []
    mtype = _model_type(model)
    known = ATTENTION_FAMILIES | (RECURRENT_FAMILIES if _gdn_ready() else set())
    if mtype not in known:
        blockers.append(Blocker(None, f"model type {mtype!r} is not a family verified to run trees "
                                      f"(supported: {', '.join(sorted(known))})"))
    layers = list(getattr(model, "layers", []))
    for i, layer in enumerate(layers):
        names = {type(m).__name__ for _, m in layer.named_modules()}
        for cls, why in _RECURRENT_CLASSES.items():
            if cls in names:
                blockers.append(Blocker(i, f"{why} ({cls}) has no tree-forking implementation"))
                break
        else:
            base_names = {c.__name__ for _, m in layer.named_modules() for c in type(m).__mro__}
            has_gdn = bool(base_names & GDN_CLASSES)
            has_rope = any(isinstance(m.get("rope"), nn.Module) for _, m in layer.named_modules()
                           if isinstance(m, dict))
            if has_gdn and not _gdn_ready():
                blockers.append(Blocker(i, "GatedDeltaNet recurrence: tree-forking scan not available"))
            elif not has_gdn and not has_rope:
                mixers = sorted(n for n in names if n not in _PLAIN_MODULES)
                blockers.append(Blocker(i, "neither an attention with a rope module nor a "
                                           f"tree-forking recurrence (found: {', '.join(mixers)})"))
    try:
        caches = make_prompt_cache(model)
    except Exception as e:  # a model that cannot even make its caches cannot be verified
        blockers.append(Blocker(None, f"cannot build the model's caches: {e}"))
        caches = []
    for i, c in enumerate(caches):
        kind = cache_kind(c)
        if kind is None:
            blockers.append(Blocker(i, f"cache type {type(c).__name__} has no tree implementation"))
        elif kind == "arrays" and not (mtype in RECURRENT_FAMILIES and _gdn_ready()):
            if not any(b.layer == i for b in blockers):
                blockers.append(Blocker(i, "recurrent state (ArraysCache) of a layer with no "
                                           "tree-forking implementation"))
    return blockers


def require_tree_support(model):
    """Raise UnsupportedTarget naming every blocker; a model that passes is remembered."""
    if getattr(model, "_treespec_supported", False):
        return
    blockers = tree_support(model)
    if blockers:
        raise UnsupportedTarget(blockers)
    model._treespec_supported = True
