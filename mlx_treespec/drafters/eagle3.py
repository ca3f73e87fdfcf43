"""The EAGLE-3 draft head (SafeAILab layout; the speculators / vLLM layout too).

One decoder layer whose attention reads 2H inputs: the normed embedding of the next token and
the normed hidden, with its own KV cache; the hidden of the first step is `fc` of the target's
concatenated aux-layer outputs, later steps feed the head's own output back:

    g = fc(concat(target layer outputs at t))      first step  (`first=True`)
    g = previous step's head.out_hidden           later steps (`first=False`)
    a = attention(concat[RMSNorm(E[x_{t+1}]; input_layernorm), RMSNorm(g; hidden_norm)])
    z = g + o_proj(a);  out = z + mlp(RMSNorm(z; post_attention_layernorm))
    logits = lm_head(RMSNorm(out; norm))           over the draft vocab
    head.out_hidden = out                          (pre-norm; post-norm with `norm_output`)

Call convention (mlx-lm's, so `mlx_treespec.verify.TreeRound` drives it like a model):
`head(tokens [1, L], cache=[c], hidden=[1, L, H or n*H_t], first=bool) -> logits [1, L, V]`
over the TARGET vocab: the draft vocab's logits scattered to their target ids (target id =
i + d2t[i]), -inf elsewhere, so argmax / top-k / log-softmax over a row are about target ids.
TreeRound calls `model(tokens[None], cache=...)` only: set `head.pending_hidden` (and
`head.pending_first`) before that forward; both are used once and cleared. With `first`
unset, it is inferred as `hidden.shape[-1] != H`.

Layouts read by `load_eagle3`:
- SafeAILab (`LlamaForCausalLMEagle3`): `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`;
  LlamaConfig fields at the top of config.json; plain (not zero-centred) norms.
- speculators (`speculators_model_type: "eagle3"`): `layers.0.*` for `midlayer.*`, the layer
  config under `transformer_layer_config`, and the flags `norm_before_residual`,
  `norm_before_fc` (`input_norm` over the concatenated features), `fc_norm` (`fc_norm.{i}` per
  feature) and `norm_output`; a qwen3 layer config adds q_norm / k_norm. One draft layer only.
- A head over the whole target vocab (`draft_vocab_size` = the target's, `d2t` all zero, or
  none) may ship no `lm_head`: it then drafts through the target's lm_head, as EAGLE-1/2 heads do.
- The token embedding is the target's; a checkpoint's own `embed_tokens` is used only where it
  may differ (speculators' `embed_requires_grad`, or a head narrower than the target).

Aux layers (`head.capture`: 0-based indices of the target layers whose outputs it reads). The
ecosystem numbers `eagle_aux_hidden_state_layer_ids` two ways: SGLang (and this project's
export, bench/train_heads.py) stores 0-based layer outputs; vLLM and speculators store
"after i layers" (index 0 = the embeddings; speculators allows up to num_layers). So: SafeAILab
layout -> capture = ids; speculators layout -> capture = ids - 1; no ids -> SafeAILab's default,
the outputs after 2, L//2 and L-3 layers, i.e. capture (1, L//2 - 1, L - 4).
"""
import glob
import json
import os

import numpy as np
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.rope_utils import initialize_rope

from .mtp import (HeadModule, _one_line, load_checked, quantize_like, read_tensors, step_rows, target_io,
                  to_target_vocab, vocab_columns)
from ..verify import layer_span
from ..vocab import read_ranks
from . import GatedMLP, dequantize_linears

__all__ = ["Eagle3Head", "load_eagle3", "default_capture"]


