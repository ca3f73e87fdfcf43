"""Tiny float32 mlx-lm models with random weights that still produce varied text.

A plain random init repeats one token; scaling every weight matrix up (x3) makes the argmax move.
The drafter is the target with every matrix perturbed by 0.05 x its std, so some drafts are
accepted and some rejected.
"""
import copy

import numpy as np
import mlx.core as mx
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

# More mlx-lm families, each pinned by tests/test_support.py (trees byte-identical to mlx-lm);
# support.VERIFIED_FAMILIES lists them.
COVERAGE = {f: dict(BASE, model_type=f, **extra) for f, extra in {
    "cohere": dict(layer_norm_eps=1e-5, logit_scale=0.5),
    "cohere2": dict(layer_norm_eps=1e-5, logit_scale=0.5, sliding_window=8, sliding_window_pattern=2),
    "deepseek_v3": dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16,
                        qk_nope_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=1, topk_group=1, routed_scaling_factor=1.0),  # MLA
    "ernie4_5": dict(use_bias=False),
    "exaone4": dict(sliding_window=8, sliding_window_pattern="LG", rope_scaling=None),
    "gemma": dict(),
    "gemma2": dict(query_pre_attn_scalar=16, sliding_window=8, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0),
    "glm4": dict(partial_rotary_factor=0.5, attention_bias=False),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"]),  # sinks
    "granite": dict(logits_scaling=1.0, attention_multiplier=0.25, embedding_multiplier=1.0,
                    residual_multiplier=1.0, attention_bias=False, mlp_bias=False),
    "helium": dict(attention_bias=False, mlp_bias=False),
    "hunyuan": dict(num_experts=4, moe_topk=2, use_qk_norm=True, use_cla=False, cla_share_factor=1, attention_bias=False,
                    moe_intermediate_size=32, num_shared_expert=1, use_mixed_mlp_moe=True,
                    rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"}),
    "hunyuan_v1_dense": dict(use_qk_norm=True, rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"}),
    "internlm3": dict(bias=False, qkv_bias=False),
    "llama4_text": dict(intermediate_size_mlp=128, num_local_experts=2, num_experts_per_tok=1,
                        interleave_moe_layer_step=2, no_rope_layers=[1, 0], attention_chunk_size=64,
                        use_qk_norm=True, floor_scale=8192, attn_scale=0.1,
                        attn_temperature_tuning=True),  # a no-rope layer
    "minicpm": dict(dim_model_base=64, scale_depth=1.0, scale_emb=1.0),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmo2": dict(),
    "olmo3": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "seed_oss": dict(attention_bias=False, attention_out_bias=False, mlp_bias=False),
    "smollm3": dict(no_rope_layer_interval=2),
    "stablelm": dict(partial_rotary_factor=0.25, layer_norm_eps=1e-5, use_qkv_bias=False),
    "starcoder2": dict(norm_epsilon=1e-5),
}.items()}


# gemma4's logit soft-capping and embedding scale saturate at x3; x1 already varies
SCALES = {"gemma4_text": 1.0, "gemma2": 1.0}


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


def pair(family, variant="f32"):
    """(target, perturbed drafter) of a family in a weight variant: f32; bf16; q4 (4-bit weights,
    groups of 32); kv8 (head_dim 32, a width KV quantization's groups of 32 divide)."""
    import mlx.nn as nn

    cfg = dict(CONFIGS[family], head_dim=32) if variant == "kv8" else CONFIGS[family]
    target = build(cfg)
    draft = perturbed(target)
    if variant == "bf16":
        target.set_dtype(mx.bfloat16)
        draft.set_dtype(mx.bfloat16)
    elif variant == "q4":
        nn.quantize(target, group_size=32, bits=4)
        nn.quantize(draft, group_size=32, bits=4)
    return target, draft


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
        parents = [-1]
        for d in range(self.depth):
            spine = len(parents) - self.width if d else 0
            parents += [spine] * self.width
        return np.array(parents)

    def draft(self, root, max_depth):
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


class FollowsText:
    """Mixin for oracle test drafters that read the target (first base: the drafter class):
    keeps the generation's text, the prompt then every emitted token, for the oracle to
    continue with the target's own greedy tokens."""

    def __init__(self, source, target, seed=0, **kw):
        super().__init__(source, **kw)
        self.target, self.rng, self.text = target, np.random.default_rng(seed), []

    def prefill(self, prompt, hidden=None):
        super().prefill(prompt, hidden)
        self.text = list(prompt)

    def commit(self, draft, path, emitted, hidden=None):
        super().commit(draft, path, emitted, hidden)
        self.text += list(emitted)
