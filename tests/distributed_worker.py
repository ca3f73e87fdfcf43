"""One rank of tests/test_distributed.py, launched by `mlx.launch --backend ring -n 2`: the demo
target or hybrid sharded with mlx-lm's `sharded_load` (tensor or pipeline parallel); plain greedy
decoding, then tree speculation with prompt lookup, a DFlash chain and a DDTree, each compared
token for token with the sharded plain output. Prints one `RESULT {json}` line per rank."""
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
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
        drafted, draft = [], drafter.draft

        def recorded(*a, draft=draft, drafted=drafted):  # what this process drafted, round by round
            d = draft(*a)
            drafted.append(np.array(d.tokens).tolist() if hasattr(d, "tokens") else None)
            return d

        drafter.draft = recorded
        got = [t for t, _, _ in tree_generate_step(prompt, model, drafter, max_tokens=n, stats=stats)]
        out["identical"][name] = got == ref
        out.setdefault("drafted", {})[name] = hashlib.sha256(json.dumps(drafted).encode()).hexdigest()
        out["emitted_per_verify"][name] = stats.summary()["emitted_per_verify"]
    print("RESULT " + json.dumps(out), flush=True)


def bad_launch(mode, folder, dflash):
    """Processes that disagree, then one that leaves: every process must end with the same clear
    error (no hang), and a prompt cache passed in keeps what was delivered."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_treespec.launch import LaunchMismatch

    group = mx.distributed.init()
    rank = group.rank()
    model, tok = sharded_load(folder, **{f"{mode}_group": group})
    prompt = tok.encode(PROMPT)
    out = {"rank": rank, "errors": {}}

    def attempt(name, prompt, drafter):
        try:
            list(tree_generate_step(prompt, model, drafter, max_tokens=N))
            out["errors"][name] = None
        except LaunchMismatch as e:
            out["errors"][name] = str(e)

    # another model on one process: its embedding (a replicated part) differs in one row
    from mlx.utils import tree_flatten, tree_unflatten

    name, embed = next((k, v) for k, v in tree_flatten(model.parameters()) if k.endswith("embed_tokens.weight"))
    if rank == 1:
        model.update(tree_unflatten([(name, embed.at[7].add(1.0))]))
    attempt("model", prompt, DFlashDrafter(bind_dflash(dflash, model), topk=1, depth=7))
    model.update(tree_unflatten([(name, embed)]))
    model.__dict__.pop("_treespec_launch_digest_replicated", None)  # (the digest is kept on the model)
    attempt("prompt", prompt if rank == 0 else prompt[:-1], DFlashDrafter(bind_dflash(dflash, model), topk=1, depth=7))
    attempt("drafter", prompt, DFlashDrafter(bind_dflash(dflash, model), topk=1, depth=7 if rank == 0 else 5))
    attempt("agreed", prompt, DFlashDrafter(bind_dflash(dflash, model), topk=1, depth=7))
    ref = [t for t, _, _ in tree_generate_step(prompt, model, None, max_tokens=3 * N)]
    cache = make_prompt_cache(model)
    got = []
    try:
        for t, _, _ in tree_generate_step(prompt, model, LookupDrafter(8, 6), max_tokens=3 * N, prompt_cache=cache):
            got.append(t)
            if rank == 1 and len(got) == 3:  # leaves while the other process decodes
                print("RESULT " + json.dumps(out), flush=True)
                sys.exit(0)
    except RuntimeError as e:
        out["errors"]["peer_left"] = str(e)
    # every delivered token but the pending ones (a forward of them would wait on the process gone)
    out["delivered"], out["cache_offset"], out["prompt"] = len(got), cache[3].offset, len(prompt)
    out["delivered_are_plain"] = got == ref[: len(got)]
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "bad":
        bad_launch(*sys.argv[2:5])
    else:
        main(*sys.argv[1:5])
