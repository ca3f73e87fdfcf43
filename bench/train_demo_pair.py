#!/usr/bin/env python3
"""Train the demo models shipped in ``mlx_treespec/demo/`` (target, drafter, hybrid).

Standalone script, not part of the runtime library.  It needs torch, transformers
(>= 5.17, for the Qwen3 and Qwen3.5 classes), tokenizers, safetensors and numpy, and is
meant to run once on a GPU machine (the shipped models came from exactly this command on
one H200, see bench/DEMO_PAIR.md):

    PYTHONUNBUFFERED=1 python3 bench/train_demo_pair.py --out $OUT --stage /tmp/demo_stage

In one run it

1. builds a corpus of Python source: the interpreter's standard library plus its
   site-packages ``.py`` files, sorted by path, deduplicated by content, capped in
   bytes; files whose ``sha1(path) % 50 == 0`` are held out for evaluation, and 50
   held-out prompts/passages are written to ``heldout_prompts.json``;
2. trains a byte-level BPE tokenizer (vocab 4096, NFC + the Qwen3.5 pre-tokenizer regex,
   ``<|endoftext|>`` as bos/eos/pad/unk);
3. trains, with bf16 autocast, AdamW and a cosine schedule over random 512-token windows:
   * ``target``: Qwen3ForCausalLM, 8 layers, hidden 384 (~14.2M parameters);
   * ``drafter``: Qwen3ForCausalLM, 2 layers, hidden 256 (~2.6M), cross-entropy; a
     snapshot at 30% of its steps is exported too (``drafter_early``, a weaker candidate);
   * ``drafter_kd`` (optional, ``--only ...,drafter_kd``): the drafter distilled from the
     target (CE + KL on the target's logits);
   * ``hybrid``: Qwen3.5 text model (GatedDeltaNet linear attention, full attention
     every 4th layer), 8 layers, hidden 256 (~4.1M);
4. exports every model as an mlx-lm folder (``config.json``, float16 safetensors with
   the names mlx-lm expects after ``sanitize``, sharded above 15 MiB, tokenizer files,
   ``train_log.json``) under ``--stage`` and packs each folder into ``<out>/<name>.tar``
   (split into ``.tarNN`` pieces below 16 MiB), plus ``<out>/meta.tar`` holding
   ``heldout_prompts.json`` and the overall ``train_log.json``.

Every phase stops by wall time (``--*-seconds``, the cosine schedule is sized from the
measured step time); ``--deadline-seconds`` bounds the whole run.  ``--tiny`` is a CPU
smoke mode (small corpus, 3 steps per model, well under a minute).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import random
import site
import sys
import sysconfig
import tarfile
import time
import traceback
from pathlib import Path

import numpy as np

T0 = time.time()
VOCAB = 4096
EOS = "<|endoftext|>"
SEQ = 512
HELDOUT_MOD = 50
MAX_SHARD_BYTES = 15 * 1024 * 1024
MAX_PIECE_BYTES = 15 * 1024 * 1024 + 512 * 1024

# mlx-lm config keys (flat) for each architecture.
TARGET_ARCH = dict(num_hidden_layers=8, hidden_size=384, num_attention_heads=6,
                   num_key_value_heads=2, head_dim=64, intermediate_size=1024)
DRAFTER_ARCH = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, intermediate_size=768)
HYBRID_ARCH = dict(num_hidden_layers=8, hidden_size=256, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, intermediate_size=256,
                   linear_num_key_heads=2, linear_num_value_heads=2,
                   linear_key_head_dim=64, linear_value_head_dim=64,
                   linear_conv_kernel_dim=4, full_attention_interval=4)
ROPE_THETA = 10000.0
HYBRID_PARTIAL_ROTARY = 0.25


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


# --------------------------------------------------------------------------- corpus


def _walk_py(root: Path, skip_dirs=()):
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in skip_dirs and d != "__pycache__")
        for f in filenames:
            if f.endswith(".py"):
                out.append(Path(dirpath) / f)
    return out


def collect_corpus(max_bytes: int, max_file_bytes: int = 400_000,
                   max_line: int = 1000):
    """Return (train_docs, heldout_docs, info).  Docs are (relpath, text)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    sites = []
    for p in list(site.getsitepackages()) + [sysconfig.get_paths()["purelib"],
                                             sysconfig.get_paths()["platlib"]]:
        p = Path(p).resolve()
        if p.is_dir() and p not in sites:
            sites.append(p)
    cands = []
    for f in _walk_py(stdlib, skip_dirs=("site-packages", "dist-packages")):
        cands.append(("stdlib/" + f.relative_to(stdlib).as_posix(), f))
    for i, sp in enumerate(sorted(sites)):
        for f in _walk_py(sp):
            cands.append((f"site{i}/" + f.relative_to(sp).as_posix(), f))
    cands.sort(key=lambda x: x[0])
    seen, docs, total = set(), [], 0
    skipped = dict(size=0, decode=0, long_line=0, dup=0, empty=0)
    for rel, f in cands:
        try:
            raw = f.read_bytes()
        except OSError:
            continue
        if len(raw) > max_file_bytes:
            skipped["size"] += 1
            continue
        if not raw.strip():
            skipped["empty"] += 1
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped["decode"] += 1
            continue
        if "\x00" in text or max(map(len, text.split("\n"))) > max_line:
            skipped["long_line"] += 1
            continue
        h = hashlib.sha1(raw).hexdigest()
        if h in seen:
            skipped["dup"] += 1
            continue
        seen.add(h)
        if total + len(raw) > max_bytes:
            break
        total += len(raw)
        docs.append((rel, text, h))
    listing = "\n".join(f"{rel}\t{len(t.encode())}\t{h}" for rel, t, h in docs)
    held = lambda rel: int(hashlib.sha1(rel.encode()).hexdigest(), 16) % HELDOUT_MOD == 0
    train = [(r, t) for r, t, _ in docs if not held(r)]
    heldout = [(r, t) for r, t, _ in docs if held(r)]
    info = dict(
        python=sys.version.split()[0],
        roots=["stdlib=" + str(stdlib)] + [f"site{i}={p}" for i, p in enumerate(sorted(sites))],
        rule=("all .py files under the roots, sorted by relative path, skipping __pycache__, "
              f"files > {max_file_bytes} bytes, non-UTF-8 files, files with a line > {max_line} "
              f"chars and exact duplicates; taken in order until {max_bytes} bytes"),
        files=len(docs), bytes=total,
        file_list_sha256=hashlib.sha256(listing.encode()).hexdigest(),
        heldout_rule=f"int(sha1(relpath).hexdigest(), 16) % {HELDOUT_MOD} == 0",
        train_files=len(train), train_bytes=sum(len(t.encode()) for _, t in train),
        heldout_files=len(heldout), heldout_bytes=sum(len(t.encode()) for _, t in heldout),
        skipped=skipped,
    )
    return train, heldout, info


