"""The command line: `python -m mlx_treespec.generate` (mlx-lm's flags plus draft flags).

argparse -> DraftSpec, the model lookup (shipped demo names, local folders, Hugging Face repo
ids), the gate and the exactness probe, then `generate`. Bad input is one line on stderr naming
the fix, exit code 2.
"""
import argparse
import json
import os
import sys

import numpy as np
import mlx.core as mx

from .loop import DEFAULT_QUANTIZED_KV_START, RoundStats, vocab_size
from .spec import DEFAULT_TREE, DRAFTERS, SAMPLED_TREES, DraftSpec
from .support import require_tree_support
from .tree import MAX_NODES

__all__ = ["main", "setup_arg_parser", "resolve_model_path", "DEMO_MODELS"]

# Shipped demo folders (mlx_treespec/demo/<folder>) by the names the CLI takes
DEMO_MODELS = {"demo": "target", "demo-target": "target", "demo-hybrid": "hybrid",
               "demo-drafter": "drafter", "demo-hybrid-drafter": "hybrid_drafter", "demo-dflash": "dflash",
               "demo-hybrid-dflash": "hybrid_dflash", "demo-eagle3": "eagle3"}
# The drafter each demo target uses when none is named, by --drafter kind (the hybrid's draft
# model is a small hybrid: it agrees with its target more than the attention drafter does)
DEMO_DRAFTERS = {("demo", "model"): "demo-drafter", ("demo-target", "model"): "demo-drafter",
                 ("demo-hybrid", "model"): "demo-hybrid-drafter", ("demo", "dflash"): "demo-dflash",
                 ("demo-target", "dflash"): "demo-dflash", ("demo-hybrid", "dflash"): "demo-hybrid-dflash",
                 ("demo", "eagle3"): "demo-eagle3", ("demo-target", "eagle3"): "demo-eagle3"}


def resolve_model_path(name, flag="--model"):
    """A shipped demo name, or a local mlx-lm folder, or a Hugging Face repo id (`flag`: the
    option that named it, for the error)."""
    if name in DEMO_MODELS:
        from .demo import demo_path

        return demo_path(DEMO_MODELS[name])
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise FileNotFoundError(f"{flag} {name} has no config.json: pass an mlx-lm model folder")
        return expanded
    looks_like_repo = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if not looks_like_repo:
        demos = "'demo' / 'demo-hybrid'" if flag == "--model" else \
            " / ".join(f"'{k}'" for k in DEMO_MODELS if k not in ("demo", "demo-target", "demo-hybrid"))
        raise FileNotFoundError(f"{flag} {name}: no such folder: pass an mlx-lm model folder, "
                                f"a Hugging Face repo id, or {demos}")
    return name


def _load(path, adapter_path=None, tokenizer_config=None, shard=None, trust_remote_code=False,
          model_config=None):
    """mlx-lm's load (`sharded_load` over the launch's group with `shard`), with a failure to
    fetch a repo id said in one line."""
    from mlx_lm.utils import load

    if shard is not None:
        return _sharded(path, adapter_path, tokenizer_config, shard, trust_remote_code)

    if adapter_path is not None and not os.path.isfile(os.path.join(os.path.expanduser(adapter_path),
                                                                   "adapter_config.json")):
        raise FileNotFoundError(f"--adapter-path {adapter_path} holds no adapter_config.json: pass the folder "
                                "mlx_lm.lora wrote (adapters.safetensors and adapter_config.json)")
    try:
        return load(path, adapter_path=adapter_path, tokenizer_config=tokenizer_config or {},
                    model_config=model_config or {}, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if os.path.isdir(path):  # mlx-lm's own errors run to a line per weight, or are a bare KeyError
            if "parameters not in model" in first:
                kind = _folder_kind(path)
                what = {"dflash": "a DFlash drafter", "eagle3": "an EAGLE-3 head"}.get(kind)
                fix = f"pass it as --drafter {kind} --draft-model {path}" if kind else \
                    "pass an mlx-lm model folder (mlx_lm.convert writes one)"
                raise ValueError(f"{path} is {what or 'not an mlx-lm model'} ({first.rstrip(': ')} of "
                                 f"{_config(path).get('model_type', '?')}): {fix}") from None
            if isinstance(e, KeyError):
                raise ValueError(f"{path}/config.json lacks {first}: pass an mlx-lm model folder "
                                 "(mlx_lm.convert writes one)") from None
            if isinstance(e, RuntimeError):
                raise ValueError(f"{path}: {first}: download or convert the model again") from None
            raise
        if isinstance(e, (KeyError, RuntimeError)):
            raise
        raise FileNotFoundError(f"cannot load {path!r} from the Hugging Face Hub ({first}): download it "
                                "first (huggingface-cli download) and pass the local folder") from None


def _fetch(repo, kind):
    """A Hugging Face repo id's local folder (mlx-lm's download: its cache, else the Hub), for the
    loaders of a head or a DFlash drafter, which read folders (an MTP head: the target's own)."""
    from mlx_lm.utils import _download

    try:
        return str(_download(repo))
    except Exception as e:  # (the Hub's errors are many kinds, none one line)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FileNotFoundError(f"cannot fetch {repo!r} for --drafter {kind} from the Hugging Face Hub ({first}): "
                                "download it first (huggingface-cli download) and pass the local folder") from None


