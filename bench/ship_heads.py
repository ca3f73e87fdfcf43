"""Ship the trained drafting heads into the package, small: quantized with MLX (on the CPU stream,
so the same input gives the same bytes on any machine).

    python bench/ship_heads.py --from HEADS_DIR [--to mlx_treespec/demo] [--bits 4] [--only dflash_target,...]

HEADS_DIR holds what bench/train_heads.py exported (float16, published layouts): dflash_target,
dflash_hybrid (DFlash folders), eagle3_target (SafeAILab EAGLE-3 folder), mtp_post / mtp_pre
(model-mtp.safetensors + mtp.json), drafter (the mlx-lm folder bench/train_demo_pair.py exported),
drafter_hybrid (the small qwen3_5 draft model bench/train_heads.py exported).
Written: demo/dflash, demo/hybrid_dflash, demo/eagle3, the chosen MTP head into demo/hybrid
(model-mtp.safetensors; mlx-lm's loader drops mtp.*), demo/drafter and demo/hybrid_drafter (8-bit,
mlx-lm's `quantization` config entry, so `mlx_lm.load` opens them).
A drafter's numerics never change an emitted token (the target verifies every one), so
quantizing costs acceptance only; bench/DEMO_PAIR.md records what it cost.
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DFLASH = {"dflash_target": "dflash", "dflash_hybrid": "hybrid_dflash"}


def shipped_weights(model, config, bits, group_size):
    """The model's weights, quantized (and the config's `quantization` entry set) where `bits`."""
    if bits:
        nn.quantize(model, group_size=group_size, bits=bits)
        mx.eval(model.parameters())
        config["quantization"] = dict(group_size=group_size, bits=bits)
    return dict(tree_flatten(model.parameters()))


def ship_dflash(src, dst, bits, group_size):
    from mlx_treespec.drafters.dflash import load_dflash

    model = load_dflash(src)
    config = json.loads((Path(src) / "config.json").read_text())
    return _write(dst, shipped_weights(model, config, bits, group_size), config, src)


def ship_eagle3(src, dst, bits, group_size):
    """The SafeAILab layout again (fc, midlayer.*, norm, lm_head, d2t, t2d), quantized. An lm_head
    that is the target's own (trained frozen, over the whole vocab) is not shipped: the loader
    binds the target's."""
    from mlx_lm import load

    from mlx_treespec.drafters import target_io
    from mlx_treespec.drafters.eagle3 import load_eagle3

    target = load(str(ROOT / "mlx_treespec" / "demo" / "target"))[0]
    raw = mx.load(str(Path(src) / "model.safetensors"))
    _, _, lm = target_io(target)
    W, tmp = raw.get("lm_head.weight"), None
    if W is not None and W.shape[0] == target.args.vocab_size:
        mine = lm(mx.eye(W.shape[1], dtype=mx.float32)).T.astype(W.dtype)
        if mx.array_equal(W, mine).item():
            src = tmp = _without(src, "lm_head.weight")
            print("eagle3_target: its lm_head is the target's: not shipped")
    try:
        head = load_eagle3(src, target)
        config = json.loads((Path(src) / "config.json").read_text())
        shipped_weights(head, config, bits, group_size)
        weights = head.raw_weights()  # (its checkpoint names: joined layers keep theirs)
        weights.update({k: raw[k] for k in ("d2t", "t2d")})
        return _write(dst, weights, config, src)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp)


def _without(src, name):
    """A copy of the head folder `src` without tensor `name` (in a temporary folder)."""
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="ship_"))
    for f in Path(src).iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    mx.save_safetensors(str(out / "model.safetensors"),
                        {k: v for k, v in mx.load(str(Path(src) / "model.safetensors")).items() if k != name})
    return out


