"""One rank of tests/test_distributed.py, launched by `mlx.launch --backend ring -n 2`: the demo
target or hybrid sharded with mlx-lm's `sharded_load` (tensor or pipeline parallel); plain greedy
decoding, then tree speculation with prompt lookup, a DFlash chain and a DDTree, each compared
token for token with the sharded plain output. Prints one `RESULT {json}` line per rank."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx_lm.utils import sharded_load  # noqa: E402

from mlx_treespec import RoundStats, tree_generate_step  # noqa: E402
from mlx_treespec.drafters.dflash import DFlashDrafter, bind_dflash  # noqa: E402
from mlx_treespec.drafters.lookup import LookupDrafter  # noqa: E402


PROMPT = "import os\nimport sys\n\n\ndef main("
N = 16


def drafters(dflash, model):
    from mlx_treespec import make_drafter

    return {"auto": lambda: make_drafter(dflash, drafter="dflash", target=model),  # the default
            "lookup": lambda: LookupDrafter(8, 6),
            "dflash": lambda: DFlashDrafter(bind_dflash(dflash, model), topk=1, depth=7),
            "ddtree": lambda: DFlashDrafter(bind_dflash(dflash, model), budget=12)}


def main(mode, folder, dflash, names, n=N):
    group = mx.distributed.init()
    model, tok = sharded_load(folder, **{f"{mode}_group": group})
    prompt = tok.encode(PROMPT)
    ref = [t for t, _, _ in tree_generate_step(prompt, model, None, max_tokens=n)]
    out = {"rank": group.rank(), "size": group.size(), "plain": ref, "identical": {}, "emitted_per_verify": {}}
    make_all = drafters(dflash, model)
    for name in names.split(","):
        make, stats = make_all[name], RoundStats()
        drafter = make()
        out.setdefault("kinds", {})[name] = type(drafter).__name__
        got = [t for t, _, _ in tree_generate_step(prompt, model, drafter, max_tokens=n, stats=stats)]
        out["identical"][name] = got == ref
        out["emitted_per_verify"][name] = stats.summary()["emitted_per_verify"]
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
