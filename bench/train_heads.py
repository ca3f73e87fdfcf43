#!/usr/bin/env python3
"""Train the drafting heads of the shipped demo models (DFlash, MTP, EAGLE-3) and a small
hybrid draft model.

Standalone script, not part of the runtime library.  It needs torch, transformers (>= 5.17,
for the Qwen3 / Qwen3.5 classes used to run the frozen demo models), tokenizers, safetensors
and numpy.  It is meant to run once on one GPU:

    PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 python3 bench/train_heads.py --out $OUT

The torch modules here compute the same function as the MLX drafters that load these heads
(``mlx_treespec/drafters``; ``bench/check_heads.py`` compares the two).  In one run, bounded
by ``--deadline-seconds`` of wall time counted from the start, it

1. rebuilds the demo corpus with ``bench/train_demo_pair.py``'s ``collect_corpus`` (same
   roots, same order, capped at ``--max-bytes``) and keeps its training split only;
   tokenizes it with the demo tokenizer;
2. builds self-distillation data for the frozen demo ``target`` (qwen3) and ``hybrid``
   (qwen3_5), loaded from their mlx-lm folders: random prompt windows of 64..192 tokens,
   continued greedily by the model itself to a fixed total length (EOS ignored), plus the
   model's layer outputs on the whole sequence (kept on the GPU);
3. trains six items concurrently, one process per head on the same GPU, each stopping by
   wall time:
   * ``dflash_target``: DFlash block drafter (2 layers, block 16) for the target;
   * ``dflash_hybrid``: the same for the hybrid;
   * ``mtp_post`` / ``mtp_pre``: a Qwen3.5 MTP head for the hybrid, fed the hybrid's last
     hidden after / before its final norm (both kept; the log marks the better one); six
     unrolled steps;
   * ``eagle3_target``: an EAGLE-3 head for the target (draft vocab: the whole target vocab,
     through the target's own lm_head, frozen; six unrolled steps);
   * ``drafter_hybrid``: not a head but a 2-layer Qwen3.5 LM (one linear-attention layer, one
     full-attention layer, warm-started from the hybrid's layers 0 and 3) drafting for the
     hybrid as an ordinary draft model; it reads tokens only, exported as an mlx-lm folder;
4. scores every head on held-out generated sequences (teacher-forced acceptance proxies),
   exports them in float16 in their published layouts and packs everything into
   ``<out>/heads.tar`` (split into ``heads.tarNN`` pieces below 16 MiB when larger; join
   them with ``cat``), plus ``<out>/train_heads_log.json``.

``--tiny`` is a CPU smoke test of the whole pipeline (under a minute on 2 cores).

The torch modules are importable without a GPU and without side effects, for equivalence
checks against the MLX drafters: ``build_dflash``/``export_dflash``, ``build_mtp``/
``export_mtp``, ``build_eagle3``/``export_eagle3``, ``load_head`` and ``HEADS`` (the
config.json of each demo head).
"""

from __future__ import annotations

import time

T_START = time.time()  # the deadline counts from here, imports included

import argparse
import glob
import hashlib
import importlib.util
import inspect
import io
import json
import math
import os
import random
import sys
import tarfile
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "mlx_treespec" / "demo"
VOCAB = 4096
MAX_PIECE_BYTES = 15 * 1024 * 1024 + 512 * 1024

# ============================================================================ head configs


def _dflash_config(H, heads, kv_heads, intermediate, target_layers):
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": H, "num_hidden_layers": 2, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": 64, "intermediate_size": intermediate,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
        "vocab_size": VOCAB, "max_position_embeddings": 2048, "tie_word_embeddings": False,
        "attention_bias": False, "hidden_act": "silu", "torch_dtype": "float16",
        "block_size": 16, "num_target_layers": target_layers,
        "dflash_config": {"target_layer_ids": [1, 3, 5, 7], "mask_token_id": 0},
    }


# The demo hybrid's config.json (checked against the shipped file at run time).  The MTP
# heads' config is this plus the two mtp keys: it is what the hybrid folder's config
# becomes once model-mtp.safetensors is added to it.
_HYBRID_CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5", "vocab_size": VOCAB,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25},
    "tie_word_embeddings": True, "attention_bias": False,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
                   + ["full_attention"],
    "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "torch_dtype": "float16",
    "num_hidden_layers": 8, "hidden_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 256,
    "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 64,
    "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
}

HEADS = {
    "dflash_target": _dflash_config(384, 6, 2, 1024, 8),
    "dflash_hybrid": _dflash_config(256, 4, 2, 512, 8),
    "mtp_post": dict(_HYBRID_CONFIG, mtp_num_hidden_layers=1, mtp_hidden="post"),
    "mtp_pre": dict(_HYBRID_CONFIG, mtp_num_hidden_layers=1, mtp_hidden="pre"),
    "eagle3_target": {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": 384, "num_hidden_layers": 1, "num_attention_heads": 6,
        "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 1024,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
        "vocab_size": VOCAB, "draft_vocab_size": VOCAB, "target_hidden_size": 384,
        "eagle_aux_hidden_state_layer_ids": [1, 3, 4], "max_position_embeddings": 2048,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
        "torch_dtype": "float16",
    },
    # not a head: a small Qwen3.5 LM (mlx-lm folder, flat config as the demo hybrid's) drafting
    # for the hybrid on its own; its arch keys are train_demo_pair.HYBRID_ARCH's
    "drafter_hybrid": dict(_HYBRID_CONFIG, num_hidden_layers=2, full_attention_interval=2,
                           layer_types=["linear_attention", "full_attention"]),
}

# How each head is trained: the frozen model it drafts for, the features it reads
# ("layerI" = output of 0-based decoder layer I, never final-normed, so "layer7" is the
# hybrid's last hidden before its final norm; "post_norm" = that hidden after the norm),
# and its optimisation settings.  bs counts sequences per step.
TRAIN = {
    "dflash_target": dict(kind="dflash", source="target", features=["layer1", "layer3", "layer5", "layer7"],
                          lr=1e-3, bs=32, anchors=48, gamma=7.0, init="target_layers_6_7"),
    "dflash_hybrid": dict(kind="dflash", source="hybrid", features=["layer1", "layer3", "layer5", "layer7"],
                          lr=1.5e-3, bs=32, anchors=48, gamma=7.0, init="random"),
    # six unrolled steps (run 6; run 1 had three): its chains ran 10-16 steps deep
    "mtp_post": dict(kind="mtp", source="hybrid", features=["post_norm"], lr=1e-3, bs=32,
                     unroll=6, decay=0.8, init="hybrid_layer_7"),
    "mtp_pre": dict(kind="mtp", source="hybrid", features=["layer7"], lr=1e-3, bs=32,
                    unroll=6, decay=0.8, init="hybrid_layer_7"),
    "eagle3_target": dict(kind="eagle3", source="target", features=["layer1", "layer3", "layer4"],
                          lr=1e-3, bs=32, unroll=6, decay=0.8, init="lm_head_from_embedding",
                          frozen_lm_head=True),  # the target's own lm_head (not shipped: the loader binds it)
    # next-token CE (generated labels weight 1, prompt text prompt_weight) + kl x KL to the
    # frozen hybrid's logits, computed on the fly in the worker (the data keeps no logits)
    "drafter_hybrid": dict(kind="drafter", source="hybrid", features=[], lr=1e-3, bs=32,
                           prompt_weight=0.3, kl=1.0, init="hybrid_layers_0_3"),
}
TRAIN_COMMON = dict(betas=(0.9, 0.95), weight_decay=0.01, grad_clip=1.0, warmup_steps=100,
                    min_lr_frac=0.1, init_std=0.02)

# ============================================================================ shared math


def _dims(cfg):
    rp = cfg.get("rope_parameters") or {}
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return dict(H=cfg["hidden_size"], nh=cfg["num_attention_heads"], nkv=cfg["num_key_value_heads"],
                d=d, inter=cfg["intermediate_size"], eps=cfg["rms_norm_eps"],
                theta=float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                rotary=int(d * rp.get("partial_rotary_factor", 1.0)))


class RMSNorm(nn.Module):
    """RMSNorm in float32.  zero_centred: the stored weight w acts as (1 + w) (Qwen3.5)."""

    def __init__(self, dim, eps, zero_centred=False):
        super().__init__()
        self.eps, self.zero_centred = eps, zero_centred
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    def forward(self, x):
        x = x.float()
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float()
        return y * (1.0 + w if self.zero_centred else w)


