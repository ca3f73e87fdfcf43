"""The Qwen3.5 / Qwen3-Next multi-token-prediction (MTP) layer as a drafting head.

The head is one full-attention decoder layer of the target's own family (mlx-lm's classes:
gated q_proj, q_norm/k_norm, partial rotary; dense MLP, or mlx-lm's sparse MoE block), with its
own KV cache, between two projections it shares with the target (the embedding and lm_head):

    u = fc(concat[RMSNorm(E[x_{t+1}]; pre_fc_norm_embedding), RMSNorm(h_t; pre_fc_norm_hidden)])
    z = layer(u)                       (causal over the head's own cache, position t)
    o = RMSNorm(z; norm)               -> head.out_hidden, the hidden of the next draft step
    logits = lm_head(o)                predict x_{t+2}

`h_t` is the target's last hidden state, after its final norm ("post", what vLLM and mlx-vlm
feed) or before it ("pre"): `head.hidden_kind` says which one this head was trained on.

Call convention (mlx-lm's, so `mlx_treespec.verify.TreeRound` drives it like a model):
`head(tokens [1, L], cache=[c], hidden=[1, L, H]) -> logits [1, L, V]`. TreeRound calls
`model(tokens[None], cache=...)` without `hidden`: set `head.pending_hidden` ([1, n, H] or
[n, H]) before that forward; it is used once and cleared.

Norm layout (the rule `load_mtp` applies). Qwen3.5 / Qwen3-Next RMSNorms are zero-centred in the
HF checkpoints: the effective weight is 1 + w. mlx-lm's converter adds the 1 to the target's
norms and drops every `mtp.*` tensor, so a `mtp.`-prefixed tensor in a folder mostly comes from
the raw HF layout (the original checkpoint, or this project's export, which writes raw HF
tensors into `model-mtp.safetensors` and marks the folder config with `mtp_hidden`); but tools
that add MTP weights to a converted folder (vllm-mlx's `add_mtp_weights.py`) write them
shifted under the same names. So the values decide (`norms_zero_centred`): the MTP layer's
input and post-attention norms sit about 1 below the target's own layers' (loaded shifted by
mlx-lm) in the raw layout and level with them shifted; raw norms get +1 on load, shifted ones
load as they are, and a median between the two is a one-line error. `load_mtp(...,
zero_centred=True or False)` says which it is instead.
To write a loaded (possibly quantized) head back in this layout, save `head.raw_weights()`.
"""
import copy
import dataclasses
import glob
import json
import os
import struct
import sys

import numpy as np
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from . import dequantize_linears, target_io, text_model, vocab_rows
from ..spec import MIN_DRAFT_VOCAB, check_int
from ..vocab import read_ranks
from ..join import projected
from ..verify import layer_span

__all__ = ["MTPHead", "load_mtp", "target_io", "read_tensors", "quantize_like"]

NO_MTP = ("this checkpoint has no MTP layer (mtp.* weights): use a Qwen3.5/Qwen3-Next folder "
          "converted with its mtp weights, or --drafter model")

# 1-D weights of zero-centred norms (the HF layout stores w, the effective weight is 1 + w),
# names without the `mtp.` prefix
_TOP_NORMS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")
_LAYER_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                ".k_norm.weight")


def _is_norm(name):
    return name in _TOP_NORMS or (name.startswith("layers.") and name.endswith(_LAYER_NORMS))


# ---------------------------------------------------------------------------------------------
# helpers shared with eagle3.py

def _one_line(msg):
    return " ".join(str(msg).split())


def step_rows(hidden, L, who):
    """A head step's hidden rows as [1, L, H]: padded with zero rows to the step's L tokens
    (the filler rows of a padded GPU tree forward, whose output is discarded)."""
    if hidden is None:
        raise ValueError(f"{who} needs a hidden state: pass hidden= or set head.pending_hidden")
    if hidden.ndim == 2:
        hidden = hidden[None]
    if hidden.shape[1] < L:
        hidden = mx.pad(hidden, ((0, 0), (0, L - hidden.shape[1]), (0, 0)))
    return hidden