def make_heldout_prompts(heldout, n=50, seed=0, prompt_chars=200, text_chars=2000):
    """Deterministic prompts (from a line start, ~200 chars, ending at a line end) and
    longer held-out passages (for perplexity) from held-out files."""
    rng = random.Random(seed)
    files = sorted(heldout, key=lambda rt: hashlib.sha1(rt[0].encode()).hexdigest())
    files = [(r, t) for r, t in files if len(t) >= 3 * text_chars // 2]
    prompts, texts = [], []
    for rel, text in files[:n]:
        starts = [0] + [i + 1 for i, c in enumerate(text[:-text_chars]) if c == "\n"]
        # prefer lines that start with code, not blank lines
        starts = [s for s in starts if text[s:s + 1] not in ("\n", "")] or [0]
        s = rng.choice(starts)
        end = text.find("\n", s + prompt_chars)
        end = len(text) if end < 0 else end + 1
        end = min(end, s + prompt_chars + 200)
        prompts.append(dict(path=rel, offset=s, prompt=text[s:end]))
        texts.append(dict(path=rel, offset=s, text=text[s:s + text_chars]))
    return dict(
        description=("Held-out prompts and passages: files of the held-out split sorted by "
                     "sha1(path), first files with >= 3000 chars; random line start (seeded); "
                     "prompts are ~200 chars extended to the end of the line; texts are "
                     f"{text_chars} chars from the same offset."),
        seed=seed, prompts=prompts, texts=texts)


# --------------------------------------------------------------------------- tokenizer


# The pre-tokenizer and normalizer of transformers' Qwen3_5Tokenizer.  transformers (5.x)
# ignores tokenizer_config.json's tokenizer_class for model_type "qwen3_5" folders and
# rebuilds the tokenizer from tokenizer.json's vocab/merges with this pre-tokenizer and
# an NFC normalizer.  Using exactly these in tokenizer.json makes every folder tokenize
# identically whichever class transformers picks (TokenizersBackend for the qwen3
# folders, Qwen3_5Tokenizer for the qwen3_5 one).
QWEN35_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
                            r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def train_tokenizer(texts, vocab=VOCAB):
    from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                            processors, trainers)

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, min_frequency=2, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.get_vocab_size() == vocab, tok.get_vocab_size()
    assert tok.token_to_id(EOS) == 0
    return tok


