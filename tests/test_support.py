"""The gate refuses, with every blocker named at once, targets that cannot verify trees."""
import numpy as np
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import _get_classes

import tiny
from mlx_treespec import RoundStats, support, tree_generate_step
from mlx_treespec.drafters.model import ModelDrafter
from mlx_treespec.support import UnsupportedTarget, require_tree_support, tree_support


def build(cfg):
    model_cls, args_cls = _get_classes(cfg)
    return model_cls(args_cls.from_dict(cfg))


MAMBA2 = dict(model_type="mamba2", num_heads=4, head_dim=16, vocab_size=64, hidden_size=32,
              intermediate_size=64, state_size=16, num_hidden_layers=3, layer_norm_epsilon=1e-5,
              conv_kernel=4, n_groups=1, use_bias=False, use_conv_bias=True,
              tie_word_embeddings=True, time_step_limit=(0.0, float("inf")), time_step_rank="auto")
RWKV7 = dict(model_type="rwkv7", vocab_size=64, hidden_size=64, intermediate_size=128, norm_eps=1e-5,
             head_dim=16, num_hidden_layers=2, a_low_rank_dim=8, v_low_rank_dim=8,
             gate_low_rank_dim=8, decay_low_rank_dim=8)


@pytest.mark.parametrize("family", list(tiny.CONFIGS))
def test_supported_targets_report_no_blocker(family):
    assert tree_support(tiny.build(tiny.CONFIGS[family])) == []


@pytest.mark.parametrize("family", list(tiny.COVERAGE))
def test_every_pinned_family_verifies_exactly(family):
    # families the gate once refused by name: no blocker, and a chain and a tree of a perturbed
    # copy give mlx-lm's own greedy tokens, with drafts accepted (MLA, sinks, sliding windows,
    # no-rope layers, MoE, partial rotary, logit soft-capping among them)
    target = tiny.build(tiny.COVERAGE[family])
    assert tree_support(target) == []
    draft = tiny.perturbed(target)
    prompt = np.random.default_rng(0).integers(0, tiny.VOCAB, 10).tolist()
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), target, max_tokens=24)]
    for shape in (dict(topk=1, depth=4, budget=4), dict(topk=3, depth=4, budget=12, lanes=1)):
        stats = RoundStats()
        out = [t for t, _, _ in tree_generate_step(prompt, target, ModelDrafter(draft, **shape),
                                                   max_tokens=24, stats=stats)]
        assert out == ref
        assert sum(stats.accepted) > 0


def test_verified_families_are_the_pinned_ones():
    # one list: what the gate trusts without a probe is what these tests build (the multimodal
    # wrappers gemma3 / gemma4 carry the text families' layers; qwen3_5_moe is pinned in
    # tests/test_heads.py)
    pinned = {c["model_type"] for c in list(tiny.CONFIGS.values()) + list(tiny.COVERAGE.values())}
    assert support.VERIFIED_FAMILIES == pinned | {"gemma3", "gemma4", "qwen3_5_moe"}


def test_readme_family_list_is_the_pinned_one():
    import pathlib

    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    listed = text.split("<!-- families -->")[1].split("<!-- /families -->")[0]
    assert {f.strip() for f in listed.split(",")} == support.VERIFIED_FAMILIES


def test_dynamic_ntk_rope_is_refused_naming_the_layer():
    cfg = dict(tiny.CONFIGS["llama"], rope_scaling={"type": "dynamic", "factor": 2.0})
    blockers = tree_support(tiny.build(cfg))
    assert [b.layer for b in blockers] == [0, 1]
    assert all("DynamicNTKScalingRoPE" in b.reason and "per-token" in b.reason for b in blockers)


def test_a_family_new_to_the_gate_is_probed_on_its_weights(monkeypatch):
    # outside VERIFIED_FAMILIES the exactness probe decides: bitwise on CPU passes; a verify
    # made to differ is refused naming the probe's figures
    model = tiny.build(tiny.CONFIGS["qwen3"])
    monkeypatch.setattr(support, "VERIFIED_FAMILIES", support.VERIFIED_FAMILIES - {"qwen3"})
    calls = []
    import mlx_treespec.probe as probe

    real = probe.probe_exactness

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(probe, "probe_exactness", spy)
    require_tree_support(model)
    assert calls and model._treespec_supported

    other = tiny.build(tiny.CONFIGS["qwen3"], seed=1)
    monkeypatch.setattr(probe, "probe_exactness",
                        lambda *a, **k: real(*a, perturb=lambda logits: logits + 1e-3 * mx.arange(logits.shape[-1]),
                                             **k))
    with pytest.raises(UnsupportedTarget) as e:
        require_tree_support(other)
    assert "new to the gate" in str(e.value) and "qwen3" in str(e.value)


def test_mamba2_refused_with_every_layer_named():
    blockers = tree_support(build(MAMBA2))
    assert sorted(b.layer for b in blockers) == [0, 1, 2]
    assert all("Mamba2" in b.reason for b in blockers)


JAMBA = dict(tiny.BASE, model_type="jamba", attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1,
             expert_layer_period=2, num_experts=2, num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4,
             mamba_expand=2, mamba_dt_rank=8, mamba_proj_bias=False, mamba_conv_bias=True,
             layers_block_type=["mamba", "attention"])


def test_jamba_refused_by_its_mamba_layer_not_its_name():
    # a hybrid whose attention layers verify (no rope) and whose Mamba layer cannot fork
    blockers = tree_support(build(JAMBA))
    assert [b.layer for b in blockers] == [0] and "Mamba" in blockers[0].reason


def test_rwkv7_refused_with_every_layer_named():
    with pytest.raises(UnsupportedTarget) as e:
        require_tree_support(build(RWKV7))
    msg = str(e.value)
    assert "layer 0" in msg and "layer 1" in msg and "RWKV7" in msg
    assert "blocker" in msg


class StrangeMixer(nn.Module):
    def __call__(self, x):
        return x


def test_made_up_layer_type_refused():
    cfg = dict(tiny.CONFIGS["qwen3"], model_type="qwen3")
    model = tiny.build(cfg)
    model.model_type = "made_up_family"
    model.layers[1].self_attn = StrangeMixer()
    blockers = tree_support(model)
    # the gate reads layers, not family names: only the layer whose mixer is unknown is named
    assert [b.layer for b in blockers] == [1]
    assert "StrangeMixer" in blockers[0].reason


def test_position_schemes_a_tree_cannot_follow_are_refused_for_targets_not_drafters():
    # gpt2's learned absolute positions and olmo_hybrid's GatedDeltaNet variant: named blockers for
    # a target; a draft model with learned positions still drafts (poorer drafts, exact output)
    from mlx_treespec import make_drafter

    gpt2 = build(dict(tiny.BASE, model_type="gpt2", n_embd=64, n_head=4, n_layer=2, n_positions=256,
                      n_ctx=256, layer_norm_epsilon=1e-5))
    blockers = tree_support(gpt2)
    assert [b.positions for b in blockers] == [True] and "wpe" in blockers[0].reason
    assert make_drafter(gpt2, draft_block_size=3) is not None
    olmo = build(dict(tiny.BASE, model_type="olmo_hybrid", num_hidden_layers=4, linear_num_key_heads=2,
                      linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                      linear_conv_kernel_dim=4, linear_allow_neg_eigval=False, attention_bias=False))
    refused = [b for b in tree_support(olmo) if "GatedDeltaNet variant" in b.reason]
    assert [b.layer for b in refused] == [0, 1, 2]  # layer 3 is its attention