def _incomplete(path):
    return ValueError(f"{path} is incomplete or a git-lfs pointer, not safetensors weights: download the "
                      "weights again (huggingface-cli download, or git lfs pull)")


def _safetensors_keys(path):
    """Tensor names of a safetensors file, from its header only (a file too short for the
    header it announces is an incomplete download: a one-line error)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _incomplete(path)
        n = struct.unpack("<Q", head)[0]
        if n > size - 8:
            raise _incomplete(path)
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise _incomplete(path) from None
    if not isinstance(header, dict):
        raise _incomplete(path)
    ends = [v.get("data_offsets", (0, 0))[1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    if 8 + n + max(ends, default=0) > size:  # (the data cut short: mx.load reads lazily, and would fail later)
        raise _incomplete(path)
    return [k for k in header if k != "__metadata__"]


def read_tensors(folder, want):
    """Tensors whose names satisfy `want(name)`, from the folder's *.safetensors files (the
    index, where present, says which files hold them; files the index does not list are read
    too, e.g. a `model-mtp.safetensors` added next to an mlx-lm index). Loading is lazy: only
    the chosen tensors are ever read."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        listed = set(weight_map.values())
        chosen = {v for k, v in weight_map.items() if want(k)}
        missing = sorted(c for c in chosen if not os.path.isfile(os.path.join(folder, c)))
        if missing:
            raise ValueError(f"{os.path.join(folder, missing[0])}, named in the folder's index, is not there: "
                             "download the checkpoint's weights again")
        files = [p for p in files if os.path.basename(p) in chosen or os.path.basename(p) not in listed]
    out = {}
    for path in files:
        keys = [k for k in _safetensors_keys(path) if want(k)]
        if keys:
            try:
                arrays = mx.load(path)
            except (RuntimeError, ValueError, OSError):
                raise _incomplete(path) from None
            out.update({k: arrays[k] for k in keys})
    return out


def quantize_like(module, weights, config, prefix=""):
    """Quantize the leaves of `module` that have `.scales` in `weights` (mlx-lm's layout), with
    their group size / bits / mode as stored: read from the shapes (mlx-lm's
    infer_quant_config), a per-module entry `prefix + path` of the config's `quantization`
    taking precedence."""
    quant = config.get("quantization") or config.get("quantization_config") or {}
    if not any(k.endswith(".scales") for k in weights):
        return
    from mlx_lm.utils import infer_quant_config

    try:
        from mlx_lm.utils import _takes_global_scale
    except ImportError:  # older mlx-lm
        _takes_global_scale = None

    def predicate(path, m):
        if not hasattr(m, "to_quantized") or f"{path}.scales" not in weights:
            return False
        entry = quant.get(prefix + path) if isinstance(quant, dict) else None
        if isinstance(entry, dict):
            return dict(entry)
        params = infer_quant_config(path, m, weights)
        if f"{path}.global_scale" in weights and _takes_global_scale is not None and _takes_global_scale(m):
            params["global_scale"] = True
        return params

    nn.quantize(module, class_predicate=predicate)


def load_checked(module, weights, what):
    """module.load_weights(strict), its errors as one line naming `what`."""
    have = {k for k, _ in tree_flatten(module.parameters())}
    missing = sorted(have - set(weights))
    extra = sorted(set(weights) - have)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {missing[:6]}{' ...' if len(missing) > 6 else ''}")
        if extra:
            parts.append(f"unexpected {extra[:6]}{' ...' if len(extra) > 6 else ''}")
        raise ValueError(_one_line(f"{what}: tensors do not match the expected layout: {'; '.join(parts)}"))
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(_one_line(f"{what}: {e}")) from None


# ---------------------------------------------------------------------------------------------

def vocab_columns(ids, vocab):
    """A draft vocabulary's scatter map (int32 [vocab]): each target id's column among `ids`
    (the draft ids' target ids, distinct), len(ids) (the -inf column) for every other id."""
    ids = np.asarray(ids)
    column = np.full(vocab, len(ids), np.int32)
    column[ids] = np.arange(len(ids), dtype=np.int32)
    return mx.array(column)