def rope(x, pos, rotary_dim, theta):
    """Non-traditional RoPE on the first rotary_dim dims.  x [b, S, heads, d]; pos [S] or [b, S]."""
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=x.device, dtype=torch.float32) / rotary_dim))
    f = pos.to(torch.float32)[..., None] * inv
    emb = torch.cat([f, f], -1)[..., None, :]
    cos, sin = emb.cos(), emb.sin()
    xr, xp = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    half = rotary_dim // 2
    rot = torch.cat([-xr[..., half:], xr[..., :half]], -1)
    return torch.cat([xr * cos + rot * sin, xp.to(torch.float32)], -1)


def attend(q, k, v, mask):
    """GQA attention, scale head_dim^-0.5.  q [b, S, nh, d]; k, v [b, Sk, nkv, d];
    mask: bool [S, Sk] or [b, S, Sk] (True = visible) or None (everything visible)."""
    b, S, nh, d = q.shape
    g = nh // k.shape[2]
    q = q.to(v.dtype).transpose(1, 2)
    k = k.to(v.dtype).transpose(1, 2).repeat_interleave(g, 1)
    v = v.transpose(1, 2).repeat_interleave(g, 1)
    if mask is not None:
        mask = mask[:, None] if mask.ndim == 3 else mask
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return o.transpose(1, 2).reshape(b, S, nh * d)


class MLP(nn.Module):
    def __init__(self, H, inter):
        super().__init__()
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """q/k/v/o projections with the options the three heads need: per-head q/k norms (plain
    or zero-centred), a per-head output gate packed into q_proj (Qwen3.5), an input wider
    than the hidden (EAGLE-3), partial rotary."""

    def __init__(self, in_dim, H, nh, nkv, d, eps, rotary, theta, qk_norm=None, gated=False):
        super().__init__()
        self.nh, self.nkv, self.d, self.rotary, self.theta, self.gated = nh, nkv, d, rotary, theta, gated
        self.q_proj = nn.Linear(in_dim, nh * d * (2 if gated else 1), bias=False)
        self.k_proj = nn.Linear(in_dim, nkv * d, bias=False)
        self.v_proj = nn.Linear(in_dim, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, H, bias=False)
        if qk_norm is not None:
            self.q_norm = RMSNorm(d, eps, zero_centred=qk_norm == "zero")
            self.k_norm = RMSNorm(d, eps, zero_centred=qk_norm == "zero")
        self.qk_norm = qk_norm is not None

    def query(self, x, pos):
        """-> (q [b, S, nh, d] with RoPE, gate [b, S, nh*d] or None)"""
        b, S = x.shape[:2]
        q, gate = self.q_proj(x).view(b, S, self.nh, -1), None
        if self.gated:  # per head: first d = query, last d = gate
            q, gate = q[..., :self.d], q[..., self.d:].reshape(b, S, -1)
        if self.qk_norm:
            q = self.q_norm(q)
        return rope(q, pos, self.rotary, self.theta), gate

    def key_value(self, x, pos):
        b, S = x.shape[:2]
        k = self.k_proj(x).view(b, S, self.nkv, self.d)
        if self.qk_norm:
            k = self.k_norm(k)
        return rope(k, pos, self.rotary, self.theta), self.v_proj(x).view(b, S, self.nkv, self.d)

    def output(self, a, gate):
        if gate is not None:
            a = a * torch.sigmoid(gate.to(a.dtype))
        return self.o_proj(a)


def _init_linear(module, std):
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)


def _causal(S, device):
    return torch.ones(S, S, dtype=torch.bool, device=device).tril()


def ttt_mask(S, step, device):
    """Training-time-test mask of unrolled step `step` (0-based) over the keys of steps
    0..step laid side by side: step-0 keys causally (slot j <= t), the keys of steps
    1..step only at the query's own slot (its own chain)."""
    eye = torch.eye(S, dtype=torch.bool, device=device)
    return torch.cat([_causal(S, device)] + [eye] * step, dim=1)


def _save_safetensors(tensors, path):
    from safetensors.torch import save_file

    out = {}
    for k, v in tensors.items():
        v = v.detach().cpu()
        out[k] = (v.to(torch.float16) if v.is_floating_point() else v).contiguous()
    save_file(out, str(path), metadata={"format": "pt"})


def _load_safetensors(path):
    from safetensors.torch import load_file

    return {k: (v.float() if v.is_floating_point() else v) for k, v in load_file(str(path)).items()}


# ============================================================================ DFlash


class DFlashLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["H"], c["eps"])
        self.self_attn = Attention(c["H"], c["H"], c["nh"], c["nkv"], c["d"], c["eps"], c["rotary"],
                                   c["theta"], qk_norm="plain")
        self.post_attention_layernorm = RMSNorm(c["H"], c["eps"])
        self.mlp = MLP(c["H"], c["inter"])


class DFlash(nn.Module):
    """DFlash block drafter.  Tensor names are the published ones (no embedding, no lm_head:
    both are the target's, passed in as embed_weight)."""

    def __init__(self, cfg):
        super().__init__()
        c = self.dims = _dims(cfg)
        self.block = cfg["block_size"]
        self.mask_id = cfg["dflash_config"]["mask_token_id"]
        self.layer_ids = list(cfg["dflash_config"]["target_layer_ids"])
        self.fc = nn.Linear(len(self.layer_ids) * c["H"], c["H"], bias=False)
        self.hidden_norm = RMSNorm(c["H"], c["eps"])
        self.layers = nn.ModuleList([DFlashLayer(c) for _ in range(cfg["num_hidden_layers"])])
        self.norm = RMSNorm(c["H"], c["eps"])

    def hidden(self, ctx_feats, x_tok, x_pos, mask, embed_weight):
        """ctx_feats [b, T, n*H] at positions 0..T-1; block tokens x_tok [b, Q] at positions
        x_pos [b, Q]; mask bool [b, Q, T + Q] or None.  -> final-normed hidden [b, Q, H]."""
        ctx = self.hidden_norm(self.fc(ctx_feats))  # shared by all layers, no input_layernorm
        ctx_pos = torch.arange(ctx.shape[1], device=ctx.device)
        x = F.embedding(x_tok, embed_weight).float()
        for layer in self.layers:
            at = layer.self_attn
            xn = layer.input_layernorm(x)
            q, _ = at.query(xn, x_pos)
            kb, vb = at.key_value(xn, x_pos)
            kc, vc = at.key_value(ctx, ctx_pos)
            a = attend(q, torch.cat([kc, kb], 1), torch.cat([vc, vb], 1), mask)
            x = x + at.output(a, None)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def forward_block(self, ctx_feats, root, embed_weight):
        """One block at positions L..L+B-1 after a context at 0..L-1 (inference: no mask).
        ctx_feats [L, n*H] -> float32 logits [B, V]; row k (k >= 1) predicts position L + k."""
        L, B = ctx_feats.shape[0], self.block
        dev = ctx_feats.device
        tok = torch.full((1, B), self.mask_id, dtype=torch.long, device=dev)
        tok[0, 0] = int(root)
        pos = torch.arange(L, L + B, device=dev)[None]
        h = self.hidden(ctx_feats[None].float(), tok, pos, None, embed_weight.float())
        return (h[0] @ embed_weight.float().T).float()


def build_dflash(cfg):
    return DFlash(cfg)


def export_dflash(model, cfg, folder):
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    _save_safetensors(model.state_dict(), folder / "model.safetensors")


def dflash_mask(T, anchors, B):
    """Training mask for blocks at `anchors` [b, M]: block m sees context keys j < a_m and
    its own block (bidirectionally), never another block.  -> bool [b, M*B, T + M*B]."""
    b, M = anchors.shape
    dev = anchors.device
    qa = anchors.repeat_interleave(B, dim=1)
    ctx = torch.arange(T, device=dev)[None, None, :] < qa[:, :, None]
    blk = torch.arange(M * B, device=dev) // B
    own = (blk[:, None] == blk[None, :])[None].expand(b, -1, -1)
    return torch.cat([ctx, own], dim=2)


def dflash_logits(model, feats, tokens, anchors, embed_weight):
    """Blocks rooted at `anchors` [b, M] (need a + B - 1 < T).  -> (logits [b, M, B-1, V] of
    block positions 1..B-1, labels [b, M, B-1])."""
    B, (b, T), M = model.block, tokens.shape, anchors.shape[1]
    k = torch.arange(B, device=tokens.device)
    pos = anchors[:, :, None] + k  # [b, M, B]
    x_tok = torch.full((b, M, B), model.mask_id, dtype=torch.long, device=tokens.device)
    x_tok[:, :, 0] = tokens.gather(1, anchors)
    h = model.hidden(feats, x_tok.flatten(1), pos.flatten(1), dflash_mask(T, anchors, B), embed_weight)
    h = h.view(b, M, B, -1)[:, :, 1:]
    labels = tokens.gather(1, pos[:, :, 1:].flatten(1)).view(b, M, B - 1)
    return F.linear(h, embed_weight).float(), labels


