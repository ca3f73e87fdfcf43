"""The gate refuses, with every blocker named at once, targets that cannot verify trees."""
import mlx.nn as nn
import pytest
from mlx_lm.utils import _get_classes

import tiny
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


def test_mamba2_refused_with_every_layer_named():
    blockers = tree_support(build(MAMBA2))
    assert blockers[0].layer is None and "mamba2" in blockers[0].reason
    layers = sorted(b.layer for b in blockers if b.layer is not None)
    assert layers == [0, 1, 2]
    assert all("Mamba2" in b.reason for b in blockers if b.layer is not None)


def test_rwkv7_refused_with_every_layer_named():
    with pytest.raises(UnsupportedTarget) as e:
        require_tree_support(build(RWKV7))
    msg = str(e.value)
    assert "rwkv7" in msg and "layer 0" in msg and "layer 1" in msg and "RWKV7" in msg
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
    assert blockers[0].layer is None and "made_up_family" in blockers[0].reason
    # the layer whose mixer is unknown is named too, in the same report
    assert [b.layer for b in blockers[1:]] == [1]
    assert "StrangeMixer" in blockers[1].reason