def to_target_vocab(logits, column):
    """Draft-vocabulary logits [..., n] -> target-vocabulary logits [..., V] through a
    `vocab_columns` map: -inf off the draft vocabulary."""
    pad = mx.full((*logits.shape[:-1], 1), -mx.inf, logits.dtype)
    return mx.take(mx.concatenate([logits, pad], axis=-1), column, axis=-1)


class HeadModule(nn.Module):
    """A drafting head's module (MTPHead, Eagle3Head): the attributes named in STATE are per-call
    state and the target's modules, kept out of the head's parameters; one KV cache.

    `narrowed(n)` drafts over the target's first n token ids (a draft vocabulary, FR-Spec's
    idea): its output projection reads n rows of the lm_head, not all V, and every other id
    gets -inf. At real vocabularies the lm_head is most of what a head step reads (Qwen3.5's
    248,320 rows x 4,096), and the step is bound by reading it. The first ids are the frequent
    ones for a byte-level BPE tokenizer (Qwen, Llama 3, GPT-2 style), whose ids follow its merge
    order; special tokens (an end of turn) come last, so a narrowed head does not draft them.
    A target token outside them is never drafted, so its position is a miss, never a wrong
    token: the verify decides every token."""

    STATE = ("_vocab", "token_ranks")

    def __setattr__(self, key, value):
        if key in self.STATE or key in HeadModule.STATE:
            object.__setattr__(self, key, value)
        else:
            super().__setattr__(key, value)

    def make_cache(self):
        return [KVCache()]

    def rebound(self):
        """A new binding (`bind`): what was made over the last one goes, traced or copied
        with its arrays (the compiled drafts, the narrowed copy and its rows; and the drafts
        a benchmark arm traced apart, kept under a tuple key ending in the drafts' name)."""
        for made in [k for k in self.__dict__ if k in ("_treespec_drafts", "_narrowed_views")
                     or (isinstance(k, tuple) and k[-1] == "_treespec_drafts")]:
            del self.__dict__[made]

    def narrowed(self, n):
        """This head drafting over n token ids (None or 0: itself): the first n of its folder's
        token ranking (`token_ranks`, mlx_treespec/vocab.py), or ids 0..n-1 where it has none.
        A shallow copy sharing its weights, so the heads of several drafters over one folder
        narrow apart. The copy and its rows (ranked ids copy theirs, n x H; a prefix slices
        them) are made once and held by this head, with the compiled drafts every drafter over
        the copy shares (head.py); one vocabulary is kept (a sweep over sizes would keep an
        n x H copy each)."""
        if not n:
            return self
        project, vocab = self._full_vocab_head()
        n = check_int(n, "--draft-vocab (token ids a head drafts)", MIN_DRAFT_VOCAB, vocab - 1)
        ranks = getattr(self, "token_ranks", None)
        ids = None if ranks is None else np.sort(np.asarray(ranks[:n]))
        key = (id(getattr(project, "__self__", project)), n, None if ids is None else ids.tobytes())
        views = self.__dict__.setdefault("_narrowed_views", {})
        if key not in views:
            views.clear()
            view = copy.copy(self)
            view.__dict__.pop("_narrowed_views")  # (a copy holding its own dict would be a cycle)
            view.__dict__["_treespec_drafts"] = {}  # (its compiled drafts: its own, gone with it)
            # a prefix: its rows are slices, its logits padded with -inf after them
            view._vocab = (vocab_rows(project, n), None, vocab) if ids is None else \
                (vocab_rows(project, ids), vocab_columns(ids, vocab), vocab)
            views[key] = view
        return views[key]

    def _logits(self, project, x):
        """`project(x)` (logits over the target vocab; a few rows as products: `join.projected`),
        or over the draft vocabulary, -inf elsewhere."""
        narrow = getattr(self, "_vocab", None)
        if narrow is None:
            return projected(project, x)
        rows, column, vocab = narrow
        y = rows(x)
        if column is not None:
            return to_target_vocab(y, column)
        return mx.concatenate([y, mx.full((*y.shape[:-1], vocab - y.shape[-1]), -mx.inf, y.dtype)], axis=-1)