def check_tokenizer_loading(tok, texts, tmp: Path):
    """Encode texts with transformers' AutoTokenizer on a qwen3 and a qwen3_5 folder
    and compare with the raw tokenizer (what the models are trained on)."""
    from transformers import AutoTokenizer

    ref = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    report = {}
    for mt, cfg in (("qwen3", qwen3_config_dict(TARGET_ARCH)), ("qwen3_5", hybrid_config_dict(HYBRID_ARCH))):
        d = tmp / f"tokcheck_{mt}"
        save_tokenizer(tok, d)
        (d / "config.json").write_text(json.dumps(cfg))
        at = AutoTokenizer.from_pretrained(str(d))
        got = [at.encode(t, add_special_tokens=False) for t in texts]
        bad = sum(a != b for a, b in zip(ref, got))
        report[mt] = dict(tokenizer_class=type(at).__name__, mismatching_texts=bad, texts=len(texts))
    return report


TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": EOS,
    "eos_token": EOS,
    "unk_token": EOS,
    "pad_token": EOS,
    "add_bos_token": False,
    "add_eos_token": False,
    "add_prefix_space": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 2048,
}


def save_tokenizer(tok, folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {k: EOS for k in ("bos_token", "eos_token", "unk_token", "pad_token")}, indent=2) + "\n")


def encode_docs(tok, docs):
    enc = getattr(tok, "encode_batch_fast", tok.encode_batch)
    texts = [t for _, t in docs]
    parts = [np.zeros(1, dtype=np.uint16)]  # leading <|endoftext|>
    B = 2048
    for i in range(0, len(texts), B):
        for e in enc(texts[i:i + B], add_special_tokens=False):
            parts.append(np.asarray(e.ids, dtype=np.uint16))
            parts.append(np.zeros(1, dtype=np.uint16))
    return np.concatenate(parts)


# --------------------------------------------------------------------------- models


def qwen3_config_dict(arch):
    return dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=VOCAB,
        max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=ROPE_THETA,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=True, attention_bias=False, hidden_act="silu",
        bos_token_id=0, eos_token_id=0, pad_token_id=0, torch_dtype="float16",
        **arch)