def _config(path):
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _folder_kind(path):
    """'dflash' or 'eagle3' where a folder holds that drafter (by its config), else None."""
    config = _config(path)
    if "dflash_config" in config or any("DFlash" in a for a in config.get("architectures", ())):
        return "dflash"
    if any("eagle" in str(a).lower() for a in config.get("architectures", ())) or "eagle_config" in config \
            or "draft_vocab_size" in config:
        return "eagle3"
    return None


def _sharded(path, adapter_path, tokenizer_config, shard, trust_remote_code=False):
    """The target split over the processes of an `mlx.launch` (mlx-lm's `sharded_load`)."""
    from mlx_lm.utils import sharded_load

    group = mx.distributed.init()
    if group.size() < 2:
        raise ValueError(f"--shard {shard} splits the target over the processes of a launch: run it under "
                         "mlx.launch (e.g. mlx.launch --hostfile hosts.json -n 2 python -m mlx_treespec.generate ...)")
    if adapter_path is not None:
        raise ValueError("--adapter-path cannot be combined with --shard (mlx-lm's sharded_load takes no "
                         "adapters): fuse them first (mlx_lm.fuse)")
    try:
        return sharded_load(path, **{f"{shard}_group": group}, tokenizer_config=tokenizer_config or {},
                            trust_remote_code=trust_remote_code)
    except FileNotFoundError as e:
        if "index.json" in str(e):
            raise ValueError(f"--shard pipeline reads {path}/model.safetensors.index.json (which layer is in "
                             "which file): pass a folder that has one, or --shard tensor") from None
        raise


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as every other bad input (argparse prints its usage too)
        self.exit(2, f"error: {message} (see --help)\n")