_FAMILIES = {  # mlx-lm module of the text model -> its decoder layer class
    "mlx_lm.models.qwen3_5": "DecoderLayer",
    "mlx_lm.models.qwen3_next": "Qwen3NextDecoderLayer",
}


def _family(target):
    args, embed, head = target_io(target)
    module = type(text_model(target)).__module__
    if module not in _FAMILIES or args is None:
        raise ValueError(f"MTP heads are for qwen3_5 / qwen3_5_moe / qwen3_next targets, got "
                         f"{getattr(args, 'model_type', type(target).__name__)}: use --drafter model")
    return args, embed, head, sys.modules[module], _FAMILIES[module]


class MTPHead(HeadModule):
    """One MTP layer for `target` (an mlx-lm qwen3_5 / qwen3_5_moe / qwen3_next model), built
    from the target's text config and bound to its embedding and lm_head; see the module
    docstring. `mlp`: "dense" (intermediate size `intermediate_size`, default the target's) or
    "moe" (mlx-lm's sparse MoE block from the target's MoE fields). Weights are random until
    loaded (`load_mtp` does both)."""

    STATE = ("pending_hidden", "out_hidden", "_embed", "_lm_head", "_final_norm", "capture")

    def __init__(self, target, mlp="dense", intermediate_size=None, hidden_kind="post"):
        super().__init__()
        if hidden_kind not in ("post", "pre"):
            raise ValueError(f"hidden_kind must be 'post' or 'pre', got {hidden_kind!r}")
        args, _, _, family_module, layer_class = _family(target)
        H, eps = args.hidden_size, args.rms_norm_eps
        self.args = args
        self.hidden_kind = hidden_kind
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        from mlx_lm.models.qwen3_next import Qwen3NextMLP, Qwen3NextSparseMoeBlock

        if mlp not in ("dense", "moe"):
            raise ValueError(f"mlp must be 'dense' or 'moe', got {mlp!r}")
        if mlp == "moe" and not getattr(args, "num_experts", 0):
            raise ValueError("the MTP layer has MoE weights but the target config has no experts")
        # a full-attention layer (index full_attention_interval - 1 is one in both families);
        # dense: built without experts (mlx-lm picks the MLP from the args)
        largs = dataclasses.replace(args, num_experts=0) if mlp == "dense" else args
        layer = getattr(family_module, layer_class)(largs, getattr(args, "full_attention_interval", 1) - 1)
        if getattr(layer, "is_linear", False):
            raise ValueError("could not build a full-attention MTP layer for this target")
        if mlp == "dense":
            layer.mlp = Qwen3NextMLP(H, intermediate_size or args.intermediate_size)
        elif not isinstance(layer.mlp, Qwen3NextSparseMoeBlock):
            layer.mlp = Qwen3NextSparseMoeBlock(args)
        self.layers = [layer]
        self.norm = nn.RMSNorm(H, eps=eps)
        self.pending_hidden = None
        self.out_hidden = None
        self._embed = None  # the target's modules: not this head's parameters
        self._lm_head = None
        self.bind(target)

    def bind(self, target):
        """Use `target`'s embedding and lm_head (tied: the embedding as a linear map)."""
        _, embed, head = target_io(target)
        self._embed, self._lm_head = embed, head
        self.rebound()
        self._final_norm = text_model(target).model.norm
        self.capture = (layer_span(target)[2] - 1,)  # the last layer's output (pre-norm)
        return self

    def _full_vocab_head(self):
        """(the projection over the whole vocabulary, its size): the target's lm_head."""
        return self._lm_head, int(self.args.vocab_size)

    def target_hidden(self, last_layer_out):
        """The hidden this head reads, from the target's last layer output (what a round
        captures with `head.capture`): after the target's final norm for hidden_kind "post",
        as it is for "pre"."""
        return self._final_norm(last_layer_out) if self.hidden_kind == "post" else last_layer_out

    def raw_weights(self):
        """This head's tensors in the layout `load_mtp` reads: `mtp.` names, zero-centred norms
        (w, not 1 + w); quantized leaves as they are (`.scales` /
        `.biases`). Experts stay in mlx-lm's stacked `switch_mlp.*` form, which `load_mtp`
        reads too."""
        weights = {}
        for k, v in tree_flatten(self.parameters()):
            if v.ndim == 1 and mx.issubdtype(v.dtype, mx.floating) and _is_norm(k):
                v = v - mx.array(1.0, v.dtype)
            weights["mtp." + k] = v
        return weights

    def __call__(self, inputs, cache=None, hidden=None):
        if self._embed is None:
            raise ValueError("MTPHead is not bound to a target: call head.bind(target)")
        if hidden is None:
            hidden, self.pending_hidden = self.pending_hidden, None
        hidden = step_rows(hidden, inputs.shape[1], "MTPHead")
        e = self._embed(inputs)
        u = self.fc(mx.concatenate([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden)], axis=-1))
        c = cache[0] if cache is not None else None
        mask = create_attention_mask(u, c)
        z = self.layers[0](u, mask=mask, cache=c)
        o = self.norm(z)
        self.out_hidden = o
        return self._logits(self._lm_head, o)


