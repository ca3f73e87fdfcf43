"""The command line: `python -m mlx_treespec.generate` (mlx-lm's flags plus draft flags).

argparse -> DraftSpec, the model lookup (shipped demo names, local folders, Hugging Face repo
ids), the gate and the exactness probe, then `generate`. Bad input is one line on stderr naming
the fix, exit code 2.
"""
import argparse
import os
import sys

import mlx.core as mx

from .loop import DEFAULT_QUANTIZED_KV_START, RoundStats
from .spec import DRAFTERS, DraftSpec
from .support import require_tree_support
from .tree import MAX_NODES

__all__ = ["main", "setup_arg_parser", "resolve_model_path", "DEMO_MODELS"]

# Shipped demo folders (mlx_treespec/demo/<folder>) by the names the CLI takes
DEMO_MODELS = {"demo": "target", "demo-target": "target", "demo-hybrid": "hybrid",
               "demo-drafter": "drafter", "demo-dflash": "dflash", "demo-hybrid-dflash": "hybrid_dflash",
               "demo-eagle3": "eagle3"}
# The drafter each demo target uses when none is named, by --drafter kind
DEMO_DRAFTERS = {("demo", "model"): "demo-drafter", ("demo-target", "model"): "demo-drafter",
                 ("demo-hybrid", "model"): "demo-drafter", ("demo", "dflash"): "demo-dflash",
                 ("demo-target", "dflash"): "demo-dflash", ("demo-hybrid", "dflash"): "demo-hybrid-dflash",
                 ("demo", "eagle3"): "demo-eagle3", ("demo-target", "eagle3"): "demo-eagle3"}


def resolve_model_path(name):
    """A shipped demo name, or a local mlx-lm folder, or a Hugging Face repo id."""
    if name in DEMO_MODELS:
        from .demo import __file__ as demo_init

        path = os.path.join(os.path.dirname(demo_init), DEMO_MODELS[name])
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"the shipped demo model {name!r} is missing at {path}: reinstall mlx-treespec")
        return path
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise FileNotFoundError(f"{name} has no config.json: pass an mlx-lm model folder")
        return expanded
    looks_like_repo = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if not looks_like_repo:
        raise FileNotFoundError(f"model folder {name} does not exist: pass an mlx-lm model folder, "
                                "a Hugging Face repo id, or 'demo' / 'demo-hybrid'")
    return name


def _load(path):
    """mlx-lm's load, with a failure to fetch a repo id said in one line."""
    from mlx_lm.utils import load

    try:
        return load(path)
    except (OSError, ValueError) as e:
        if os.path.isdir(path):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FileNotFoundError(f"cannot load {path!r} from the Hugging Face Hub ({first}): download it "
                                "first (huggingface-cli download) and pass the local folder") from None


def setup_arg_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_treespec.generate",
        description="Generate text with draft-tree speculative decoding (mlx-lm's flags plus tree flags).",
    )
    p.add_argument("--model", default="demo",
                   help="target: an mlx-lm folder or repo id, 'demo' (default) or 'demo-hybrid'")
    p.add_argument("--draft-model", default=None,
                   help="draft model, or a DFlash drafter folder with --drafter dflash (default: the "
                        "shipped demo drafter when --model is a demo)")
    p.add_argument("--drafter", choices=DRAFTERS, default=None,
                   help="what drafts: a draft model (default when one is given), prompt lookup, a "
                        "suffix index, a DFlash block drafter, or none (plain decoding)")
    p.add_argument("--prompt", "-p", default="def parse(", help="message to process ('-' reads stdin)")
    p.add_argument("--max-tokens", "-m", type=int, default=100, help="maximum number of tokens to generate")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling top-p")
    p.add_argument("--min-p", type=float, default=0.0, help="sampling min-p")
    p.add_argument("--top-k", type=int, default=0, help="sampling top-k")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the draw at each position depends on it)")
    p.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    p.add_argument("--ignore-chat-template", action="store_true", help="use the raw prompt")
    p.add_argument("--max-kv-size", type=int, default=None, help="maximum key-value cache size")
    p.add_argument("--kv-bits", type=int, default=None, choices=[2, 3, 4, 5, 6, 8],
                   help="bits for KV cache quantization (default: none)")
    p.add_argument("--kv-group-size", type=int, default=64, help="group size for KV cache quantization")
    p.add_argument("--quantized-kv-start", type=int, default=DEFAULT_QUANTIZED_KV_START,
                   help="when --kv-bits is set, quantize the cache from this many tokens on")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prompt tokens per prefill step")
    p.add_argument("--verbose", nargs="?", const=True, default=None,
                   type=lambda v: str(v).lower() in ("1", "t", "true", "yes"),
                   help="print round statistics too (--verbose F prints only the response)")
    t = p.add_argument_group("tree", "with a draft model and none of these: --tree-topk 3 "
                                     "--tree-lanes 1 --tree-depth 8")
    t.add_argument("--draft-block-size", type=int, default=None, help="draft a chain of this many tokens")
    t.add_argument("--tree-topk", type=int, default=None,
                   help="EAGLE-2: children per expanded node, and lanes per step (1, the default "
                        "when other tree flags are given: a chain)")
    t.add_argument("--tree-lanes", type=int, default=None,
                   help="nodes expanded per step, 1..--tree-topk (default: --tree-topk); 1 drafts a "
                        "chain of one-token steps with its top-K siblings as leaves")
    t.add_argument("--tree-depth", type=int, default=None, help="draft steps (tree depth)")
    t.add_argument("--tree-budget", type=int, default=None,
                   help=f"draft nodes verified per round, root excluded (at most {MAX_NODES - 1}); "
                        "with --drafter dflash the DDTree budget")
    t.add_argument("--draft-lookup", type=int, default=None,
                   help="also hang a prompt-lookup chain of up to this many tokens from the root "
                        "(continuations of the text's last n-gram seen earlier; nodes the draft "
                        "model does not spend a step on), 0..62")
    t.add_argument("--draft-lookup-trust", type=int, default=None,
                   help="with --draft-lookup: a round whose lookup matched this many tokens or "
                        "more (1..4) drafts with the lookup alone, skipping the draft model")
    t.add_argument("--allow-inexact", action="store_true",
                   help="speculate even where the exactness probe finds verify differs from decoding")
    return p