def _switch(v):
    if str(v).lower() in ("1", "t", "true", "yes"):
        return True
    if str(v).lower() in ("0", "f", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{v!r} is not T or F")


def _shape_flags(shape):
    return " ".join(f"--tree-{k} {shape[k]}" for k in ("topk", "lanes", "depth"))


def setup_arg_parser():
    p = _Parser(
        prog="python -m mlx_treespec.generate",
        description="Generate text with draft-tree speculative decoding (mlx-lm's flags plus tree flags).",
    )
    p.add_argument("--model", default=None,
                   help="target: an mlx-lm folder or repo id, 'demo' (the default without a "
                        "--prompt-cache-file) or 'demo-hybrid'")
    p.add_argument("--adapter-path", default=None, help="LoRA adapters to apply to the target (mlx_lm.lora's output)")
    p.add_argument("--shard", choices=("tensor", "pipeline"), default=None,
                   help="under mlx.launch: split the target over the launch's processes (mlx-lm's "
                        "sharded_load: tensor or pipeline parallel); drafters run on every process, rank 0 prints")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let the model and its tokenizer run the repo's own code")
    p.add_argument("--quantize-activations", "-qa", action="store_true",
                   help="quantize activations as the layers' weights (mlx-lm's flag); the exactness "
                        "probe then runs before speculating, on any device")
    p.add_argument("--image", nargs="+", default=None,
                   help="(mlx-lm's flag for vision models: refused, this library decodes text)")
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
    p.add_argument("--min-tokens-to-keep", type=int, default=1, help="minimum tokens to keep for min-p sampling")
    p.add_argument("--xtc-probability", type=float, default=0.0,
                   help="XTC: the chance (per position, keyed by seed and position) of excluding the top choices")
    p.add_argument("--xtc-threshold", type=float, default=0.1,
                   help="XTC: tokens above this probability are excluded, but the least likely of them")
    p.add_argument("--extra-eos-token", type=str, nargs="+", default=[],
                   help="more tokens that end generation (as mlx-lm's flag)")
    p.add_argument("--chat-template-config", default=None,
                   help="more arguments for apply_chat_template, as a JSON object")
    p.add_argument("--prompt-cache-file", default=None,
                   help="a KV cache saved by mlx_lm.cache_prompt (or --save-prompt-cache): the prompt "
                        "continues it; drafters see only the new prompt")
    p.add_argument("--save-prompt-cache", default=None,
                   help="after generating, save the target's cache (prompt and response) to this "
                        ".safetensors file, for --prompt-cache-file or mlx-lm")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: a fresh one each run, as mlx-lm). The draw at each "
                        "position is keyed by the seed and the position, so sampled output is the "
                        "same for every drafter and tree shape (and plain decoding) under one seed; "
                        "it is not mlx-lm's sampled output for the same seed")
    p.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    p.add_argument("--prefill-response", default=None,
                   help="start the assistant's response with this text (with the chat template)")
    p.add_argument("--ignore-chat-template", action="store_true", help="use the raw prompt")
    p.add_argument("--use-default-chat-template", action="store_true",
                   help="where the tokenizer has no chat template, use its default one (as mlx-lm did)")
    p.add_argument("--max-kv-size", type=int, default=None, help="maximum key-value cache size")
    p.add_argument("--kv-bits", type=int, default=None, choices=[2, 3, 4, 5, 6, 8],
                   help="bits for KV cache quantization (default: none)")
    p.add_argument("--kv-group-size", type=int, default=64, help="group size for KV cache quantization")
    p.add_argument("--quantized-kv-start", type=int, default=DEFAULT_QUANTIZED_KV_START,
                   help="when --kv-bits is set, quantize the cache from this many tokens on")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prompt tokens per prefill step")
    p.add_argument("--verbose", nargs="?", const=True, default=None,
                   type=_switch,
                   help="print round statistics too (--verbose F prints only the response)")
    t = p.add_argument_group("tree", "with a draft model and none of these: {} (adaptive); a head's (mtp, "
                                     "eagle3), sampled: {}".format(_shape_flags(DEFAULT_TREE), "; ".join(
                                         "from --temp {:g}, {}".format(temp, _shape_flags(shape))
                                         for temp, shape in SAMPLED_TREES)))
    t.add_argument("--draft-block-size", dest="draft_block_size", type=int, default=None,
                   help="draft a chain of this many tokens")
    t.add_argument("--num-draft-tokens", type=int, default=None,
                   help="mlx-lm's name for --draft-block-size (ignored, as there, where nothing drafts)")
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
                        f"model does not spend a step on), 0..{MAX_NODES - 2}")
    t.add_argument("--draft-lookup-trust", type=int, default=None,
                   help="with --draft-lookup: a round whose lookup matched this many tokens or "
                        "more (1..4) drafts with the lookup alone, skipping the draft model")
    t.add_argument("--draft-vocab", type=int, default=None,
                   help="with --drafter mtp or eagle3: draft over N token ids only, the first N of the "
                        "head folder's token_ranks.json (python -m mlx_treespec.vocab), else ids 0..N-1; "
                        "the head's step then reads N rows of the lm_head, not the whole vocabulary")
    t.add_argument("--allow-inexact", action="store_true",
                   help="speculate even where the exactness probe finds verify differs from decoding")
    return p