def _mlp_kind(weights):
    p = "layers.0.mlp."
    if f"{p}gate_proj.weight" in weights:
        return "dense", weights[f"{p}gate_proj.weight"].shape[0]
    if f"{p}gate.weight" in weights:
        return "moe", None
    raise ValueError(_one_line(f"the MTP layer has neither a dense MLP ({p}gate_proj) nor a MoE "
                               f"router ({p}gate): not a Qwen3.5/Qwen3-Next MTP layout"))


def _moe_to_mlx(weights, num_experts):
    """HF expert layouts -> mlx-lm's `switch_mlp.*` stacks (qwen3_next: one tensor per expert;
    qwen3_5_moe: fused gate_up_proj [E, 2 Im, H] and down_proj [E, H, Im])."""
    p = "layers.0.mlp."
    if f"{p}experts.gate_up_proj" in weights:
        gate_up = weights.pop(f"{p}experts.gate_up_proj")
        mid = gate_up.shape[-2] // 2
        weights[f"{p}switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        weights[f"{p}switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        weights[f"{p}switch_mlp.down_proj.weight"] = weights.pop(f"{p}experts.down_proj")
    elif f"{p}experts.0.up_proj.weight" in weights:
        for n in ("gate_proj", "up_proj", "down_proj"):
            for suffix in ("weight", "scales", "biases"):
                keys = [f"{p}experts.{e}.{n}.{suffix}" for e in range(num_experts)]
                if keys and all(k in weights for k in keys):  # (none: a dense config; the head says so)
                    weights[f"{p}switch_mlp.{n}.{suffix}"] = mx.stack([weights.pop(k) for k in keys])
    return weights


_LAYER_PAIRS = ("input_layernorm.weight", "post_attention_layernorm.weight")


def _median(arrays):
    return float(np.median(np.concatenate([np.asarray(a.astype(mx.float32)).ravel() for a in arrays])))


def norms_zero_centred(weights, target_model):
    """Whether `weights`' (`mtp.` prefix dropped) norms are the raw zero-centred layout (True) or
    already shifted (False): the median of the MTP layer's input and post-attention norms
    against the target's own layers' (mlx-lm loads those shifted: effective weights), about 1
    below them raw and level shifted (module docstring); None where the median sits within
    0.15 of halfway. No target layer norms to compare with: against 1; no MTP norms: True."""
    from mlx.utils import tree_flatten

    mine = [v for k, v in weights.items() if k.startswith("layers.") and k.endswith(_LAYER_PAIRS) and v.ndim == 1]
    if not mine:
        mine = [v for k, v in weights.items() if v.ndim == 1 and mx.issubdtype(v.dtype, mx.floating) and _is_norm(k)]
    if not mine:
        return True
    theirs = [v for k, v in tree_flatten(target_model.parameters())
              if k.endswith(_LAYER_PAIRS) and "mtp." not in k and v.ndim == 1]
    halfway = (_median(theirs) if theirs else 1.0) - 0.5
    median = _median(mine)
    return True if median < halfway - 0.15 else False if median > halfway + 0.15 else None


def load_mtp(target_folder, target_model, zero_centred=None):
    """The MTP head stored in `target_folder` (the target's own folder: `mtp.*` tensors in any
    of its safetensors files), bound to `target_model`.

    - Norms: raw HF (zero-centred) norms get +1, shifted ones load as they are: told apart by
      their values (module docstring), or by `zero_centred=True` (raw) or `False` (shifted).
    - Quantized weights (mlx-lm's `.scales` / `.biases` siblings) are loaded quantized.
    - `head.hidden_kind`: the folder config's `mtp_hidden` ("post" or "pre"), default "post".
    """
    cfg_path = os.path.join(target_folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{target_folder} has no config.json: pass the target's model folder")
    with open(cfg_path) as f:
        config = json.load(f)
    text = config.get("text_config", config)
    args = _family(target_model)[0]
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        n = text.get(key, config.get(key))
        if n is not None and int(n) > 1:
            raise ValueError(f"{key}={n}: only one MTP layer is supported (the released models have one)")
    if text.get("mtp_use_dedicated_embeddings", config.get("mtp_use_dedicated_embeddings")):
        raise ValueError("mtp_use_dedicated_embeddings is not supported: the head uses the target's embedding")
    side = os.path.join(target_folder, "mtp.json")  # what bench/train_heads.py writes beside the weights
    extra = {}
    if os.path.isfile(side):
        with open(side) as f:
            extra = json.load(f)
    hidden_kind = config.get("mtp_hidden", text.get("mtp_hidden", extra.get("mtp_hidden", "post")))
    if hidden_kind not in ("post", "pre"):
        raise ValueError(f"config mtp_hidden must be 'post' or 'pre', got {hidden_kind!r}")

    raw = read_tensors(target_folder, lambda k: k.startswith("mtp."))
    if not raw:
        raise ValueError(NO_MTP)
    weights = {k[len("mtp."):]: v for k, v in raw.items()}
    bad = sorted(k for k in weights if k.startswith("layers.") and not k.startswith("layers.0."))
    if bad:
        raise ValueError(_one_line(f"MTP tensors of more than one layer ({bad[:4]}): only one MTP layer is supported"))
    shift = norms_zero_centred(weights, target_model) if zero_centred is None else bool(zero_centred)
    if shift is None:
        raise ValueError(f"the mtp.* norms in {target_folder} sit between the raw layout (about 1 below the "
                         "target's own layer norms) and the shifted one (level with them): pass load_mtp(..., "
                         "zero_centred=True) for raw Hugging Face norms, False for norms with the +1 already added")
    if shift:
        for k, v in list(weights.items()):
            if v.ndim == 1 and mx.issubdtype(v.dtype, mx.floating) and _is_norm(k):
                weights[k] = v + mx.array(1.0, v.dtype)
    kind, inter = _mlp_kind(weights)
    if kind == "moe":
        weights = _moe_to_mlx(weights, getattr(args, "num_experts", 0))
    fc = weights.get("fc.weight")
    if fc is not None and "fc.scales" not in weights and tuple(fc.shape) != (args.hidden_size, 2 * args.hidden_size):
        raise ValueError(f"mtp.fc.weight has shape {tuple(fc.shape)}, the target's hidden size {args.hidden_size} "
                         f"needs ({args.hidden_size}, {2 * args.hidden_size}): these mtp weights are for another model")
    head = MTPHead(target_model, mlp=kind, intermediate_size=inter, hidden_kind=hidden_kind)
    quantize_like(head, weights, config, prefix="mtp.")
    load_checked(head, weights, f"MTP weights in {target_folder}")
    dequantize_linears(head)  # shipped small, run as float (see drafters.dequantize_linears)
    head.token_ranks = read_ranks(target_folder, int(args.vocab_size))  # (its draft vocabulary: vocab.py)
    head.eval()
    mx.eval(head.parameters())
    return head