def hybrid_config_dict(arch):
    arch = dict(arch)
    n, every = arch["num_hidden_layers"], arch["full_attention_interval"]
    layer_types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    return dict(
        architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5", vocab_size=VOCAB,
        max_position_embeddings=2048, rms_norm_eps=1e-6, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA,
                         "partial_rotary_factor": HYBRID_PARTIAL_ROTARY},
        tie_word_embeddings=True, attention_bias=False, layer_types=layer_types,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, torch_dtype="float16",
        **arch)


def build_model(kind, arch):
    import transformers

    if kind == "qwen3":
        cfg = transformers.Qwen3Config(
            vocab_size=VOCAB, max_position_embeddings=2048, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
            tie_word_embeddings=True, attention_bias=False, hidden_act="silu",
            bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False, **arch)
        cfg._attn_implementation = "sdpa"
        return transformers.Qwen3ForCausalLM(cfg)
    if kind == "qwen3_5":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

        a = dict(arch)
        a.pop("full_attention_interval")
        cfg = Qwen3_5TextConfig(
            vocab_size=VOCAB, max_position_embeddings=2048, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA,
                             "partial_rotary_factor": HYBRID_PARTIAL_ROTARY},
            tie_word_embeddings=True, attention_bias=False, hidden_act="silu",
            layer_types=hybrid_config_dict(arch)["layer_types"],
            bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False, **a)
        cfg._attn_implementation = "sdpa"
        return Qwen3_5ForCausalLM(cfg)
    raise ValueError(kind)


def mlx_weights(kind, model):
    """torch state dict -> {name: float16 numpy} with mlx-lm's post-sanitize names."""
    sd = model.state_dict()
    out = {}
    for k, v in sd.items():
        if k == "lm_head.weight":  # tied
            continue
        a = v.detach().float().cpu()
        if kind == "qwen3_5":
            if "conv1d.weight" in k:  # torch [C, 1, K] -> mlx [C, K, 1]
                a = a.permute(0, 2, 1)
            if k.endswith(("input_layernorm.weight", "post_attention_layernorm.weight",
                           "q_norm.weight", "k_norm.weight")) or k == "model.norm.weight":
                a = a + 1.0  # Qwen3.5 RMSNorm computes x * (1 + w); mlx uses x * w
            k = "language_model." + k
        out[k] = a.numpy().astype(np.float16)
    return out