def _spec(args, has_draft_model):
    return DraftSpec.from_options(args.drafter, args.draft_block_size, args.tree_topk, args.tree_depth,
                                  args.tree_budget, args.tree_lanes, args.draft_lookup,
                                  args.draft_lookup_trust, has_draft_model=has_draft_model)


def _read_prompt(args):
    if args.prompt == "-":
        data = sys.stdin.buffer.read()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"the prompt on stdin is not UTF-8 (byte {e.start}): convert it, e.g. "
                             "iconv -t UTF-8") from None
    prompt = args.prompt
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the --prompt argument is not UTF-8: pass UTF-8 text, or the prompt on "
                         "stdin with --prompt -") from None
    return prompt.replace("\\n", "\n").replace("\\t", "\t")


def _run(args):
    from .generate import check_vocab, generate, make_drafter

    if args.max_tokens == 0:
        raise ValueError("--max-tokens must be non-zero (use -1 for no limit)")
    if args.max_tokens < -1:
        raise ValueError(f"--max-tokens must be positive, or -1 for no limit, got {args.max_tokens}")
    draft_name = args.draft_model
    kind = args.drafter or ("model" if draft_name is not None or args.model in DEMO_MODELS else "none")
    if draft_name is None:
        draft_name = args.model if kind == "mtp" else DEMO_DRAFTERS.get((args.model, kind))
    spec = _spec(args, has_draft_model=draft_name is not None)  # bad options fail before loading
    if spec.needs_draft_model and draft_name is None:
        raise ValueError(f"--drafter {spec.drafter} needs --draft-model")
    model_path = resolve_model_path(args.model)
    draft_path = resolve_model_path(draft_name) if draft_name and spec.needs_draft_model else None
    prompt = _read_prompt(args)
    model, tokenizer = _load(model_path)
    draft_model = None
    if draft_path is not None and spec.drafter == "model":
        draft_model = _load(draft_path)[0]
        check_vocab(model, draft_model)
    elif draft_path is not None:
        draft_model = draft_path  # a DFlash or head folder: bound to the target by make_drafter
    drafter = make_drafter(draft_model, target=model, **_options(args, spec))
    if drafter is not None:
        require_tree_support(model)
        _probe(args, model, drafter)

    if not args.ignore_chat_template and tokenizer.chat_template is not None:
        messages = ([{"role": "system", "content": args.system_prompt}] if args.system_prompt else [])
        messages.append({"role": "user", "content": prompt})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        tokens = tokenizer.encode(prompt, add_special_tokens=False)
    else:
        tokens = tokenizer.encode(prompt)
    if args.max_kv_size is not None and len(tokens) > args.max_kv_size:
        raise ValueError(f"the prompt has {len(tokens)} tokens but --max-kv-size is {args.max_kv_size}: "
                         "raise --max-kv-size or shorten the prompt")

    def progress(done, total):
        if total > args.prefill_step_size and args.verbose is not False:
            print(f"\rPrefill: {done}/{total} tokens", end="" if done < total else "\n", file=sys.stderr, flush=True)

    stats = RoundStats()
    text = generate(model, tokenizer, tokens, verbose=args.verbose is not False, drafter=drafter,
                    max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p, min_p=args.min_p,
                    top_k=args.top_k, seed=args.seed, max_kv_size=args.max_kv_size,
                    kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                    quantized_kv_start=args.quantized_kv_start,
                    prefill_step_size=args.prefill_step_size, prompt_progress_callback=progress,
                    stats=stats)
    if args.verbose is False:
        print(text)
    elif args.verbose:
        print(stats.format())


def _options(args, spec):
    """The spec's options as make_drafter takes them (the spec is already checked)."""
    return dict(drafter=spec.drafter, draft_block_size=args.draft_block_size, tree_topk=args.tree_topk,
                tree_depth=args.tree_depth, tree_budget=args.tree_budget, tree_lanes=args.tree_lanes,
                draft_lookup=args.draft_lookup, draft_lookup_trust=args.draft_lookup_trust)


def _probe(args, model, drafter):
    """Refuse speculation where a tree verify is not bitwise one-token decoding (GPU kernels).

    On MLX's CPU backend a verify is bitwise one-token decoding by construction (pinned by the
    test suite for every supported family), so the probe's forwards are spent on GPUs only.
    """
    if mx.default_device() == mx.cpu:
        return
    from .probe import check_speculation
    from .tree import chain_parents, depths_of

    parents = drafter.probe_parents()
    topologies = [chain_parents(int(depths_of(parents).max()) + 1), parents]
    check_speculation(model, topologies, allow_inexact=args.allow_inexact)


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    try:
        _run(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
