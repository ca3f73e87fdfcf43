"""Tiny float32 mlx-lm models with random weights that still produce varied text.

A plain random init repeats one token; scaling every weight matrix up (x3) makes the argmax move.
The drafter is the target with every matrix perturbed by 0.05 x its std, so some drafts are
accepted and some rejected.
"""
import copy

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.utils import _get_classes

VOCAB = 96

BASE = dict(
    hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, vocab_size=VOCAB,
    max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False,
)

CONFIGS = {
    "llama": dict(BASE, model_type="llama"),
    "mistral": dict(BASE, model_type="mistral"),
    "qwen2": dict(BASE, model_type="qwen2"),
    "qwen3": dict(BASE, model_type="qwen3"),
    "qwen3_moe": dict(BASE, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
                      norm_topk_prob=True),
    "phi3": dict(BASE, model_type="phi3", num_hidden_layers=2),
    "gemma3": dict(BASE, model_type="gemma3_text", num_hidden_layers=3, sliding_window=8,
                   sliding_window_pattern=2, query_pre_attn_scalar=16, rope_local_base_freq=10000.0,
                   rope_global_base_freq=1000000.0),
    "gemma4": dict(model_type="gemma4_text", hidden_size=64, num_hidden_layers=6,
                   intermediate_size=128, num_attention_heads=4, head_dim=16, global_head_dim=32,
                   num_key_value_heads=2, num_kv_shared_layers=2, vocab_size=VOCAB,
                   vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                   sliding_window=8, sliding_window_pattern=3, rms_norm_eps=1e-6,
                   max_position_embeddings=4096, tie_word_embeddings=True,
                   rope_parameters={"full_attention": {"rope_type": "proportional",
                                                       "partial_rotary_factor": 0.25,
                                                       "rope_theta": 1000000.0},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0}}),
}
HYBRID = dict(BASE, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=32, linear_value_head_dim=16, linear_conv_kernel_dim=4,
              full_attention_interval=2)
CONFIGS["qwen3_5"] = dict(HYBRID, model_type="qwen3_5")
CONFIGS["qwen3_next"] = dict(HYBRID, model_type="qwen3_next", num_experts=4, num_experts_per_tok=2,
                             decoder_sparse_step=1, shared_expert_intermediate_size=64,
                             mlp_only_layers=[], moe_intermediate_size=64,
                             partial_rotary_factor=0.25, norm_topk_prob=True)
CONFIGS["qwen3_next_dense"] = dict(CONFIGS["qwen3_next"], num_experts=0, num_experts_per_tok=0,
                                   shared_expert_intermediate_size=0, moe_intermediate_size=0)
ATTENTION = [k for k in CONFIGS if not k.startswith("qwen3_5") and not k.startswith("qwen3_next")]


# gemma4's logit soft-capping and embedding scale saturate at x3; x1 already varies
SCALES = {"gemma4_text": 1.0}


def build(cfg, seed=0, scale=None):
    scale = SCALES.get(cfg["model_type"], 3.0) if scale is None else scale
    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    params = tree_map(lambda p: p * scale if p.ndim >= 2 else p, model.parameters())
    model.update(params)
    model.eval()
    mx.eval(model.parameters())
    return model


def perturbed(model, noise=0.05, seed=1):
    mx.random.seed(seed)
    draft = copy.deepcopy(model)
    flat = []
    for k, p in tree_flatten(draft.parameters()):
        if p.ndim >= 2:
            p = p + noise * mx.std(p) * mx.random.normal(p.shape, dtype=p.dtype)
        flat.append((k, p))
    draft.update(tree_unflatten(flat))
    mx.eval(draft.parameters())
    return draft


class SiblingDrafter:
    """Test drafter for targets of any kind: a draft model's greedy chain plus, at every depth,
    the runner-up tokens as sibling leaves. It decodes plainly from a copy of its cache each
    round (fine for tiny models), so it works with recurrent draft models too."""

    capture = ()

    def __init__(self, model, depth=4, width=2):
        self.model, self.depth, self.width = model, depth, width
        self.tokens = []

    def reset(self):
        self.tokens = []

    def prefill(self, prompt):
        self.tokens = list(prompt)

    def probe_parents(self):
        import numpy as np

        parents = [-1]
        for d in range(self.depth):
            spine = len(parents) - self.width if d else 0
            parents += [spine] * self.width
        return np.array(parents)

    def draft(self, root, max_depth):
        import numpy as np
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_treespec.draft import Draft, Layout

        depth = min(self.depth, max_depth)
        if depth == 0:
            return Draft.root_only(root)
        cache = make_prompt_cache(self.model)
        logits = self.model(mx.array(self.tokens)[None], cache=cache)[0, -1]
        tokens, parents, spine = [root], [-1], 0
        for d in range(depth):
            order = mx.argsort(-logits).tolist()[: self.width]
            for rank, t in enumerate(order):
                tokens.append(t)
                parents.append(spine)
            spine = len(tokens) - self.width  # the best child continues the chain
            if d + 1 < depth:
                logits = self.model(mx.array([[order[0]]]), cache=cache)[0, -1]
        return Draft(mx.array(tokens, dtype=mx.uint32), Layout.host(parents), budget=len(tokens) - 1, depth=depth)

    def commit(self, draft, path, emitted):
        self.tokens += list(emitted)