def _draft_options(args):
    """The draft shape flags, as DraftSpec.from_options and make_drafter take them."""
    block = args.draft_block_size
    if args.num_draft_tokens is not None and (args.draft_model is not None or args.drafter not in (None, "none")):
        if block is not None and block != args.num_draft_tokens:
            raise ValueError("give --num-draft-tokens or --draft-block-size (the same option), not both")
        block = args.num_draft_tokens
    return dict(draft_block_size=block, tree_topk=args.tree_topk, tree_depth=args.tree_depth,
                tree_budget=args.tree_budget, tree_lanes=args.tree_lanes,
                draft_lookup=args.draft_lookup,
                draft_lookup_trust=args.draft_lookup_trust, draft_vocab=args.draft_vocab)


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
    from .generate import generate, make_drafter

    if args.max_tokens == 0:
        raise ValueError("--max-tokens must be non-zero (use -1 for no limit)")
    if args.max_tokens < -1:
        raise ValueError(f"--max-tokens must be positive, or -1 for no limit, got {args.max_tokens}")
    if args.min_tokens_to_keep < 1:
        raise ValueError(f"--min-tokens-to-keep must be >= 1, got {args.min_tokens_to_keep}")
    template_kwargs = _template_kwargs(args.chat_template_config)
    if args.save_prompt_cache is not None:  # before anything is computed, not after the response
        target = os.path.abspath(os.path.expanduser(args.save_prompt_cache))
        if not target.endswith(".safetensors") or not os.path.isdir(os.path.dirname(target)):
            raise ValueError(f"--save-prompt-cache {args.save_prompt_cache}: pass a .safetensors file in an "
                             "existing folder")
    if args.prefill_response is not None and args.ignore_chat_template:
        raise ValueError("--prefill-response starts the assistant's turn of a chat template, and "
                         "--ignore-chat-template drops it: drop one of them (or end --prompt with it)")
    if args.image:
        raise ValueError("--image feeds a vision model, and this library decodes text models (mlx-lm's): "
                         "drop --image, or use mlx-vlm")
    if args.save_prompt_cache is not None and args.shard is not None:
        raise ValueError("--save-prompt-cache with --shard would save one process's slice of the cache: "
                         "drop one of them")
    if args.quantize_activations and args.shard is not None:
        raise ValueError("--quantize-activations with --shard: mlx-lm's sharded_load takes no model "
                         "config: drop one of them")
    if args.prompt_cache_file is not None and args.max_kv_size is not None:
        raise ValueError("--max-kv-size sizes a new cache; a --prompt-cache-file keeps its own: drop one of them")
    prompt_cache, metadata = _read_prompt_cache(args)
    if args.model is None:  # (a demo's name where the cache was made from one: its drafter is the default)
        args.model = metadata.get("treespec_model") or metadata.get("model", "demo")
    elif metadata:
        try:
            made_with = resolve_model_path(metadata["model"])
        except FileNotFoundError:
            raise FileNotFoundError(f"--prompt-cache-file {args.prompt_cache_file} was made with {metadata['model']}, "
                                    "which is not there any more: make the cache again") from None
        if os.path.abspath(os.path.expanduser(resolve_model_path(args.model))) != \
                os.path.abspath(os.path.expanduser(made_with)):
            raise ValueError(f"--model {args.model} is not the model the prompt cache was made with "
                             f"({metadata['model']}): drop --model or pass that one")
    draft_name = args.draft_model
    # With a demo target and nothing named: its DFlash drafter (adaptive unless a shape is
    # given), or its draft model where the flags are a draft model's tree shape
    model_shape = any(v is not None for v in (args.tree_topk, args.tree_depth, args.tree_lanes)) or args.draft_lookup
    demo_kind = "model" if model_shape else "dflash"
    kind = args.drafter or ("model" if draft_name is not None else
                            demo_kind if (args.model, demo_kind) in DEMO_DRAFTERS else "none")
    if draft_name is None:
        draft_name = args.model if kind == "mtp" else DEMO_DRAFTERS.get((args.model, kind))
    args.drafter = args.drafter or (kind if kind == "dflash" else None)
    spec = DraftSpec.from_options(args.drafter, has_draft_model=draft_name is not None,
                                  **_draft_options(args))  # bad options fail before loading
    spec.check_draft_model(draft_name)
    if args.draft_model is not None and not spec.needs_draft_model:
        raise ValueError(f"--drafter {spec.drafter} drafts without a model: drop --draft-model")
    model_path = resolve_model_path(args.model)
    draft_path = resolve_model_path(draft_name, "--draft-model") if draft_name and spec.needs_draft_model else None
    prompt = _read_prompt(args)
    tokenizer_config = json.loads(metadata.get("tokenizer_config", "{}"))
    tokenizer_config["trust_remote_code"] = args.trust_remote_code
    model, tokenizer = _load(model_path, args.adapter_path, tokenizer_config, shard=args.shard,
                             trust_remote_code=args.trust_remote_code,
                             model_config={"quantize_activations": True} if args.quantize_activations else None)
    if args.shard is not None:
        if mx.distributed.init().rank() != 0:  # rank 0 prints; every rank computes the same tokens
            sys.stdout = open(os.devnull, "w")
            args.verbose = False
    vocab = vocab_size(model) or len(tokenizer.get_vocab())
    for token in args.extra_eos_token:
        if token.lstrip("-").isdigit() and not 0 <= int(token) < vocab:
            raise ValueError(f"--extra-eos-token {token} is not a token id of this model (0..{vocab - 1})")
        if not token.lstrip("-").isdigit() and token not in tokenizer.get_vocab():
            raise ValueError(f"--extra-eos-token {token!r} is not a token of this tokenizer: pass a token "
                             "string it knows or a token id")
        tokenizer.add_eos_token(token)
    draft_model = None
    if draft_path is not None and spec.drafter == "model":
        draft_model, draft_tokenizer = _load(draft_path, trust_remote_code=args.trust_remote_code)
        if draft_tokenizer.vocab_size != tokenizer.vocab_size:  # mlx-lm's check (make_drafter checks the rows)
            raise ValueError(f"--draft-model {args.draft_model}'s tokenizer ({draft_tokenizer.vocab_size} ids) is not "
                             f"the target's ({tokenizer.vocab_size}): use a draft model with the target's tokenizer")
    elif draft_path is not None:  # a DFlash or head folder: bound to the target by make_drafter
        draft_model = draft_path if os.path.isdir(draft_path) else _fetch(draft_path, spec.drafter)
    drafter = make_drafter(draft_model, target=model, drafter=spec.drafter, **_draft_options(args))
    if args.shard is not None:  # the processes agree before the probe's collectives (launch.py)
        from .launch import agree, drafter_digest, model_digest

        agree(model=model_digest(model), drafter=drafter_digest(drafter, model))
    if drafter is not None:
        require_tree_support(model)
        _probe(args, model, drafter)
    elif args.drafter is None and args.verbose is not False:
        print("note: no --draft-model or --drafter given: decoding without speculation (--drafter "
              "lookup or suffix drafts without a model)", file=sys.stderr)

    has_template = getattr(tokenizer, "has_chat_template", tokenizer.chat_template is not None)
    if args.use_default_chat_template and not has_template:
        default = getattr(tokenizer, "default_chat_template", None)
        if default is None:
            raise ValueError("--use-default-chat-template: this tokenizer has neither a chat template nor a "
                             "default one: drop the flag (the prompt is used raw) or pass a model that has one")
        tokenizer.chat_template = default
        has_template = True
    if args.prefill_response is not None and not has_template:
        raise ValueError("--prefill-response starts the assistant's turn of a chat template, and this "
                         "tokenizer has none: drop --prefill-response (or end --prompt with it)")
    if not args.ignore_chat_template and has_template:
        # (mlx-lm's rules: an empty system prompt is one; a prefilled response continues the
        # assistant's message)
        messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
        messages.append({"role": "user", "content": prompt})
        prefill = args.prefill_response is not None
        if prefill:
            messages.append({"role": "assistant", "content": args.prefill_response})
        turn = dict(tokenize=False, continue_final_message=prefill, add_generation_prompt=not prefill)
        prompt = tokenizer.apply_chat_template(messages, **turn, **template_kwargs)
        if prompt_cache is not None:  # the cache holds the conversation so far: keep the new part
            # (from the user's message: with a prefilled response it is not the last one)
            messages[-2 if prefill else -1]["content"] = "<query>"
            probe = tokenizer.apply_chat_template(messages, **turn, **template_kwargs)
            prompt = prompt[probe.index("<query>"):]
        tokens = tokenizer.encode(prompt, add_special_tokens=False)
    else:
        tokens = tokenizer.encode(prompt)
    if prompt_cache is None and args.save_prompt_cache:
        from mlx_lm.models.cache import make_prompt_cache

        prompt_cache = make_prompt_cache(model, max_kv_size=args.max_kv_size)
    def progress(done, total):
        if total > args.prefill_step_size and args.verbose is not False:
            print(f"\rPrefill: {done}/{total} tokens", end="" if done < total else "\n", file=sys.stderr, flush=True)

    stats = RoundStats()
    text = generate(model, tokenizer, tokens, verbose=args.verbose is not False, drafter=drafter,
                    max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p, min_p=args.min_p,
                    top_k=args.top_k, min_tokens_to_keep=args.min_tokens_to_keep, seed=args.seed,
                    xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold,
                    xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
                    prompt_cache=prompt_cache, max_kv_size=None if prompt_cache is not None else args.max_kv_size,
                    kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                    quantized_kv_start=args.quantized_kv_start,
                    prefill_step_size=args.prefill_step_size, prompt_progress_callback=progress,
                    stats=stats)
    if args.save_prompt_cache:
        from mlx_lm.models.cache import save_prompt_cache

        # (the folder, not a demo name: mlx-lm reads the file too; the name as well, for this CLI)
        save_prompt_cache(args.save_prompt_cache, prompt_cache,
                          dict(model=model_path, treespec_model=args.model, tokenizer_config=json.dumps(tokenizer_config)))
    if args.verbose is False:
        print(text)
    elif args.verbose:
        print(stats.format())