def default_capture(num_layers):
    """SafeAILab's aux layers: the outputs after 2, L//2 and L-3 layers (0-based indices)."""
    L = num_layers
    return (1, L // 2 - 1, L - 4)


class Eagle3Attention(nn.Module):
    def __init__(self, in_dims, hidden, n_heads, n_kv, head_dim, rope, qk_norm=False, eps=1e-6, bias=False):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.scale = head_dim ** -0.5
        self.q_proj = nn.Linear(in_dims, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dims, n_kv * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dims, n_kv * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=False)
        if qk_norm:
            self.q_norm = nn.RMSNorm(head_dim, eps=eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=eps)
        self.qk_norm = qk_norm
        self.rope = rope

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(B, L, self.n_heads, -1)
        k = k.reshape(B, L, self.n_kv, -1)
        v = v.reshape(B, L, self.n_kv, -1).transpose(0, 2, 1, 3)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        if cache is not None:
            q = self.rope(q, offset=cache.offset)
            k = self.rope(k, offset=cache.offset)
            k, v = cache.update_and_fetch(k, v)
        else:
            q, k = self.rope(q), self.rope(k)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class _MidLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, eps = c["hidden_size"], c["rms_norm_eps"]
        rope = initialize_rope(c["head_dim"], base=c["rope_theta"], traditional=False,
                               scaling_config=c.get("rope_scaling"),
                               max_position_embeddings=c.get("max_position_embeddings"))
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.hidden_norm = nn.RMSNorm(H, eps=eps)
        self.self_attn = Eagle3Attention(2 * H, H, c["num_attention_heads"], c["num_key_value_heads"],
                                         c["head_dim"], rope, qk_norm=c.get("qk_norm", False), eps=eps,
                                         bias=c.get("attention_bias", False))
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        self.mlp = GatedMLP(H, c["intermediate_size"], bias=c.get("mlp_bias", False))


class Eagle3Head(HeadModule):
    """The head from a normalised config dict `c` (see `_config`): hidden_size, heads, head_dim,
    intermediate_size, rms_norm_eps, rope_theta, rope_scaling, vocab_size (the target's),
    draft_vocab_size, target_hidden_size, n_aux, and the flags norm_before_residual,
    norm_before_fc, fc_norm, norm_output, qk_norm."""

    STATE = ("pending_hidden", "pending_first", "out_hidden", "_embed", "_gather", "_target_head", "config",
             "capture")

    def __init__(self, c, capture):
        super().__init__()
        H, Ht, n = c["hidden_size"], c["target_hidden_size"], c["n_aux"]
        self.config = dict(c)
        self.hidden_size = H
        self.vocab_size, self.draft_vocab_size = c["vocab_size"], c["draft_vocab_size"]
        self.capture = tuple(int(i) for i in capture)
        self.norm_before_residual = bool(c.get("norm_before_residual", False))
        self.norm_output = bool(c.get("norm_output", False))
        if c.get("fc_norm"):
            self.fc_norm = [nn.RMSNorm(Ht, eps=c["rms_norm_eps"]) for _ in range(n)]
        if c.get("norm_before_fc"):
            self.input_norm = nn.RMSNorm(n * Ht, eps=c["rms_norm_eps"])
        self.fc = nn.Linear(n * Ht, H, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = nn.RMSNorm(H, eps=c["rms_norm_eps"])
        self.lm_head = nn.Linear(H, self.draft_vocab_size, bias=False)
        self.pending_hidden = None
        self.pending_first = None
        self.out_hidden = None
        self._embed = None
        self._target_head = None  # bind(): the target's lm_head, for a head without its own
        self._gather = None  # set_vocab_map: identity until a d2t is given

    def raw_weights(self):
        """This head's tensors under the SafeAILab names `load_eagle3` reads (quantized leaves
        as they are), without `d2t` / `t2d`."""
        return dict(tree_flatten(self.parameters()))

    def set_vocab_map(self, d2t):
        """d2t (int [Vd]): target id of draft id i is i + d2t[i]; None: the identity (Vd == V).
        An identity map (a head over the whole target vocab) is None too: each step then skips
        the scatter to target ids (a concatenate and a gather of V columns a step)."""
        if d2t is not None and self.draft_vocab_size == self.vocab_size and not mx.any(d2t).item():
            d2t = None
        if d2t is None:
            if self.draft_vocab_size != self.vocab_size:
                raise ValueError(f"draft vocab {self.draft_vocab_size} != target vocab {self.vocab_size} "
                                 "needs a d2t map")
            self._gather = None
            return
        self._gather = vocab_columns(np.arange(self.draft_vocab_size) + np.array(d2t.astype(mx.int64)),
                                     self.vocab_size)

    def bind(self, target, embed=None):
        """Use `target`'s embedding, or the checkpoint's own (`embed`, kept for later binds: a
        head trained with its own embedding drafts through it whatever target it is bound to)."""
        _, target_embed, self._target_head = target_io(target)
        if embed is not None:
            self.__dict__["_own_embed"] = embed
        own = self.__dict__.get("_own_embed")
        self._embed = target_embed if own is None else own
        self.rebound()
        return self

    def to_target_vocab(self, logits):
        """Draft-vocab logits [..., Vd] -> target-vocab logits [..., V], -inf off the draft vocab."""
        return logits if self._gather is None else to_target_vocab(logits, self._gather)

    def project(self, feats):
        """The first step's hidden: fc of the target features [..., n * H_t]."""
        if "fc_norm" in self:
            parts = mx.split(feats, len(self.fc_norm), axis=-1)
            feats = mx.concatenate([norm(p) for norm, p in zip(self.fc_norm, parts)], axis=-1)
        if "input_norm" in self:
            feats = self.input_norm(feats)
        return self.fc(feats)

    def __call__(self, inputs, cache=None, hidden=None, first=None):
        if self._embed is None:
            raise ValueError("Eagle3Head is not bound to a target: call head.bind(target)")
        if hidden is None:
            hidden, first = self.pending_hidden, (self.pending_first if first is None else first)
            self.pending_hidden, self.pending_first = None, None
        hidden = step_rows(hidden, inputs.shape[1], "Eagle3Head")
        if first is None:
            first = hidden.shape[-1] != self.hidden_size
        g = self.project(hidden) if first else hidden
        m = self.midlayer
        gn = m.hidden_norm(g)
        x = mx.concatenate([m.input_layernorm(self._embed(inputs)), gn], axis=-1)
        c = cache[0] if cache is not None else None
        mask = create_attention_mask(x, c)
        z = (gn if self.norm_before_residual else g) + m.self_attn(x, mask=mask, cache=c)
        out = z + m.mlp(m.post_attention_layernorm(z))
        normed = self.norm(out)
        self.out_hidden = normed if self.norm_output else out
        if "lm_head" not in self:  # (EAGLE-1/2's way: a head over the whole target vocab)
            return self._logits(self._target_head, normed)
        if self._gather is not None:  # its own draft vocabulary (narrowed() refuses it)
            return self.to_target_vocab(self.lm_head(normed))
        return self._logits(self.lm_head, normed)

    def _full_vocab_head(self):
        """(the projection over the whole target vocabulary, its size): the head's own lm_head,
        or the target's where it has none; a head with its own draft vocabulary has neither."""
        if self._gather is not None:
            raise ValueError(f"this EAGLE-3 head drafts over its own {self.draft_vocab_size}-token "
                             "vocabulary (its d2t map): drop --draft-vocab")
        return (self.lm_head if "lm_head" in self else self._target_head), self.vocab_size


def _fail(folder, msg):
    raise ValueError(_one_line(f"EAGLE-3 head {folder}: {msg}"))


def _in_dims(weights, name, raw):
    """Input width of linear `name` (quantized: from the config's bits; None if unknown)."""
    w = weights[f"{name}.weight"]
    if f"{name}.scales" not in weights:
        return int(w.shape[-1])
    q = raw.get("quantization") or raw.get("quantization_config") or {}
    q = q[name] if isinstance(q.get(name), dict) else q
    bits = q.get("bits")
    return int(w.shape[-1]) * 32 // int(bits) if bits else None  # (None: the caller refuses it)


def _config(raw, folder):
    """A flat config dict from either layout; `speculators` says which layout it was."""
    spec = raw.get("speculators_model_type") is not None or "transformer_layer_config" in raw
    if spec and raw.get("speculators_model_type", "eagle3") != "eagle3":
        _fail(folder, f"speculators_model_type {raw['speculators_model_type']!r} is not eagle3")
    layer = dict(raw.get("transformer_layer_config", {})) if spec else dict(raw)
    eagle = raw.get("eagle_config") or {}
    rope = layer.get("rope_parameters") or {}
    try:
        H = int(layer["hidden_size"])
        nh = int(layer["num_attention_heads"])
        c = dict(
            hidden_size=H, num_attention_heads=nh,
            num_key_value_heads=int(layer.get("num_key_value_heads") or nh),
            head_dim=int(layer.get("head_dim") or H // nh),
            intermediate_size=int(layer["intermediate_size"]),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=float(layer.get("rope_theta") or rope.get("rope_theta", 10000.0)),
            rope_scaling=layer.get("rope_scaling") or (
                rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None),
            max_position_embeddings=layer.get("max_position_embeddings"),
            attention_bias=bool(layer.get("attention_bias", False)),
            mlp_bias=bool(layer.get("mlp_bias", False)),
        )
        vocab = layer.get("vocab_size") or raw.get("vocab_size")
        c["vocab_size"] = int(vocab) if vocab else None
    except (KeyError, TypeError, ValueError) as e:
        _fail(folder, f"config.json lacks a layer field ({e})")
    Vd = raw.get("draft_vocab_size") or layer.get("draft_vocab_size")
    c["draft_vocab_size"] = int(Vd) if Vd else None
    c["target_hidden_size"] = int(raw.get("target_hidden_size") or layer.get("target_hidden_size") or H)
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        c[flag] = bool(raw.get(flag, eagle.get(flag, False)))
    ids = raw.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
    return c, spec, (list(ids) if ids else None)


def load_eagle3(folder, target_model, capture=None):
    """The EAGLE-3 head in `folder` (config.json + *.safetensors), bound to `target_model`.
    `capture` overrides the aux layers read from the config (0-based target layer indices)."""
    folder = str(folder)
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        _fail(folder, "no config.json: pass an EAGLE-3 head folder (config.json and model.safetensors)")
    if not glob.glob(os.path.join(folder, "*.safetensors")):
        extra = " (pytorch_model.bin: convert it to safetensors)" if os.path.exists(
            os.path.join(folder, "pytorch_model.bin")) else ""
        _fail(folder, f"no *.safetensors weights{extra}")
    with open(cfg_path) as f:
        raw = json.load(f)
    c, spec, ids = _config(raw, folder)

    args, embed, _ = target_io(target_model)
    t_hidden = int(getattr(args, "hidden_size", 0) or embed.weight.shape[-1])
    t_vocab = int(getattr(args, "vocab_size", 0) or embed.weight.shape[0])
    n_layers = layer_span(target_model)[2]  # (the whole model's depth, pipelined or not)
    if c["target_hidden_size"] != t_hidden:
        _fail(folder, f"made for a target of hidden size {c['target_hidden_size']}, this target has {t_hidden}: "
                      "use a head trained for this target")
    if c["vocab_size"] is None:
        c["vocab_size"] = t_vocab
    if c["vocab_size"] != t_vocab:
        _fail(folder, f"vocab_size {c['vocab_size']} != the target's {t_vocab}: use a head trained for this target")

    weights = read_tensors(folder, lambda k: True)
    weights = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
               for k, v in weights.items()}
    extra_layers = sorted({k.split(".")[1] for k in weights if k.startswith("layers.")})
    if extra_layers:  # (the tensors decide: a speculators layer config may carry the verifier's depth)
        _fail(folder, f"draft layers {['0'] + extra_layers}: only one-layer EAGLE-3 heads are supported: pass "
                      "a one-layer EAGLE-3 head folder (fc, midlayer, norm, lm_head, d2t)")
    for k in [k for k in weights if k.startswith(("verifier_norm.", "verifier_lm_head."))]:
        weights.pop(k)  # training-only (speculators)
    # The head's own embedding is used where it may differ from the target's (trained:
    # embed_requires_grad, or another width); a frozen copy is the target's and is dropped.
    embeds = {k: weights.pop(k) for k in [k for k in weights if k.startswith("embed_tokens.")]}
    own_embed = embeds.get("embed_tokens.weight")
    trained = raw.get("embed_requires_grad") or c["hidden_size"] != t_hidden
    if own_embed is not None and trained and len(embeds) > 1:
        _fail(folder, "its own (trained) embed_tokens is stored quantized: store it as float (it would "
                      "be read as the target's otherwise)")
    if own_embed is not None and not trained:
        own_embed = None  # (a frozen copy: the target's)
    if own_embed is not None and tuple(own_embed.shape) != (t_vocab, c["hidden_size"]):
        _fail(folder, f"embed_tokens {tuple(own_embed.shape)} is not [the target's vocabulary {t_vocab}, "
                      f"hidden size {c['hidden_size']}]: use a head trained for this target")
    d2t = weights.pop("d2t", None)
    t2d = weights.pop("t2d", None)
    if own_embed is None and c["hidden_size"] != t_hidden:
        _fail(folder, f"hidden size {c['hidden_size']} != the target's {t_hidden} and the head has no "
                      "embed_tokens of its own")
    fc = weights.get("fc.weight")
    if fc is None:
        _fail(folder, "no fc.weight: not an EAGLE-3 head: pass an EAGLE-3 head folder (fc, midlayer, norm, "
                      "lm_head, d2t)")
    c["qk_norm"] = "midlayer.self_attn.q_norm.weight" in weights
    if "midlayer.self_attn.q_proj.bias" in weights:
        c["attention_bias"] = True

    # aux layers: the number fc reads, and which ones
    in_dims = _in_dims(weights, "fc", raw)
    if in_dims is None:  # (its width, and so its aux layers, cannot be checked; read at another width it drafts garbage)
        _fail(folder, "fc is quantized and the config names no bits (a 'quantization' entry): convert the head "
                      "with mlx-lm, which writes it")
    if in_dims % c["target_hidden_size"]:
        _fail(folder, f"fc.weight reads {in_dims} features, not a multiple of the target hidden size "
                      f"{c['target_hidden_size']}")
    if capture is None:
        if ids is None:
            capture = default_capture(n_layers)
        else:
            capture = [i - 1 for i in ids] if spec else list(ids)
    capture = tuple(int(i) for i in capture)
    c["n_aux"] = len(capture)
    if in_dims != c["n_aux"] * c["target_hidden_size"]:
        _fail(folder, f"fc.weight reads {in_dims} features but the head names {len(capture)} aux layers "
                      f"of {c['target_hidden_size']}")
    bad = [i for i in capture if not 0 <= i < n_layers]
    if bad:
        shown = [i + 1 for i in bad] if (spec and ids is not None) else bad
        _fail(folder, f"aux layers {shown} are beyond the target's {n_layers} layers (capture {list(capture)} "
                      f"of 0..{n_layers - 1}): use a head trained for this target")

    if c["draft_vocab_size"] is None:
        c["draft_vocab_size"] = int(d2t.shape[0]) if d2t is not None else t_vocab
    Vd = c["draft_vocab_size"]
    if t2d is not None and t2d.shape[0] != t_vocab:
        _fail(folder, f"t2d has {t2d.shape[0]} entries, the target vocab has {t_vocab}: "
                      "use a head trained for this target's tokenizer")
    if d2t is not None:
        if d2t.ndim != 1 or d2t.shape[0] != Vd:
            _fail(folder, f"d2t has shape {tuple(d2t.shape)}, not [draft_vocab_size {Vd}]")
        ids_t = mx.arange(Vd) + d2t.astype(mx.int64)
        lo, hi = mx.min(ids_t).item(), mx.max(ids_t).item()
        if lo < 0 or hi >= t_vocab:
            _fail(folder, f"d2t maps to target ids {lo}..{hi}, outside the target vocab of {t_vocab}")
        if len(np.unique(np.array(ids_t))) != Vd:  # (two draft ids on one target id: one of them never drafts)
            _fail(folder, "d2t maps two draft ids to one target id: use a head trained for this target's tokenizer")
        if t2d is not None and int(mx.sum(t2d.astype(mx.int32)).item()) != Vd:
            _fail(folder, f"t2d marks {int(mx.sum(t2d.astype(mx.int32)).item())} target ids, draft_vocab_size is {Vd}")
    elif Vd != t_vocab:
        _fail(folder, f"draft_vocab_size {Vd} != the target vocab {t_vocab} and there is no d2t map")

    head = Eagle3Head(c, capture)
    if not any(k.startswith("lm_head.") for k in weights):  # drafts through the target's lm_head
        if Vd != t_vocab or c["hidden_size"] != t_hidden:
            _fail(folder, f"no lm_head.weight, and a draft vocab of {Vd} at width {c['hidden_size']} (the target: "
                          f"{t_vocab} at {t_hidden}): pass a head with its lm_head")
        del head["lm_head"]
    quantize_like(head, weights, raw)
    load_checked(head, weights, f"EAGLE-3 head {folder}")
    dequantize_linears(head)  # shipped small, run as float (see drafters.dequantize_linears)
    head.set_vocab_map(d2t)
    head.token_ranks = read_ranks(folder, t_vocab)  # (its draft vocabulary: vocab.py)
    head.eval()
    mx.eval(head.parameters())
    emb_module = None
    if own_embed is not None:
        emb_module = nn.Embedding(*own_embed.shape)
        emb_module.weight = own_embed
    return head.bind(target_model, embed=emb_module)