def dflash_loss(model, feats, tokens, plen, embed_weight, n_anchors, gamma, gen):
    """Weighted block CE at n_anchors random anchors per sequence in the generated part."""
    b, T = tokens.shape
    B, dev = model.block, tokens.device
    j = torch.arange(T, device=dev)
    valid = (j[None] >= plen[:, None]) & (j[None] <= T - B)
    scores = torch.rand(b, T, device=dev, generator=gen).masked_fill(~valid, -1.0)
    top = scores.topk(n_anchors, dim=1)
    anchors = top.indices.clamp(max=T - B)
    logits, labels = dflash_logits(model, feats, tokens, anchors, embed_weight)
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
    w = torch.exp(-(torch.arange(1, B, device=dev, dtype=torch.float32) - 1) / gamma)
    w = w[None, None] * (top.values >= 0).float()[:, :, None]
    return (ce * w).sum() / w.sum()


# ============================================================================ MTP


class MTPLayer(nn.Module):
    """A Qwen3.5 full-attention decoder layer (zero-centred norms, gated attention)."""

    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["H"], c["eps"], zero_centred=True)
        self.self_attn = Attention(c["H"], c["H"], c["nh"], c["nkv"], c["d"], c["eps"], c["rotary"],
                                   c["theta"], qk_norm="zero", gated=True)
        self.post_attention_layernorm = RMSNorm(c["H"], c["eps"], zero_centred=True)
        self.mlp = MLP(c["H"], c["inter"])


class MTP(nn.Module):
    """Qwen3.5 MTP head, raw HF layout without the `mtp.` prefix (export adds it).  The norms
    store w, acting as (1 + w).  lm_head is the (tied) target embedding."""

    def __init__(self, cfg):
        super().__init__()
        c = self.dims = _dims(cfg)
        self.fc = nn.Linear(2 * c["H"], c["H"], bias=False)
        self.pre_fc_norm_embedding = RMSNorm(c["H"], c["eps"], zero_centred=True)
        self.pre_fc_norm_hidden = RMSNorm(c["H"], c["eps"], zero_centred=True)
        self.layers = nn.ModuleList([MTPLayer(c) for _ in range(cfg.get("mtp_num_hidden_layers", 1))])
        self.norm = RMSNorm(c["H"], c["eps"], zero_centred=True)

    def step_core(self, tok, hidden, pos, past, mask, embed_weight, first=True):
        """One pass over slots: tok [b, S] (embedded), hidden [b, S, H], positions pos [S].
        past: (k, v) of the earlier unrolled steps, attended with `mask` [S, (len(past)+1)*S].
        -> (logits [b, S, V], o [b, S, H] = the hidden fed to the next step, (k, v))"""
        e = F.embedding(tok, embed_weight)
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden)], -1))
        layer = self.layers[0]
        at = layer.self_attn
        xn = layer.input_layernorm(u)
        q, gate = at.query(xn, pos)
        k, v = at.key_value(xn, pos)
        ks = torch.cat([p[0] for p in past] + [k], 1)
        vs = torch.cat([p[1] for p in past] + [v], 1)
        z = u.float() + at.output(attend(q, ks, vs, mask), gate)
        z = z + layer.mlp(layer.post_attention_layernorm(z))
        o = self.norm(z)
        return F.linear(o, embed_weight).float(), o, (k, v)

    def step(self, tokens, hidden, embed_weight):
        """First pass: slot t gets E[tokens[t]] and hidden[t] at position t (causal).
        -> (logits [T, V] float32, out_hidden [T, H] = post-mtp.norm o)"""
        T = tokens.shape[0]
        dev = hidden.device
        logits, o, _ = self.step_core(tokens[None].long(), hidden[None].float(), torch.arange(T, device=dev),
                                      [], _causal(T, dev), embed_weight.float())
        return logits[0], o[0].float()


def build_mtp(cfg):
    return MTP(cfg)


def export_mtp(model, cfg, folder):
    """model-mtp.safetensors (mtp.* tensors, raw layout), mtp.json (mtp_num_hidden_layers,
    mtp_hidden: the two keys the hybrid's config gains) and config.json (the hybrid's config
    with those keys, so the folder loads as a target folder on its own)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    side = {k: cfg[k] for k in ("mtp_num_hidden_layers", "mtp_hidden")}
    (folder / "mtp.json").write_text(json.dumps(side, indent=2) + "\n")
    _save_safetensors({"mtp." + k: v for k, v in model.state_dict().items()}, folder / "model-mtp.safetensors")


# ============================================================================ EAGLE-3


class Eagle3MidLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["H"], c["eps"])
        self.hidden_norm = RMSNorm(c["H"], c["eps"])
        self.self_attn = Attention(2 * c["H"], c["H"], c["nh"], c["nkv"], c["d"], c["eps"], c["d"], c["theta"])
        self.post_attention_layernorm = RMSNorm(c["H"], c["eps"])
        self.mlp = MLP(c["H"], c["inter"])


class Eagle3(nn.Module):
    """EAGLE-3 head (SafeAILab layout).  d2t/t2d are buffers: draft id i is target id
    i + d2t[i]; t2d marks the target ids in the draft vocab."""

    def __init__(self, cfg):
        super().__init__()
        c = self.dims = _dims(cfg)
        Ht = cfg.get("target_hidden_size", c["H"])
        n_aux = len(cfg.get("eagle_aux_hidden_state_layer_ids", [0, 1, 2]))
        self.fc = nn.Linear(n_aux * Ht, c["H"], bias=False)
        self.midlayer = Eagle3MidLayer(c)
        self.norm = RMSNorm(c["H"], c["eps"])
        self.lm_head = nn.Linear(c["H"], cfg["draft_vocab_size"], bias=False)
        self.register_buffer("d2t", torch.zeros(cfg["draft_vocab_size"], dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg["vocab_size"], dtype=torch.bool))

    def set_draft_vocab(self, ids):
        ids = torch.as_tensor(sorted(int(i) for i in ids), dtype=torch.long, device=self.d2t.device)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_ids(self):
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def step_core(self, tok, hidden, pos, past, mask, embed_weight, first):
        """first: hidden holds the concatenated target features and fc is applied.
        -> (draft-vocab logits [b, S, Vd], out [b, S, H] (pre-norm, fed to the next step), (k, v))"""
        m = self.midlayer
        g = self.fc(hidden) if first else hidden
        x = torch.cat([m.input_layernorm(F.embedding(tok, embed_weight)), m.hidden_norm(g)], -1)
        at = m.self_attn
        q, _ = at.query(x, pos)
        k, v = at.key_value(x, pos)
        ks = torch.cat([p[0] for p in past] + [k], 1)
        vs = torch.cat([p[1] for p in past] + [v], 1)
        z = g.float() + at.output(attend(q, ks, vs, mask), None)
        out = z + m.mlp(m.post_attention_layernorm(z))
        return self.lm_head(self.norm(out)).float(), out, (k, v)

    def step(self, tokens, hidden_or_feats, embed_weight, first):
        """One causal pass over T slots at positions 0..T-1 (slot t: E[tokens[t]] and
        hidden_or_feats[t]).  -> (logits over the draft vocab [T, Vd], out_hidden [T, H])"""
        T = tokens.shape[0]
        dev = tokens.device
        logits, out, _ = self.step_core(tokens[None].long(), hidden_or_feats[None].float(),
                                        torch.arange(T, device=dev), [], _causal(T, dev),
                                        embed_weight.float(), first)
        return logits[0], out[0].float()


def build_eagle3(cfg):
    return Eagle3(cfg)


def export_eagle3(model, cfg, folder):
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    _save_safetensors(model.state_dict(), folder / "model.safetensors")


def load_head(folder):
    """Rebuild an exported head (float32) from its folder."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    if (folder / "model-mtp.safetensors").exists():
        model = build_mtp(cfg)
        sd = {k[4:]: v for k, v in _load_safetensors(folder / "model-mtp.safetensors").items()
              if k.startswith("mtp.")}
    else:
        model = (build_dflash if "dflash_config" in cfg else build_eagle3)(cfg)
        sd = _load_safetensors(folder / "model.safetensors")
    model.load_state_dict(sd, strict=True)
    return model, cfg


# ============================================================================ unrolled chains