def _template_kwargs(text):
    if text is None:
        return {}
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat-template-config is not JSON ({e.msg}): pass an object, e.g. "
                         "'{\"enable_thinking\": false}'") from None
    if not isinstance(kwargs, dict):
        raise ValueError("--chat-template-config must be a JSON object of apply_chat_template arguments")
    return kwargs


def _read_prompt_cache(args):
    """(cache, metadata) from --prompt-cache-file, checked against --kv-bits; (None, {}) without."""
    if args.prompt_cache_file is None:
        return None, {}
    from mlx_lm.models.cache import QuantizedKVCache, load_prompt_cache

    if not os.path.isfile(args.prompt_cache_file):
        raise FileNotFoundError(f"--prompt-cache-file {args.prompt_cache_file} does not exist: make one "
                                "with mlx_lm.cache_prompt or --save-prompt-cache")
    try:
        cache, metadata = load_prompt_cache(args.prompt_cache_file, return_metadata=True)
    except (ValueError, RuntimeError, KeyError, TypeError) as e:
        raise ValueError(f"--prompt-cache-file {args.prompt_cache_file} is not a prompt cache ({e}): make one "
                         "with mlx_lm.cache_prompt or --save-prompt-cache") from None
    quantized = next((c for c in cache if isinstance(c, QuantizedKVCache)), None)  # (a hybrid's first is recurrent)
    if quantized is not None and (
            (args.kv_bits is not None and args.kv_bits != quantized.bits) or args.kv_group_size != quantized.group_size):
        raise ValueError("--kv-bits / --kv-group-size differ from the quantized cache in --prompt-cache-file: "
                         "drop them or pass the cache's")
    if "model" not in metadata:
        raise ValueError(f"{args.prompt_cache_file} names no model in its metadata: make it with "
                         "mlx_lm.cache_prompt or --save-prompt-cache")
    return cache, metadata