def ship_mtp(src, hybrid_folder, bits, group_size):
    """The MTP head into the hybrid folder itself: model-mtp.safetensors in the raw layout
    (mtp.* names, zero-centred norms; quantized leaves carry their .scales/.biases, so the
    folder's config gets no `quantization` entry: that would quantize the hybrid), and the
    config keys that say it is there."""
    from mlx_lm import load

    from mlx_treespec.drafters.mtp import load_mtp

    hybrid = load(str(hybrid_folder))[0]
    head = load_mtp(src, hybrid)
    if bits:
        nn.quantize(head, group_size=group_size, bits=bits)
        mx.eval(head.parameters())
    weights = head.raw_weights()
    mx.save_safetensors(str(Path(hybrid_folder) / "model-mtp.safetensors"), weights, metadata={"format": "mlx"})
    cfg_file = Path(hybrid_folder) / "config.json"
    config = json.loads(cfg_file.read_text())
    mtp = json.loads((Path(src) / "mtp.json").read_text()) if (Path(src) / "mtp.json").exists() else {}
    config.update(mtp_num_hidden_layers=1, mtp_hidden=mtp.get("mtp_hidden", head.hidden_kind))
    cfg_file.write_text(json.dumps(config, indent=2) + "\n")
    log = next((Path(src) / n for n in ("mtp_train_log.json", "train_log.json") if (Path(src) / n).exists()), None)
    if log is not None:
        shutil.copy(log, Path(hybrid_folder) / "mtp_train_log.json")
    return (Path(hybrid_folder) / "model-mtp.safetensors").stat().st_size


DRAFTER_BITS = 8  # 8 bits keep the drafter's greedy tokens (tests/test_demo_pair.py); 4 do not


def ship_drafter(src, dst, group_size):
    """The draft model, an mlx-lm folder, quantized in place of its float16 weights."""
    from mlx_lm import load
    from mlx_lm.utils import quantize_model

    model = load(str(src))[0]
    config = json.loads((Path(src) / "config.json").read_text())
    model, config = quantize_model(model, config, group_size=group_size, bits=DRAFTER_BITS)
    config.pop("quantization_config", None)  # the same entry twice; mlx-lm reads `quantization`
    mx.eval(model.parameters())
    size = _write(dst, dict(tree_flatten(model.parameters())), config, src)
    for f in Path(src).glob("tokenizer*"):
        if not (dst / f.name).exists():
            shutil.copy(f, dst / f.name)
    return size


def digest(folder):
    import hashlib

    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest()[:16] for f in sorted(Path(folder).glob("*.safetensors"))}


def _write(dst, weights, config, src):
    dst.mkdir(parents=True, exist_ok=True)
    for old in dst.glob("*.safetensors"):
        old.unlink()
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (Path(src) / "train_log.json").exists():
        shutil.copy(Path(src) / "train_log.json", dst / "train_log.json")
    return sum(f.stat().st_size for f in dst.iterdir())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="src", required=True)
    p.add_argument("--to", default=str(ROOT / "mlx_treespec" / "demo"))
    p.add_argument("--bits", type=int, default=4, help="0: keep float16")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--only", default="")
    p.add_argument("--mtp", default="mtp_pre", help="which trained MTP variant goes into the hybrid folder")
    args = p.parse_args(argv)
    only = set(filter(None, args.only.split(",")))
    src, to = Path(args.src), Path(args.to)
    with mx.stream(mx.cpu):
        for name, folder in DFLASH.items():
            if (src / name).is_dir() and (not only or name in only):
                size = ship_dflash(src / name, to / folder, args.bits, args.group_size)
                print(f"{name} -> {to / folder}: {size / 1e6:.2f} MB {digest(to / folder)}")
        if (src / "eagle3_target").is_dir() and (not only or "eagle3_target" in only):
            size = ship_eagle3(src / "eagle3_target", to / "eagle3", args.bits, args.group_size)
            print(f"eagle3_target -> {to / 'eagle3'}: {size / 1e6:.2f} MB {digest(to / 'eagle3')}")
        if (src / args.mtp).is_dir() and (not only or args.mtp in only):
            size = ship_mtp(src / args.mtp, to / "hybrid", args.bits, args.group_size)
            print(f"{args.mtp} -> {to / 'hybrid'}/model-mtp.safetensors: {size / 1e6:.2f} MB")
        for name, folder in (("drafter", "drafter"), ("drafter_hybrid", "hybrid_drafter")):
            if (src / name).is_dir() and (not only or name in only) and src / name != to / folder:
                size = ship_drafter(src / name, to / folder, args.group_size)
                print(f"{name} -> {to / folder}: {size / 1e6:.2f} MB {digest(to / folder)}")


if __name__ == "__main__":
    main()