def chain_unroll(model, tokens, hidden, embed_weight, n_steps, first_is_feats=False):
    """Teacher-forced unrolled drafting (EAGLE-3's training-time test) over every slot.
    Slot t (0..T-2), step s (0-based): input token x_{t+s+1} at position t+s, label
    x_{t+s+2}; step 0 reads hidden[t], step s > 0 the head's own output of step s-1.
    -> list over steps of (logits [b, S, V'], labels [b, S] with -1 past the end)."""
    b, T = tokens.shape
    S, dev = T - 1, tokens.device
    base = torch.arange(S, device=dev)
    h, past, outs = hidden[:, :S], [], []
    pad = torch.zeros(b, n_steps + 1, dtype=tokens.dtype, device=dev)
    padded = torch.cat([tokens, pad], 1)
    lab_pad = torch.cat([tokens, pad - 1], 1)
    for s in range(n_steps):
        tok = padded[:, s + 1:s + 1 + S]
        logits, h, kv = model.step_core(tok, h, base + s, past, ttt_mask(S, s, dev), embed_weight,
                                        first=first_is_feats and s == 0)
        past.append(kv)
        outs.append((logits, lab_pad[:, s + 2:s + 2 + S]))
    return outs


def chain_loss(model, kind, tokens, plen, hidden, embed_weight, n_steps, decay, t2d_index=None):
    """Sum over steps of decay^s * mean CE on labels in the generated part, / sum of weights.
    EAGLE-3: CE over the draft vocab, on labels that are in it."""
    outs = chain_unroll(model, tokens, hidden, embed_weight, n_steps, kind == "eagle3")
    S = tokens.shape[1] - 1
    t = torch.arange(S, device=tokens.device)
    total, wsum = 0.0, 0.0
    for s, (logits, labels) in enumerate(outs):
        ok = (labels >= 0) & ((t + s + 2)[None] >= plen[:, None])
        if kind == "eagle3":
            labels = t2d_index[labels.clamp(min=0)]
            ok = ok & (labels >= 0)
        ce = F.cross_entropy(logits.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none")
        ce = (ce * ok.flatten()).sum() / ok.sum().clamp(min=1)
        total, wsum = total + decay ** s * ce, wsum + decay ** s
    return total / wsum


# ============================================================================ held-out proxies


@torch.no_grad()
def eval_dflash(model, ev, embed_weight, feat_fn, stride, seq_chunk, anchor_chunk, gamma, autocast):
    """Teacher-forced block acceptance: for anchors a = P, P+stride, ... the accepted length is
    the number of leading block positions (1..B-1) whose argmax equals the greedy token."""
    B = model.block
    acc_all, ce_sum, ce_n = [], 0.0, 0
    N, T = ev["tokens"].shape
    w = torch.exp(-(torch.arange(1, B, dtype=torch.float32) - 1) / gamma)
    for i in range(0, N, seq_chunk):
        tok, plen = ev["tokens"][i:i + seq_chunk], ev["plen"][i:i + seq_chunk]
        feats = feat_fn(ev, slice(i, i + seq_chunk))
        n_max = (T - B - int(plen.min())) // stride + 1
        a_all = plen[:, None] + stride * torch.arange(n_max, device=tok.device)[None]
        valid_all = a_all <= T - B
        for j in range(0, n_max, anchor_chunk):
            a, valid = a_all[:, j:j + anchor_chunk].clamp(max=T - B), valid_all[:, j:j + anchor_chunk]
            with autocast():
                logits, labels = dflash_logits(model, feats, tok, a, embed_weight)
            hit = (logits.argmax(-1) == labels).long()  # [b, m, B-1]
            lead = hit.cumprod(-1).sum(-1)
            acc_all.append(lead[valid].cpu())
            ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
            ce_sum += float((ce[valid] * w.to(ce.device)).sum() / w.sum())
            ce_n += int(valid.sum())
    acc = torch.cat(acc_all).float()
    ge = [round(float((acc >= k).float().mean()), 4) for k in range(1, B)]
    return dict(blocks=int(acc.numel()), anchor_stride=stride,
                mean_accepted=round(float(acc.mean()), 4),
                tokens_per_round=round(1 + float(acc.mean()), 4),
                p_accept_ge=ge, heldout_weighted_ce=round(ce_sum / max(1, ce_n), 4))


@torch.no_grad()
def eval_chain(model, kind, ev, embed_weight, hid_fn, n_steps, train_steps, seq_chunk, autocast):
    """Teacher-forced chain acceptance over every slot whose n_steps labels are all in the
    generated part.  While a greedy chain matches, its inputs are the ground-truth tokens, so
    teacher forcing gives exactly the drafted chain's acceptance."""
    N, T = ev["tokens"].shape
    S = T - 1
    hits = []
    vocab = model.draft_ids() if kind == "eagle3" else None
    for i in range(0, N, seq_chunk):
        tok, plen = ev["tokens"][i:i + seq_chunk], ev["plen"][i:i + seq_chunk]
        with autocast():
            outs = chain_unroll(model, tok, hid_fn(ev, slice(i, i + seq_chunk)), embed_weight, n_steps,
                                kind == "eagle3")
        t = torch.arange(S, device=tok.device)
        # slots whose input token is generated (at inference the chain starts from the bonus token)
        sel = ((t[None] + 1) >= plen[:, None]) & ((t + n_steps + 1) <= T - 1)[None]
        hs = []
        for logits, labels in outs:
            pred = logits.argmax(-1)
            if vocab is not None:
                pred = vocab[pred]
            hs.append((pred == labels)[sel].cpu())
        hits.append(torch.stack(hs, -1))
    h = torch.cat(hits).long()  # [n_slots, n_steps]
    chain = h.cumprod(-1)
    ge = chain.float().mean(0)
    return dict(slots=int(h.shape[0]), eval_steps=n_steps,
                step_top1=[round(float(x), 4) for x in h.float().mean(0)],
                p_accept_ge=[round(float(x), 4) for x in ge],
                mean_accepted_at_train_steps=round(float(ge[:train_steps].sum()), 4),
                mean_accepted_at_eval_steps=round(float(ge.sum()), 4))


# ============================================================================ small hybrid draft model


def build_drafter(cfg):
    """A transformers Qwen3_5ForCausalLM with cfg's shape (HYBRID_ARCH's keys, read from cfg)."""
    tdp = _demo_pair()
    return tdp.build_model("qwen3_5", {k: cfg[k] for k in tdp.HYBRID_ARCH})


def export_drafter(model, cfg, folder):
    """An mlx-lm model folder: flat qwen3_5 config.json, float16 model.safetensors in mlx-lm's
    post-sanitize layout and the demo tokenizer files, so mlx_lm.load(folder) opens it."""
    tdp = _demo_pair()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    assert tdp.hybrid_config_dict({k: cfg[k] for k in tdp.HYBRID_ARCH}) == cfg, "drafter config drifted"
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tdp.save_weights(tdp.mlx_weights("qwen3_5", model), folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / f).write_bytes((DEMO / "hybrid" / f).read_bytes())  # they are links there: copy the bytes


def drafter_loss(model, tokens, plen, prompt_weight, teacher=None, kl=0.0):
    """Next-token CE at every position: weight 1 where the label is generated (the target's own
    greedy token, what the drafter must predict), prompt_weight on the prompt's text; plus
    kl x KL(frozen model || drafter) at the same weights when a teacher is given."""
    logq = model(input_ids=tokens).logits[:, :-1].float().log_softmax(-1)
    gen = torch.arange(1, tokens.shape[1], device=tokens.device)[None] >= plen[:, None]
    w = gen.float() * (1.0 - prompt_weight) + prompt_weight
    loss = -logq.gather(-1, tokens[:, 1:, None])[..., 0]
    if teacher is not None and kl:
        with torch.no_grad():
            logp = teacher(input_ids=tokens).logits[:, :-1].float().log_softmax(-1)
        loss = loss + kl * (logp.exp() * (logp - logq)).sum(-1)
    return (loss * w).sum() / w.sum()


@torch.no_grad()
def eval_drafter(model, ev, n_steps, seq_chunk, autocast):
    """Teacher-forced top-1 agreement with the greedy token at generated positions, and the
    chain acceptance of eval_chain: a chain of n_steps drafted after slot s (a generated token:
    the bonus token at inference) accepts the leading matches of slots s..s+n_steps-1; while it
    matches its inputs are the true tokens, so one teacher-forced pass gives it exactly."""
    N, T = ev["tokens"].shape
    t = torch.arange(T - 1, device=ev["tokens"].device)
    hits, chains, ce_sum = [], [], 0.0
    for i in range(0, N, seq_chunk):
        tok, plen = ev["tokens"][i:i + seq_chunk], ev["plen"][i:i + seq_chunk]
        with autocast():
            logits = model(input_ids=tok).logits[:, :-1].float()
        hit = logits.argmax(-1) == tok[:, 1:]  # slot s predicts position s + 1
        gen = (t[None] + 1) >= plen[:, None]
        ce = F.cross_entropy(logits.transpose(1, 2), tok[:, 1:], reduction="none")
        hits.append(hit[gen].cpu())
        ce_sum += float(ce[gen].sum())
        chains.append(hit.unfold(1, n_steps, 1)[t[None, :T - n_steps] >= plen[:, None]].cpu())
    h, c = torch.cat(hits).float(), torch.cat(chains).long()
    ge = c.cumprod(-1).float().mean(0)
    return dict(generated_positions=int(h.numel()), top1_generated=round(float(h.mean()), 4),
                heldout_generated_ce=round(ce_sum / max(1, h.numel()), 4), slots=int(c.shape[0]),
                eval_steps=n_steps, step_top1=[round(float(x), 4) for x in c.float().mean(0)],
                p_accept_ge=[round(float(x), 4) for x in ge],
                mean_accepted_at_eval_steps=round(float(ge.sum()), 4),
                tokens_per_round=round(1 + float(ge.sum()), 4))


# ============================================================================ frozen demo models


def _demo_pair():
    """bench/train_demo_pair.py as a module (corpus rule and transformers model builders)."""
    if "train_demo_pair" in sys.modules:
        return sys.modules["train_demo_pair"]
    spec = importlib.util.spec_from_file_location("train_demo_pair", REPO / "bench" / "train_demo_pair.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_demo_pair"] = mod
    spec.loader.exec_module(mod)
    return mod


def demo_state(name):
    """The demo model's weights in transformers' layout (float32): the inverse of
    train_demo_pair.mlx_weights (drop `language_model.`, conv1d [C, K, 1] -> [C, 1, K],
    stored 1 + w -> w for the zero-centred Qwen3.5 norms)."""
    sd = {}
    for f in sorted(glob.glob(str(DEMO / name / "*.safetensors"))):
        if not Path(f).name.startswith("model-mtp"):
            sd.update(_load_safetensors(f))
    if name != "hybrid":
        return sd
    out = {}
    for k, v in sd.items():
        k = k.removeprefix("language_model.")
        if "conv1d.weight" in k:
            v = v.permute(0, 2, 1).contiguous()
        if k.endswith(("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                       "k_norm.weight")) or k == "model.norm.weight":
            v = v - 1.0
        out[k] = v
    return out


def load_frozen(name, device):
    tdp = _demo_pair()
    kind, arch = ("qwen3", tdp.TARGET_ARCH) if name == "target" else ("qwen3_5", tdp.HYBRID_ARCH)
    model = tdp.build_model(kind, arch)
    missing, unexpected = model.load_state_dict(demo_state(name), strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "lm_head not tied"
    return model.to(device).eval().requires_grad_(False)


def _cache_kw(model):
    # transformers renamed past_key_values -> cache (5.2x); both accept the name they declare
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def greedy_continue(model, prompts, n_new):
    """Greedy continuation with the KV / recurrent cache, EOS ignored (fixed length)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    kw = {_cache_kw(model): cache, "use_cache": True, "logits_to_keep": 1}
    nxt = model(input_ids=prompts, **kw).logits[:, -1].argmax(-1)
    out = [nxt]
    for _ in range(n_new - 1):
        nxt = model(input_ids=nxt[:, None], **kw).logits[:, -1].argmax(-1)
        out.append(nxt)
    return torch.cat([prompts, torch.stack(out, 1)], 1)


@torch.no_grad()
def capture(model, seqs, layer_ids, post, chunk):
    """Layer outputs (forward hooks: never final-normed; transformers' last hidden_states
    entry is final-normed) and, if `post`, the final-normed last hidden, as bf16
    [N, T, n_features, H]; also the teacher-forced argmax and log-probs."""
    N, T = seqs.shape
    H = model.config.hidden_size
    n_feat = len(layer_ids) + post  # 0 for the drafter alone: no features, feats is None
    feats = torch.empty(N, T, n_feat, H, dtype=torch.bfloat16, device=seqs.device) if n_feat else None
    argmax = torch.empty(N, T, dtype=torch.long, device=seqs.device)
    logp = torch.empty(N, T - 1, device=seqs.device)
    got = {}
    last = model.config.num_hidden_layers - 1

    def hook(i):
        return lambda mod, inp, out: got.__setitem__(i, out[0] if isinstance(out, tuple) else out)

    hooks = [model.model.layers[i].register_forward_hook(hook(i)) for i in sorted(set(layer_ids) | {last})]
    try:
        for i in range(0, N, chunk):
            x = seqs[i:i + chunk]
            logits = model(input_ids=x, use_cache=False).logits.float()
            parts = [got[j] for j in layer_ids] + ([model.model.norm(got[last])] if post else [])
            if n_feat:
                feats[i:i + chunk] = torch.stack(parts, 2).to(torch.bfloat16)
            argmax[i:i + chunk] = logits.argmax(-1)
            logp[i:i + chunk] = logits[:, :-1].log_softmax(-1).gather(2, x[:, 1:, None])[..., 0]
    finally:
        for h in hooks:
            h.remove()
    return feats, argmax, logp


def build_source(name, model, features, stream, regions, args, rng, device, log, stop_at):
    """Self-distillation sequences for one frozen model.  Every greedy batch has one prompt
    length; the first batches also carry the eval rows (--eval-batch per batch, prompts from
    the stream's last part), so eval costs no extra decoding.  Batches continue until
    --gen-seconds or the unix time stop_at (at least --min-seqs, at most --max-seqs training
    sequences).
    features: the names the heads read ("layerI", "post_norm"); only those are kept."""
    T = args.seq_len
    layer_ids = sorted({int(f[len("layer"):]) for f in features if f.startswith("layer")})
    post = "post_norm" in features
    info = dict(seq_len=T, prompt_len=[args.prompt_min, args.prompt_max], batches=[])
    t0 = time.time()
    parts = {"eval": [], "train": []}
    n_done = {"eval": 0, "train": 0}

    def windows(region, n, P):
        lo, hi = regions[region]
        return [stream[s:s + P] for s in (rng.randrange(lo, hi - P) for _ in range(n))]

    while n_done["eval"] < args.eval_seqs or n_done["train"] < args.min_seqs or (
            n_done["train"] < args.max_seqs and time.time() < min(t0 + args.gen_seconds, stop_at)):
        n_ev = min(args.eval_batch, args.eval_seqs - n_done["eval"])
        n_tr = max(0, min(args.gen_batch - n_ev, args.max_seqs - n_done["train"]))
        P = rng.randint(args.prompt_min, args.prompt_max)
        prompts = np.stack(windows("eval", n_ev, P) + windows("train", n_tr, P)).astype(np.int64)
        tg = time.time()
        seqs = greedy_continue(model, torch.from_numpy(prompts).to(device), T - P)
        if device.type == "cuda":
            torch.cuda.synchronize()
        info["batches"].append(dict(eval=n_ev, train=n_tr, prompt_len=P, gen_seconds=round(time.time() - tg, 2)))
        plen = torch.full((n_ev + n_tr,), P, dtype=torch.long, device=device)
        for split, rows in (("eval", slice(0, n_ev)), ("train", slice(n_ev, n_ev + n_tr))):
            if rows.stop > rows.start:
                parts[split].append((seqs[rows], plen[rows]))
                n_done[split] += rows.stop - rows.start
    info["generation_seconds"] = round(time.time() - t0, 1)

    sets = {}
    for split in ("eval", "train"):
        seqs = torch.cat([p[0] for p in parts[split]])
        plen = torch.cat([p[1] for p in parts[split]])
        feats, argmax, logp = capture(model, seqs, layer_ids, post, args.feat_chunk)
        t = torch.arange(T, device=device)
        gen_part = (t[None, 1:] >= plen[:, None])  # predicted position t+1 is generated
        agree = (argmax[:, :-1] == seqs[:, 1:])[gen_part].float().mean()
        prompt_part = ~gen_part
        sets[split] = dict(tokens=seqs, plen=plen, feats=feats)
        info[split] = dict(
            sequences=int(seqs.shape[0]), tokens=int(seqs.numel()),
            generated_tokens=int((T - plen).sum()),
            prompt_lengths=sorted({int(x) for x in plen.tolist()}),
            tokens_sha256=hashlib.sha256(seqs.to(torch.int32).cpu().numpy().tobytes()).hexdigest(),
            # the cached greedy loop vs one full forward: ~1 unless the cache path is wrong
            full_forward_argmax_agreement=round(float(agree), 5),
            # loss of the loaded model on the real text of the prompts: checks the weight import
            prompt_ce=round(float(-logp[prompt_part].mean()), 4),
            generated_mean_logprob=round(float(logp[gen_part].mean()), 4),
            distinct_generated_tokens=int(torch.unique(seqs[t[None] >= plen[:, None]]).numel()))
        log(f"{name} {split}: {json.dumps(info[split])}")
    info["feature_names"] = [f"layer{i}" for i in layer_ids] + (["post_norm"] if post else [])
    info["feature_dtype"] = "bfloat16"
    info["seconds"] = round(time.time() - t0, 1)
    return sets, info


def _generated_counts(tokens, plen):
    T = tokens.shape[1]
    gen = tokens[torch.arange(T, device=tokens.device)[None] >= plen[:, None]]
    return torch.bincount(gen.flatten().cpu(), minlength=VOCAB).double()


def draft_vocab(train, ev, corpus_ids, size):
    """The `size` most frequent tokens among the target's generated training tokens (ties and
    a short tail filled by corpus frequency, then lowest id), in ascending id order."""
    g = _generated_counts(train["tokens"], train["plen"])
    c = torch.bincount(torch.from_numpy(corpus_ids.astype(np.int64)), minlength=VOCAB).double()
    score = g * (c.sum() + 1) + c  # lexicographic: generated count first, then corpus count
    order = sorted(range(VOCAB), key=lambda i: (-float(score[i]), i))[:size]
    ids = sorted(order)
    ge = _generated_counts(ev["tokens"], ev["plen"])
    return ids, dict(size=size, rule="top generated-token frequency (target training sequences), "
                                    "ties by corpus frequency then id; ascending ids",
                     generated_token_coverage=round(float(g[ids].sum() / g.sum()), 5),
                     eval_generated_token_coverage=round(float(ge[ids].sum() / ge.sum()), 5),
                     ids_sha256=hashlib.sha256(json.dumps(ids).encode()).hexdigest())


# ============================================================================ one head


def _feature_fn(spec, feat_names, dtype):
    cols = [feat_names.index(f) for f in spec["features"]]

    def fn(data, rows):
        f = data["feats"][rows]
        f = f[:, :, cols].flatten(2) if len(cols) > 1 else f[:, :, cols[0]]
        return f.to(dtype)

    return fn


def _init_head(name, spec, model):
    """Warm starts (see TRAIN[name]['init']); everything else keeps std-0.02 / unit-norm init."""
    init = spec["init"]
    if init == "target_layers_6_7":  # the draft layers have the target layers' exact shape
        sd = demo_state("target")
        own = model.state_dict()
        for i, src in enumerate((6, 7)):
            for k in own:
                if k.startswith(f"layers.{i}."):
                    own[k] = sd[f"model.layers.{src}." + k[len(f"layers.{i}."):]]
        own["norm.weight"] = sd["model.norm.weight"]
        model.load_state_dict(own)
    elif init == "hybrid_layer_7":  # the last full-attention layer: same type and shape
        sd = demo_state("hybrid")
        own = model.state_dict()
        for k in own:
            if k.startswith("layers.0."):
                own[k] = sd["model.layers.7." + k[len("layers.0."):]]
        own["norm.weight"] = sd["model.norm.weight"]
        model.load_state_dict(own)
    elif init == "hybrid_layers_0_3":  # the drafter: layer 0 <- 0 (linear attn), 1 <- 3 (full attn)
        sd, mine = demo_state("hybrid"), model.state_dict()
        own = {k: sd[k.replace("model.layers.1.", "model.layers.3.")] for k in mine if k != "lm_head.weight"}
        assert all(v.shape == mine[k].shape for k, v in own.items()), "drafter / hybrid shapes differ"
        missing, unexpected = model.load_state_dict(own, strict=False)  # lm_head is the tied embedding
        assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "lm_head not tied"
    elif init == "lm_head_from_embedding":  # the target's tied lm_head rows of the draft vocab
        sd = demo_state("target")
        with torch.no_grad():
            model.lm_head.weight.copy_(sd["model.embed_tokens.weight"][model.draft_ids()])
            model.norm.weight.copy_(sd["model.norm.weight"])


def train_head(name, data, opts, log):
    """Train one head until opts['train_until'] (unix time) or opts['max_steps'], score it
    on the held-out sequences and export it.  -> result dict for the log."""
    spec, cfg = TRAIN[name], HEADS[name]
    device = torch.device(opts["device"])
    seed = opts["seed"] + list(HEADS).index(name)
    torch.manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    use_amp = opts.get("amp", device.type == "cuda")

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp)

    kind = spec["kind"]
    model = {"dflash": build_dflash, "mtp": build_mtp, "eagle3": build_eagle3,
             "drafter": build_drafter}[kind](cfg)
    _init_linear(model, TRAIN_COMMON["init_std"])
    if kind == "eagle3":
        model.set_draft_vocab(data["draft_vocab"])
    _init_head(name, spec, model)
    if spec.get("frozen_lm_head"):
        model.lm_head.weight.requires_grad_(False)
    model.to(device).train()
    # the drafter's KL target: the frozen hybrid, run here (the data carries no logits)
    teacher = load_frozen(spec["source"], device) if kind == "drafter" and spec.get("kl") else None
    embed = demo_state("target" if spec["source"] == "target" else "hybrid")["model.embed_tokens.weight"].to(device)
    # stored bf16; without autocast (CPU) the head computes in float32
    feat_fn = _feature_fn(spec, data["feature_names"], torch.bfloat16 if use_amp else torch.float32)
    tr, ev = data["train"], data["eval"]
    N = tr["tokens"].shape[0]
    t2d_index = None
    if kind == "eagle3":
        t2d_index = torch.full((VOCAB,), -1, dtype=torch.long, device=device)
        t2d_index[model.draft_ids()] = torch.arange(cfg["draft_vocab_size"], device=device)

    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    lr, tc = spec["lr"], TRAIN_COMMON
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=tc["betas"], **({"fused": True} if device.type == "cuda" else {}))
    warmup = opts.get("warmup_steps", tc["warmup_steps"])
    bs = min(spec["bs"], opts.get("max_bs", spec["bs"]), N)
    t_start, t_end = time.time(), opts["train_until"]
    step, curve, pending = 0, [], []
    while step < opts.get("max_steps", 1 << 62) and (time.time() < t_end or step == 0):
        # warmup by steps, cosine by wall time (the step time changes as the other heads start/stop)
        prog = min(1.0, (time.time() - t_start) / max(1e-6, t_end - t_start))
        if opts.get("max_steps"):
            prog = step / opts["max_steps"]
        cur = lr * min(1.0, (step + 1) / warmup) * (
            tc["min_lr_frac"] + (1 - tc["min_lr_frac"]) * 0.5 * (1 + math.cos(math.pi * prog)))
        for g in opt.param_groups:
            g["lr"] = cur
        rows = torch.randint(N, (bs,), device=device, generator=gen)
        tok, plen = tr["tokens"][rows], tr["plen"][rows]
        with autocast():
            if kind == "dflash":
                loss = dflash_loss(model, feat_fn(tr, rows), tok, plen, embed, spec["anchors"],
                                   spec["gamma"], gen)
            elif kind == "drafter":
                loss = drafter_loss(model, tok, plen, spec["prompt_weight"], teacher, spec.get("kl", 0.0))
            else:
                loss = chain_loss(model, kind, tok, plen, feat_fn(tr, rows), embed, spec["unroll"],
                                  spec["decay"], t2d_index)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc["grad_clip"])
        opt.step()
        step += 1
        pending.append((step, loss.detach()))
        if step % 50 == 0 or step <= 2:  # .item() syncs: only now and then
            curve += [(s, round(float(v), 4)) for s, v in pending]
            pending = []
            if step % 500 == 0 or step <= 2:
                log(f"{name}: step {step} loss {curve[-1][1]:.4f} lr {cur:.2e}")
    curve += [(s, round(float(v), 4)) for s, v in pending]
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.time() - t_start
    model.eval()
    te = time.time()
    ev_opts = opts["eval"]
    if kind == "dflash":
        metrics = eval_dflash(model, ev, embed, feat_fn, ev_opts["anchor_stride"], ev_opts["seq_chunk"],
                              ev_opts["anchor_chunk"], spec["gamma"], autocast)
    elif kind == "drafter":
        metrics = eval_drafter(model, ev, ev_opts["chain_steps"], ev_opts["seq_chunk"], autocast)
    else:
        steps = max(ev_opts["chain_steps"], spec["unroll"])  # every trained step is scored
        metrics = eval_chain(model, kind, ev, embed, feat_fn, steps, spec["unroll"], ev_opts["seq_chunk"], autocast)
    eval_s = time.time() - te
    folder = Path(opts["stage"]) / name
    model.float().cpu()
    {"dflash": export_dflash, "mtp": export_mtp, "eagle3": export_eagle3,
     "drafter": export_drafter}[kind](model, cfg, folder)
    tail = [v for _, v in curve[-100:]]
    res = dict(
        kind=kind, source=spec["source"], features=spec["features"], init=spec["init"],
        parameters=sum(p.numel() for p in model.parameters()),
        trained_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        steps=step, batch_sequences=bs, lr_peak=lr, warmup_steps=warmup,
        schedule="linear warmup (steps), cosine to min_lr_frac x peak over the wall-clock budget",
        **{k: v for k, v in tc.items() if k != "warmup_steps"},
        **{k: v for k, v in spec.items()
           if k in ("anchors", "gamma", "unroll", "decay", "prompt_weight", "kl")},
        train_seconds=round(train_s, 1), ms_per_step=round(1000 * train_s / max(1, step), 1),
        sequences_seen=step * bs, final_train_loss=round(float(np.mean(tail)), 4) if tail else None,
        loss_curve=curve[::max(1, len(curve) // 60)] + curve[-1:],
        heldout=metrics, eval_seconds=round(eval_s, 1), train_sequences=N,
        eval_sequences=int(ev["tokens"].shape[0]),
        max_memory_allocated_gb=(round(torch.cuda.max_memory_allocated() / 2**30, 2)
                                 if device.type == "cuda" else None))
    log_name = "mtp_train_log.json" if kind == "mtp" else "train_log.json"
    (folder / log_name).write_text(json.dumps(dict(head=name, config=cfg, **res), indent=2) + "\n")
    return res


def _ipc_child(queue, answer):
    t = queue.get(timeout=60)
    answer.put(float(t.sum().item()))


def cuda_ipc_works(log):
    """Whether a spawned process can read a CUDA tensor this one made (the heads' data travels
    so); checked once, cheaply, before anything depends on it."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue, answer = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_ipc_child, args=(queue, answer))
    p.start()
    t = torch.ones(4, device="cuda")
    try:
        queue.put(t)
        ok = answer.get(timeout=60) == 4.0
    except Exception as e:  # noqa: BLE001 - any failure means: train in this process
        log(f"CUDA IPC check failed ({type(e).__name__}: {e}): training the heads in this process")
        ok = False
    p.join(timeout=5)
    if p.is_alive():
        p.kill()
    return ok


def _worker(name, opts, queue, result_path):
    """One head in its own process: set up while the data is being generated, then train."""
    t0 = time.time()

    def log(*a):
        print(f"[{time.time() - opts['t_start']:7.1f}s]", *a, flush=True)

    torch.set_num_threads(opts.get("threads", 1))
    if opts["device"].startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        # masked attention runs on the memory-efficient (or math) kernel; keep cuDNN's out of it
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.zeros(1, device=opts["device"])  # CUDA context now, not on the clock later
    res = dict(status="failed")
    try:
        data = queue.get(timeout=max(1.0, opts["train_until"] - time.time()))
        if data is None:
            raise RuntimeError("no data for this head (generation failed)")
        res["waited_for_data_s"] = round(time.time() - t0, 1)
        res.update(train_head(name, data, opts, log), status="ok")
        log(f"{name}: done, {res['steps']} steps, held-out {json.dumps(res['heldout'])}")
    except Exception:
        res["error"] = traceback.format_exc()[-3000:]
        log(f"{name}: FAILED\n{res['error']}")
    tmp = Path(str(result_path) + ".tmp")
    tmp.write_text(json.dumps(res))
    tmp.replace(result_path)


# ============================================================================ main


def _pack(stage, names, out, summary):
    """tar the head folders (+ heads_summary.json) into out/heads.tar, or heads.tarNN pieces
    below 16 MiB (the five heads together are ~17 MiB, the drafter ~4 MiB more)."""
    def plain(ti):
        ti.mode = 0o755 if ti.isdir() else 0o644
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        return ti

    (stage / "heads_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(str(stage / "heads_summary.json"), arcname="heads_summary.json", filter=plain)
        for n in names:
            tf.add(str(stage / n), arcname=n, filter=plain)
    data = buf.getvalue()
    members = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        for m in tf.getmembers():
            if m.isfile():
                members[m.name] = dict(bytes=m.size, sha256=hashlib.sha256(tf.extractfile(m).read()).hexdigest())
    for old in glob.glob(str(out / "heads.tar*")):
        os.remove(old)
    if len(data) <= MAX_PIECE_BYTES:
        (out / "heads.tar").write_bytes(data)
        files = ["heads.tar"]
    else:
        files = []
        for i in range(0, len(data), MAX_PIECE_BYTES):
            fn = f"heads.tar{i // MAX_PIECE_BYTES:02d}"
            (out / fn).write_bytes(data[i:i + MAX_PIECE_BYTES])
            files.append(fn)
    return dict(files=files, tar_bytes=len(data), tar_sha256=hashlib.sha256(data).hexdigest(),
                join=None if len(files) == 1 else "cat heads.tar?? > heads.tar", members=members)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="gets heads.tar (or heads.tarNN) and train_heads_log.json")
    ap.add_argument("--stage", default=None, help="unpacked head folders (default $TMPDIR/heads_stage)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--deadline-seconds", type=float, default=500, help="whole run, from process start")
    ap.add_argument("--end-reserve", type=float, default=40,
                    help="seconds before the deadline at which training stops (eval, export, pack)")
    ap.add_argument("--max-bytes", type=int, default=40_000_000, help="corpus cap (collect_corpus)")
    ap.add_argument("--seq-len", type=int, default=448, help="prompt + greedy continuation, tokens")
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=192)
    ap.add_argument("--gen-batch", type=int, default=2048, help="sequences per greedy batch (one prompt length)")
    ap.add_argument("--gen-seconds", type=float, default=35, help="greedy decoding time per frozen model")
    ap.add_argument("--min-seqs", type=int, default=2048)
    ap.add_argument("--max-seqs", type=int, default=16384)
    ap.add_argument("--eval-seqs", type=int, default=256)
    ap.add_argument("--eval-batch", type=int, default=64, help="eval rows carried by each greedy batch")
    ap.add_argument("--feat-chunk", type=int, default=128)
    ap.add_argument("--max-steps", type=int, default=None, help="cap on steps per head (debugging)")
    ap.add_argument("--max-bs", type=int, default=None, help="cap on sequences per step (debugging)")
    ap.add_argument("--only", default=",".join(HEADS), help="comma list of heads: " + ", ".join(HEADS))
    ap.add_argument("--inline", action="store_true", help="train the heads one after the other in this "
                    "process (debugging; they share the training time)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test of the whole pipeline")
    ap.add_argument("--cpu-amp", action="store_true", help="bf16 autocast on CPU too (tests the GPU dtype path)")
    args = ap.parse_args()

    def log(*a):
        print(f"[{time.time() - T_START:7.1f}s]", *a, flush=True)

    names = [n.strip() for n in args.only.split(",") if n.strip()]
    bad = [n for n in names if n not in HEADS]
    if bad:
        ap.error(f"unknown heads {bad}; choose from {list(HEADS)}")
    eval_opts = dict(anchor_stride=2, seq_chunk=8, anchor_chunk=64, chain_steps=5)
    head_opts = {}
    if args.tiny:
        args.max_bytes = min(args.max_bytes, 1_500_000)
        args.seq_len, args.prompt_min, args.prompt_max = 96, 24, 40
        args.gen_batch, args.min_seqs, args.max_seqs, args.eval_seqs, args.eval_batch = 8, 8, 8, 4, 4
        args.feat_chunk = 8
        args.deadline_seconds = min(args.deadline_seconds, 110)
        args.end_reserve = min(args.end_reserve, 25)
        eval_opts.update(anchor_stride=8, seq_chunk=2, anchor_chunk=8, chain_steps=4)
        head_opts = dict(max_steps=4, warmup_steps=2, max_bs=4)
        # OpenMP threads spin-wait: on a small shared CPU, more threads than free cores crawl
        torch.set_num_threads(1)
    if args.max_steps:
        head_opts.update(max_steps=args.max_steps, warmup_steps=min(TRAIN_COMMON["warmup_steps"],
                                                                    max(1, args.max_steps // 10)))
    if args.max_bs:
        head_opts["max_bs"] = args.max_bs
    if args.cpu_amp:
        head_opts["amp"] = True
    args.min_seqs = min(args.min_seqs, args.max_seqs)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    # the frozen models generate the data in float32 without TF32: their greedy choice is the label
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(args.stage) if args.stage else Path(os.environ.get("TMPDIR", "/tmp")) / "heads_stage"
    stage.mkdir(parents=True, exist_ok=True)
    (stage / "results").mkdir(exist_ok=True)
    for n in names:
        for p in (stage / "results" / f"{n}.json", stage / n):
            if p.is_file():
                p.unlink()
            elif p.is_dir():
                for f in p.iterdir():
                    f.unlink()
    random.seed(args.seed), np.random.seed(args.seed), torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    import safetensors
    import tokenizers
    import transformers

    env = dict(python=sys.version.split()[0], torch=torch.__version__, transformers=transformers.__version__,
               tokenizers=tokenizers.__version__, safetensors=safetensors.__version__, numpy=np.__version__,
               device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
               cpu_count=os.cpu_count(), argv=sys.argv[1:])
    logd = dict(env=env, args=vars(args), heads={}, timings={}, train_common=TRAIN_COMMON,
                eval=eval_opts)
    timings = logd["timings"]

    def mark(key):
        timings[key] = round(time.time() - T_START, 1)

    def write_log():
        (out / "train_heads_log.json").write_text(json.dumps(logd, indent=2) + "\n")

    log("env", env)
    mark("imports")
    deadline = T_START + args.deadline_seconds
    train_until = deadline - args.end_reserve

    # the target first: its data is quicker to make, so its heads start training sooner
    sources = [s for s in ("target", "hybrid") if any(TRAIN[n]["source"] == s for n in names)]
    for n in names:
        logd["heads"][n] = dict(config=HEADS[n], train=TRAIN[n], status="pending")
    shipped = json.loads((DEMO / "hybrid" / "config.json").read_text())
    assert all(shipped[k] == v for k, v in _HYBRID_CONFIG.items()), "demo hybrid config changed"

    # --- workers start now, so their imports and CUDA setup overlap the data generation
    if device.type == "cuda":  # this process only feeds the GPU; leave the cores to the heads
        torch.set_num_threads(min(4, os.cpu_count() or 1))
    opts = dict(device=str(device), seed=args.seed, stage=str(stage), train_until=train_until,
                t_start=T_START, eval=eval_opts, threads=1, **head_opts)
    procs, queues = {}, {}
    if not args.inline and device.type == "cuda" and not cuda_ipc_works(log):
        args.inline = True
    if not args.inline:
        ctx = torch.multiprocessing.get_context("spawn")
        for n in names:
            queues[n] = ctx.Queue()
            procs[n] = ctx.Process(target=_worker, args=(n, opts, queues[n], stage / "results" / f"{n}.json"),
                                   name=f"head-{n}")
            procs[n].start()
        log(f"started {len(procs)} head processes: {', '.join(names)}")

    # --- corpus (training split only) and tokens
    tdp = _demo_pair()
    train_docs, _heldout_docs, corpus = tdp.collect_corpus(args.max_bytes)
    corpus.update(used_split="train", note="only the training split is read; held-out files are excluded")
    logd["corpus"] = corpus
    log("corpus", {k: v for k, v in corpus.items() if k not in ("rule", "roots")})
    from tokenizers import Tokenizer

    tok_path = DEMO / "target" / "tokenizer.json"
    tok = Tokenizer.from_file(str(tok_path))
    stream = tdp.encode_docs(tok, train_docs)
    del train_docs
    n_tok = int(stream.size)
    cut = int(n_tok * 0.95)  # eval prompts come from the stream's last 5%, training prompts from the rest
    regions = {"train": (0, cut), "eval": (cut, n_tok)}
    logd["tokens"] = dict(tokenizer=str(tok_path.relative_to(REPO)),
                          tokenizer_sha256=hashlib.sha256(tok_path.read_bytes()).hexdigest(),
                          train_split_tokens=n_tok, bytes_per_token=round(corpus["train_bytes"] / n_tok, 3),
                          prompt_regions=dict(train=[0, cut], eval=[cut, n_tok]),
                          stream_sha256=hashlib.sha256(stream.tobytes()).hexdigest())
    log(f"tokens: {n_tok} in the training split")
    mark("corpus_and_tokens")
    write_log()

    # --- self-distillation data, per frozen model; each head gets its data as soon as it exists
    datasets, logd["data"] = {}, {}
    for src in sources:
        heads_here = [n for n in names if TRAIN[n]["source"] == src]
        try:
            t0 = time.time()
            model = load_frozen(src, device)
            features = [f for n in heads_here for f in TRAIN[n]["features"]]
            # a late start must not eat the training time: stop decoding early if need be
            stop_at = train_until - 0.5 * (train_until - T_START)
            sets, info = build_source(src, model, features, stream, regions, args, rng, device, log, stop_at)
            info["load_seconds"] = round(time.time() - t0 - info["seconds"], 1)
            data = dict(feature_names=info["feature_names"], **sets)
            if src == "target":
                ids, vinfo = draft_vocab(sets["train"], sets["eval"], stream,
                                         HEADS["eagle3_target"]["draft_vocab_size"])
                data["draft_vocab"] = ids
                logd["draft_vocab"] = vinfo
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            datasets[src] = data
            if device.type == "cuda":
                info["gpu_memory_allocated_gb"] = round(torch.cuda.memory_allocated() / 2**30, 2)
            logd["data"][src] = info
            for n in heads_here:
                if n in queues:
                    queues[n].put(data)
        except Exception:
            err = traceback.format_exc()[-3000:]
            log(f"data for {src}: FAILED\n{err}")
            logd["data"][src] = dict(failed=err)
            for n in heads_here:
                if n in queues:
                    queues[n].put(None)
        mark(f"data_{src}")
        write_log()

    # --- training (in the workers, or here with --inline), then collect
    if args.inline:
        todo = [n for n in names if TRAIN[n]["source"] in datasets]
        for i, n in enumerate(todo):
            share = (train_until - time.time()) / (len(todo) - i)
            o = dict(opts, train_until=time.time() + share)
            try:
                res = dict(train_head(n, datasets[TRAIN[n]["source"]], o, log), status="ok")
            except Exception:
                res = dict(status="failed", error=traceback.format_exc()[-3000:])
                log(f"{n}: FAILED\n{res['error']}")
            (stage / "results" / f"{n}.json").write_text(json.dumps(res))
    else:
        for q in queues.values():
            q.cancel_join_thread()  # a head that died before reading its data must not block our exit
        for n, p in procs.items():
            p.join(timeout=max(0.0, deadline - 10 - time.time()))
            if p.is_alive():
                log(f"{n}: still running at the deadline, terminated")
                p.terminate()
                p.join(5)
    mark("training_eval_export")
    for n in names:
        rp = stage / "results" / f"{n}.json"
        logd["heads"][n].update(json.loads(rp.read_text()) if rp.exists() else dict(status="no result"))
    mtp = {n: logd["heads"][n]["heldout"]["mean_accepted_at_train_steps"] for n in ("mtp_post", "mtp_pre")
           if logd["heads"].get(n, {}).get("status") == "ok"}
    if mtp:
        best = max(mtp, key=mtp.get)
        logd["mtp_choice"] = dict(better=best, mtp_hidden=HEADS[best]["mtp_hidden"],
                                  criterion="held-out teacher-forced mean accepted length, "
                                            f"{TRAIN[best]['unroll']}-step chain",
                                  mean_accepted=mtp)
        log(f"MTP: {best} is better ({mtp})")
    done = [n for n in names if logd["heads"][n].get("status") == "ok" and (stage / n).is_dir()]
    if done:
        summary = dict(heads={n: dict(folder=n, kind=TRAIN[n]["kind"], source=TRAIN[n]["source"],
                                      steps=logd["heads"][n]["steps"], heldout=logd["heads"][n]["heldout"])
                              for n in done}, mtp_choice=logd.get("mtp_choice"),
                       log="train_heads_log.json (next to the tar)")
        logd["package"] = _pack(stage, done, out, summary)
        log("packed", logd["package"]["files"], f"{logd['package']['tar_bytes']} bytes:", ", ".join(done))
    mark("end")
    write_log()
    for n in names:
        h = logd["heads"][n]
        log(f"{n}: {h.get('status')} steps={h.get('steps')} loss={h.get('final_train_loss')} "
            f"held-out={json.dumps(h.get('heldout'))}")
    log("done")


if __name__ == "__main__":
    main()
