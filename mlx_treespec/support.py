"""The gate: which targets can verify trees, and every reason a target cannot.

`tree_support(model)` inspects the model once, before any forward, and lists each blocker with
its layer index, all of them at once, so a user learns everything that stands in the way from a
single error.
"""
import functools
from dataclasses import dataclass
from typing import List, Optional

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from .cache import cache_kind
from .verify import GDN_CLASSES, ROPE_KEYS

# Families whose trees the test suite pins byte-identical to mlx-lm's decoding on CPU
# (tests/test_support.py::test_every_pinned_family_verifies_exactly and the drafter tests). A
# family outside this set that passes the structural checks is probed at start-up instead: a
# verify of a small tree against one-token decoding of each path, on its own weights.
VERIFIED_FAMILIES = {
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3", "gemma3_text", "gemma4",
    "gemma4_text", "phi3", "qwen3_5", "qwen3_5_moe", "qwen3_next",
    "cohere", "cohere2", "deepseek_v3", "ernie4_5", "exaone4", "gemma", "gemma2", "glm4",
    "gpt_oss", "granite", "helium", "hunyuan", "hunyuan_v1_dense", "internlm3", "llama4_text",
    "minicpm", "mixtral", "olmo2", "olmo3", "seed_oss", "smollm3", "stablelm", "starcoder2",
}

# Rope modules whose frequencies depend on the sequence length of the call, so a forward of
# several tokens at per-token positions cannot reproduce one-token decoding's rotation.
_NO_TOKEN_OFFSETS = {
    "DynamicNTKScalingRoPE": "dynamic NTK scaling recomputes the rope base from each call's "
                             "sequence length, which per-token positions do not give it",
}

# Layer classes known to carry state that cannot fork over a tree, with the reason.
_RECURRENT_CLASSES = {
    "Mamba": "Mamba state-space recurrence",
    "MambaBlock": "Mamba state-space recurrence",
    "JambaMambaMixer": "Mamba state-space recurrence",
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
    # the model runs a round's forwards, but a tree's tokens get wrong positions: a target's
    # verify would be wrong; a draft model's drafts are only poorer (the target decides)
    positions: bool = False

    def __str__(self):
        where = "model" if self.layer is None else f"layer {self.layer}"
        return f"{where}: {self.reason}"


class UnsupportedTarget(ValueError):
    def __init__(self, blockers, model_type=None):
        self.blockers = list(blockers)
        lines = "\n".join(f"  - {b}" for b in self.blockers)
        what = f"this target (model type {model_type!r})" if model_type else "this target"
        super().__init__(
            f"{what} cannot verify draft trees ({len(self.blockers)} blocker(s)):\n{lines}\n"
            "use a supported family or run plain decoding (no --draft-model / --drafter)"
        )


def _model_type(model):
    args = getattr(model, "args", None)
    return getattr(model, "model_type", None) or getattr(args, "model_type", None)


def _is_attention(module):
    name = type(module).__name__.lower()
    return "attention" in name or "attn" in name


def _ropes(layer):
    return [r for _, m in layer.named_modules() if isinstance(m, dict)
            for r in (m.get(k) for k in ROPE_KEYS) if isinstance(r, nn.Module)]


@functools.lru_cache(maxsize=None)
def _source_calls_rope(module_name):
    """Whether a model file calls mx.fast.rope itself (with the cache's offset: one position for
    every token of a forward)."""
    import inspect
    import sys

    try:
        return "fast.rope(" in inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return False


def tree_support(model) -> List[Blocker]:
    """Every reason this model cannot run tree verify, read from its layers and caches (not from
    its family's name); empty when it can."""
    blockers = []
    has_any_gdn = False
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
            ropes = _ropes(layer)
            attention = [m for _, m in layer.named_modules() if _is_attention(m)]
            if attention and not ropes and any(_source_calls_rope(type(m).__module__) for m in attention):
                blockers.append(Blocker(i, f"its attention ({type(attention[0]).__name__}) calls mx.fast.rope "
                                           "itself with the cache offset: no rope module to give each token "
                                           "of a tree its own position", positions=True))
            if has_gdn:
                has_any_gdn = True
                from .gdn import forkable

                gdn = [m for _, m in layer.named_modules() if {c.__name__ for c in type(m).__mro__} & GDN_CLASSES]
                if not all(forkable(m) for m in gdn):
                    blockers.append(Blocker(i, f"a GatedDeltaNet variant ({type(gdn[0]).__module__.rsplit('.', 1)[-1]}'s: "
                                               "separate q/k/v projections and convolutions) with no tree forward here"))
            elif not ropes and not attention:
                mixers = sorted(n for n in names if n not in _PLAIN_MODULES)
                blockers.append(Blocker(i, "neither an attention nor a tree-forking recurrence "
                                           f"(found: {', '.join(mixers)})"))
            for rope in ropes:
                why = next((w for c, w in _NO_TOKEN_OFFSETS.items()
                            if c in {k.__name__ for k in type(rope).__mro__}), None)
                if why:
                    blockers.append(Blocker(i, f"its rope ({type(rope).__name__}) takes no per-token "
                                               f"positions: {why}", positions=True))
                    break
    for name, m in model.named_modules():  # gpt2's wpe: one position per forward, the cache offset's
        towers = ("vision", "visual", "audio", "image")  # a multimodal model's encoders run no round
        if isinstance(m, nn.Embedding) and not any(t in name for t in towers) and (
                name.rsplit(".", 1)[-1] == "wpe" or "position" in name.rsplit(".", 1)[-1]):
            blockers.append(Blocker(None, f"learned absolute position embeddings ({name}) are read at the "
                                          "cache offset, not at each token's position in a tree", positions=True))
    try:
        caches = make_prompt_cache(model)
    except Exception as e:  # a model that cannot even make its caches cannot be verified
        blockers.append(Blocker(None, f"cannot build the model's caches: {e}"))
        caches = []
    kinds = [cache_kind(c) for c in caches]
    if has_any_gdn and kinds and not {"append", "rotating"} & set(kinds):  # forkable, but from where?
        blockers.append(Blocker(None, "no attention layer: a tree round reads the committed length from an "
                                      "attention cache (recurrent caches keep none)"))
    for i, c in enumerate(caches):
        kind = cache_kind(c)
        if kind is None:
            blockers.append(Blocker(i, f"cache type {type(c).__name__} has no tree implementation"))
        elif kind == "arrays" and not has_any_gdn:
            if not any(b.layer == i for b in blockers):
                blockers.append(Blocker(i, "recurrent state (ArraysCache) of a layer with no "
                                           "tree-forking implementation"))
    return blockers


def require_tree_support(model):
    """Raise UnsupportedTarget naming every blocker; a family the tests do not pin must also
    pass the exactness probe on its own weights (bitwise on CPU, no argmax flip on a GPU). A
    model that passes is remembered."""
    if getattr(model, "_treespec_supported", False):
        return
    blockers = tree_support(model)
    mtype = _model_type(model)
    if blockers:
        raise UnsupportedTarget(blockers, mtype)
    if mtype not in VERIFIED_FAMILIES:
        from .probe import probe_exactness, representative_tree_parents
        from .tree import chain_parents

        report = probe_exactness(model, [chain_parents(4), representative_tree_parents(2, 4, 10)],
                                 n_inputs=1, history=12)
        if not all(t.exact for t in report.topologies):
            raise UnsupportedTarget([Blocker(None, f"model type {mtype!r} is new to the gate and its "
                                                   f"tree verify differs from one-token decoding: "
                                                   f"{report.message()}")], mtype)
    model._treespec_supported = True