def save_weights(weights, folder: Path):
    from safetensors.numpy import save_file

    names = sorted(weights)
    shards, cur, cur_bytes = [], {}, 0
    for n in names:
        nb = weights[n].nbytes
        if cur and cur_bytes + nb > MAX_SHARD_BYTES:
            shards.append(cur)
            cur, cur_bytes = {}, 0
        cur[n] = weights[n]
        cur_bytes += nb
    shards.append(cur)
    meta = {"format": "mlx"}
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    files, index = [], {}
    for i, sh in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, str(folder / fn), metadata=meta)
        files.append(fn)
        index.update({n: fn for n in sh})
    total = sum(w.nbytes for w in weights.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": index}, indent=2) + "\n")
    return files


def export_model(name, kind, arch, model, tok, folder: Path, train_log):
    folder.mkdir(parents=True, exist_ok=True)
    cfg = qwen3_config_dict(arch) if kind == "qwen3" else hybrid_config_dict(arch)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    files = save_weights(mlx_weights(kind, model), folder)
    save_tokenizer(tok, folder)
    (folder / "train_log.json").write_text(json.dumps(train_log, indent=2) + "\n")
    log(f"exported {name} -> {folder} ({', '.join(files)})")


def pack(folders, out: Path, name: str):
    """tar the folders into out/name.tar (or out/name.tarNN pieces below 16 MiB)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for folder in folders:
            tf.add(str(folder), arcname=folder.name)
    data = buf.getvalue()
    if len(data) <= MAX_PIECE_BYTES:
        (out / f"{name}.tar").write_bytes(data)
        return [f"{name}.tar"]
    names = []
    for i in range(0, len(data), MAX_PIECE_BYTES):
        fn = f"{name}.tar{i // MAX_PIECE_BYTES:02d}"
        (out / fn).write_bytes(data[i:i + MAX_PIECE_BYTES])
        names.append(fn)
    return names


# --------------------------------------------------------------------------- training


class Trainer:
    def __init__(self, args, train_ids, heldout_ids, device):
        import torch

        self.torch = torch
        self.args = args
        self.device = device
        self.train = torch.from_numpy(train_ids.astype(np.int32)).to(device)
        self.heldout = torch.from_numpy(heldout_ids.astype(np.int32)).to(device)
        self.amp = device.type == "cuda"

    def batch(self, gen, bs, seq=SEQ):
        torch = self.torch
        n = self.train.numel() - seq - 1
        starts = torch.randint(0, n, (bs,), generator=gen, device="cpu").to(self.device)
        idx = starts[:, None] + torch.arange(seq + 1, device=self.device)[None]
        w = self.train[idx].long()
        return w[:, :-1], w[:, 1:]

    def autocast(self):
        torch = self.torch
        if self.amp:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    def eval_windows(self, n_windows, seq=SEQ):
        torch = self.torch
        n = self.heldout.numel() - seq - 1
        n_windows = max(1, min(n_windows, n // seq))
        starts = torch.linspace(0, n - 1, n_windows).long().to(self.device)
        idx = starts[:, None] + torch.arange(seq + 1, device=self.device)[None]
        return self.heldout[idx].long()

    def heldout_loss(self, model, n_windows, bs=32):
        torch, F = self.torch, self.torch.nn.functional
        w = self.eval_windows(n_windows)
        model.eval()
        tot, cnt = 0.0, 0
        with torch.no_grad():
            for i in range(0, w.shape[0], bs):
                x, y = w[i:i + bs, :-1], w[i:i + bs, 1:]
                with self.autocast():
                    logits = model(input_ids=x).logits
                loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1),
                                       reduction="sum")
                tot += loss.item()
                cnt += y.numel()
        model.train()
        return tot / cnt, cnt

    def agreement(self, a, b, n_windows, bs=32):
        """Teacher-forced top-1 agreement of models a and b on held-out windows."""
        torch = self.torch
        w = self.eval_windows(n_windows)
        a.eval(), b.eval()
        agree, cnt = 0, 0
        with torch.no_grad():
            for i in range(0, w.shape[0], bs):
                x = w[i:i + bs, :-1]
                with self.autocast():
                    pa = a(input_ids=x).logits.argmax(-1)
                    pb = b(input_ids=x).logits.argmax(-1)
                agree += (pa == pb).sum().item()
                cnt += pa.numel()
        a.train(), b.train()
        return agree / cnt

    def fit(self, name, model, *, lr, bs, seconds, seed, teacher=None, kd_alpha=0.5,
            max_steps=None, warmup=200, wd=0.1, min_lr_frac=0.1, snapshot_frac=None):
        torch, F = self.torch, self.torch.nn.functional
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed)
        model.to(self.device).train()
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
        kw = dict(fused=True) if self.device.type == "cuda" else {}
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=lr, betas=(0.9, 0.95), eps=1e-8, **kw)
        if teacher is not None:
            teacher.eval()
        total_steps = max_steps  # fixed once the step time is measured
        t_start = time.time()
        step, losses, log_every = 0, [], 50
        p0, p1 = 5, 25  # steps between which the step time is measured
        t_p0 = None
        snapshot = None
        while True:
            if total_steps is not None and step >= total_steps:
                break
            elapsed = time.time() - t_start
            if elapsed > seconds and step > 0:
                break
            if total_steps is None and step in (p0, p1):
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                if step == p0:
                    t_p0 = time.time()
                else:
                    per = (time.time() - t_p0) / (p1 - p0)
                    left = seconds - (time.time() - t_start)
                    total_steps = max(step + 1, step + int(0.97 * left / per))
                    log(f"{name}: {per * 1000:.1f} ms/step -> {total_steps} steps planned")
            if (snapshot_frac and snapshot is None and total_steps is not None
                    and step == max(1, int(snapshot_frac * total_steps))):
                snapshot = dict(step=step, state={k: v.detach().to("cpu", copy=True)
                                                  for k, v in model.state_dict().items()})
            wu = warmup if total_steps is None else min(warmup, max(1, total_steps // 10))
            if step < wu:
                cur = lr * (step + 1) / wu
            else:
                prog = min(1.0, (step - wu) / max(1, (total_steps or 10**9) - wu))
                cur = lr * (min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))
            for g in opt.param_groups:
                g["lr"] = cur
            x, y = self.batch(gen, bs)
            with self.autocast():
                logits = model(input_ids=x).logits
            lf = logits.float().reshape(-1, VOCAB)
            ce = F.cross_entropy(lf, y.reshape(-1))
            loss = ce
            if teacher is not None:
                with torch.no_grad(), self.autocast():
                    tl = teacher(input_ids=x).logits
                tlp = F.log_softmax(tl.float().reshape(-1, VOCAB), -1)
                kl = F.kl_div(F.log_softmax(lf, -1), tlp, log_target=True,
                              reduction="batchmean")
                loss = kd_alpha * ce + (1 - kd_alpha) * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 10 == 0 or step <= 3:
                losses.append((step, ce.item()))
            if step % log_every == 0 or step <= 3:
                log(f"{name}: step {step}/{total_steps} ce {ce.item():.4f} lr {cur:.2e}")
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.time() - t_start
        tail = [l for _, l in losses[-10:]]
        self.last_snapshot = snapshot
        return dict(steps=step, planned_steps=total_steps, batch_size=bs, seq_len=SEQ,
                    tokens_seen=step * bs * SEQ, train_seconds=round(wall, 1), lr=lr,
                    warmup_steps=min(warmup, max(1, (total_steps or step) // 10)),
                    min_lr_frac=min_lr_frac, weight_decay=wd, betas=[0.9, 0.95], grad_clip=1.0,
                    final_train_loss=round(float(np.mean(tail)), 4) if tail else None,
                    loss_curve=[(s, round(l, 4)) for s, l in losses[:: max(1, len(losses) // 40)]],
                    distill=None if teacher is None else dict(teacher="target", kd_alpha=kd_alpha,
                                                             loss="kd_alpha*CE + (1-kd_alpha)*KL(teacher||student), T=1"))


def n_params(model):
    return sum(p.numel() for n, p in model.named_parameters() if n != "lm_head.weight"
               or not model.config.tie_word_embeddings)


# --------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output dir (gets <name>.tar pieces + meta.tar)")
    ap.add_argument("--stage", default=None, help="dir for the unpacked model folders (default: <out>/../demo_stage or /tmp)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--max-bytes", type=int, default=300_000_000)
    ap.add_argument("--tokenizer-bytes", type=int, default=40_000_000,
                    help="bytes of training text (every k-th train file) used to fit the BPE")
    ap.add_argument("--target-seconds", type=float, default=210)
    ap.add_argument("--drafter-seconds", type=float, default=35)
    ap.add_argument("--drafter-kd-seconds", type=float, default=40)
    ap.add_argument("--hybrid-seconds", type=float, default=105)
    ap.add_argument("--deadline-seconds", type=float, default=430,
                    help="whole-run wall clock bound: phases shrink to fit")
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--hybrid-bs", type=int, default=64)
    ap.add_argument("--eval-windows", type=int, default=256)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke mode (<1 min)")
    ap.add_argument("--only", default="target,drafter,hybrid",
                    help="comma list of phases: target, drafter, drafter_kd, hybrid")
    args = ap.parse_args()

    import torch

    if args.tiny:
        args.max_bytes = min(args.max_bytes, 1_500_000)
        args.tokenizer_bytes = min(args.tokenizer_bytes, 1_500_000)
        args.bs, args.hybrid_bs, args.eval_windows = 2, 2, 4
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(args.stage) if args.stage else Path(os.environ.get("TMPDIR", "/tmp")) / "demo_stage"
    stage.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    random.seed(args.seed), np.random.seed(args.seed), torch.manual_seed(args.seed)
    import tokenizers
    import transformers

    env = dict(python=sys.version.split()[0], torch=torch.__version__,
               transformers=transformers.__version__, tokenizers=tokenizers.__version__,
               device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
               argv=sys.argv[1:])
    log("env", env)

    train_docs, heldout_docs, corpus = collect_corpus(args.max_bytes)
    log("corpus", {k: v for k, v in corpus.items() if k != "rule"})
    prompts = make_heldout_prompts(heldout_docs, seed=args.seed)
    (stage / "heldout_prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")

    # tokenizer on an evenly spaced subset of the train files
    tb = corpus["train_bytes"]
    k = max(1, round(tb / max(1, args.tokenizer_bytes)))
    tok_texts = [t for _, t in train_docs[::k]]
    tok = train_tokenizer(tok_texts)
    log(f"tokenizer trained on {len(tok_texts)} files ({sum(map(len, tok_texts))} chars)")
    try:
        sample = [t for _, t in heldout_docs[:200]]
        tok_check = check_tokenizer_loading(tok, sample, stage)
    except Exception:
        tok_check = dict(failed=traceback.format_exc()[-1000:])
    log("AutoTokenizer check:", tok_check)
    train_ids = encode_docs(tok, train_docs)
    heldout_ids = encode_docs(tok, heldout_docs)
    log(f"tokens: train {train_ids.size}, heldout {heldout_ids.size} "
        f"({corpus['train_bytes'] / train_ids.size:.2f} bytes/token)")
    tok_info = dict(type="byte-level BPE (tokenizers), NFC + Qwen3.5 pre-tokenizer regex",
                    vocab_size=VOCAB, special_tokens=[EOS], autotokenizer_check=tok_check,
                    fit_on_files=len(tok_texts), fit_on_chars=sum(map(len, tok_texts)),
                    train_tokens=int(train_ids.size), heldout_tokens=int(heldout_ids.size),
                    tokenizer_json_sha256=hashlib.sha256(tok.to_str().encode()).hexdigest())

    tr = Trainer(args, train_ids, heldout_ids, device)
    only = set(args.only.split(","))
    common = dict(seed=args.seed, corpus=corpus, tokenizer=tok_info, env=env)
    overall = dict(common, models={})
    packed = {}

    def remaining():
        return args.deadline_seconds - (time.time() - T0)

    def budget(want, reserve):
        return max(5.0, min(want, remaining() - reserve))

    tiny_steps = 3 if args.tiny else None
    specs = [
        # name, kind, arch, lr, batch, seconds, teacher, seed offset, snapshot fraction,
        # reserve (s) kept for the later phases
        ("target", "qwen3", TARGET_ARCH, 2e-3, args.bs, args.target_seconds, None, 0, None,
         args.drafter_seconds + args.drafter_kd_seconds * ("drafter_kd" in only)
         + args.hybrid_seconds + 40),
        # plain cross-entropy drafter (+ a snapshot at 30% of its steps as a weaker candidate)
        ("drafter", "qwen3", DRAFTER_ARCH, 3e-3, args.bs, args.drafter_seconds, None, 2, 0.3,
         args.drafter_kd_seconds * ("drafter_kd" in only) + args.hybrid_seconds + 30),
        # optional: drafter distilled from the target (CE + KL), not trained by default
        ("drafter_kd", "qwen3", DRAFTER_ARCH, 3e-3, args.bs, args.drafter_kd_seconds, "target", 1,
         None, args.hybrid_seconds + 20),
        ("hybrid", "qwen3_5", HYBRID_ARCH, 2e-3, args.hybrid_bs, args.hybrid_seconds, None, 3, None, 12),
    ]
    tar_groups = {}  # name -> tar name, to pack several small folders into one tar
    trained = {}

    def evaluate_and_export(name, kind, arch, model, params, res):
        hl, hn = tr.heldout_loss(model, args.eval_windows)
        res.update(heldout_loss=round(hl, 4), heldout_ppl=round(math.exp(hl), 3),
                   heldout_eval_tokens=hn)
        if name.startswith("drafter") and "target" in trained:
            res["teacher_forced_top1_agreement_with_target"] = round(
                tr.agreement(model, trained["target"], args.eval_windows), 4)
        tlog = dict(common, model=name, model_class=type(model).__name__,
                    mlx_model_type="qwen3" if kind == "qwen3" else "qwen3_5", arch=arch,
                    parameters=params, **res)
        log(f"{name}: " + json.dumps({k: v for k, v in res.items() if k != "loss_curve"}))
        export_model(name, kind, arch, model, tok, stage / name, tlog)
        overall["models"][name] = {k: v for k, v in tlog.items() if k not in common}

    def write_meta():
        (stage / "train_log.json").write_text(json.dumps(overall, indent=2) + "\n")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            for fn in ("heldout_prompts.json", "train_log.json"):
                tf.add(str(stage / fn), arcname=f"meta/{fn}")
        (out / "meta.tar").write_bytes(buf.getvalue())

    for name, kind, arch, lr, bs, secs, teacher, soff, snap, reserve in specs:
        if name not in only:
            continue
        if teacher is not None and teacher not in trained:
            log(f"{name}: teacher {teacher} missing, training without distillation")
            teacher = None
        try:
            sec = budget(secs, reserve)
            log(f"=== {name}: {kind} {arch} budget {sec:.0f}s")
            torch.manual_seed(args.seed + soff)
            model = build_model(kind, arch)
            params = n_params(model)
            log(f"{name}: {params / 1e6:.3f}M parameters")
            res = tr.fit(name, model, lr=lr, bs=bs, seconds=sec, seed=args.seed + soff,
                         teacher=trained.get(teacher) if teacher else None,
                         max_steps=tiny_steps, warmup=2 if args.tiny else 200,
                         snapshot_frac=snap)
            evaluate_and_export(name, kind, arch, model, params, res)
            trained[name] = model
            snapshot = tr.last_snapshot
            if snapshot is not None:
                early = build_model(kind, arch)
                early.load_state_dict(snapshot["state"])
                early.to(device)
                ename = name + "_early"
                eres = dict(res, steps=snapshot["step"],
                            tokens_seen=snapshot["step"] * bs * SEQ,
                            note=f"snapshot of {name} at step {snapshot['step']} "
                                 f"(mid-schedule, lr not annealed)")
                for key in ("final_train_loss", "loss_curve", "train_seconds"):
                    eres.pop(key, None)
                evaluate_and_export(ename, kind, arch, early, params, eres)
        except Exception:
            log(f"{name}: FAILED")
            traceback.print_exc()
            overall["models"][name] = dict(failed=traceback.format_exc()[-2000:])
        # pack after each phase so a timeout keeps what is done
        groups = {}
        for n in list(overall["models"]):
            if (stage / n / "config.json").exists():
                groups.setdefault(tar_groups.get(n, n), []).append(n)
        for g, names in groups.items():
            if name in names or name + "_early" in names:
                packed[g] = pack([stage / n for n in names], out, g)
        write_meta()
    save_tokenizer(tok, stage / "tokenizer")
    log("packed:", sorted(sum(packed.values(), [])) + ["meta.tar"])
    log("done")


if __name__ == "__main__":
    main()