def _probe(args, model, drafter):
    """Refuse speculation where a tree verify is not bitwise one-token decoding (GPU kernels).

    On MLX's CPU backend a verify is bitwise one-token decoding by construction (pinned by the
    test suite for every supported family), so the probe's forwards are spent on GPUs only.
    """
    if mx.default_device() == mx.cpu and not args.quantize_activations:  # (quantized activations
        return  # may couple a verify's rows: probed on any device)
    from .probe import check_speculation
    from .sampling import Draw, make_node_sampler
    from .tree import chain_parents, depths_of

    parents = drafter.probe_parents()
    topologies = [chain_parents(int(depths_of(parents).max()) + 1), parents]
    host = getattr(drafter, "host", None)  # an adaptive drafter's lookup: its trees and chains too
    if host is not None and getattr(drafter, "primary", None) is not None:
        hosted = host.probe_parents()
        deepest = chain_parents(int(depths_of(hosted).max()) + 1)
        topologies += [t for t in (hosted, deepest) if not any(np.array_equal(t, u) for u in topologies)]
    # sampled: the probe compares draws (a near-tie flips a draw more often than an argmax),
    # under a fixed seed (any seed's draws flip as often; the run's own is drawn later)
    sampler = make_node_sampler(args.temp, args.top_p, args.min_p, args.top_k, args.min_tokens_to_keep, 0,
                                args.xtc_probability, args.xtc_threshold)
    if not sampler.greedy and hasattr(drafter, "draw"):  # the layout a sampled generation drafts
        drafter.draw = Draw(sampler)  # (a head's default: spec.SAMPLED_TREES; the loop sets its own)
        sampled = drafter.probe_parents()
        if not np.array_equal(sampled, parents):
            topologies.append(sampled)
    check_speculation(model, topologies, allow_inexact=args.allow_inexact, sampler=sampler)


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    try:
        _run(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as e:
        if args.shard is None:
            raise
        # under a launch most often a collective that failed: another process stopped or cannot be reached
        print(f"error: {e} (under mlx.launch this most often means another process of the launch stopped "
              "or lost its connection: read every process's output; mlx.launch exits 0 whatever its "
              "processes do)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
