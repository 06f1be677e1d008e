"""Arguments several subcommands share, each flag declared here once (help wording a parameter where commands
differ), and the glue from parsed arguments to a loaded target and proposer.

Nothing here imports torch at import time: `specheads --help` builds no subcommand's arguments, and a subcommand
that lists no methods or formats (loadtest) builds its own without torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specheads.questions import QUESTION_SETS

TARGET_HELP = "'default' (SmolLM2-135M-Instruct), an HF model id or a local folder"
QUESTIONS_HELP = ("a Spec-Bench/MT-bench JSONL file (question_id, category, turns), or a set by name: "
                  + "; ".join(f"{name} ({what})" for name, what in QUESTION_SETS.items()))


def int_list(text: str) -> list[int]:
    """`--batch-sizes 1,2,4`: comma-separated integers >= 1."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_target(p: argparse.ArgumentParser, *, default: str | None = "default", help: str = TARGET_HELP) -> None:
    p.add_argument("--target", default=default, help=help)


def add_model_settings(p: argparse.ArgumentParser) -> None:
    """How the target loads: device, dtype, weight layout, an fp32 head and a LoRA adapter."""
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    # The names are checked where the model loads (`specheads.gemm_layout.resolve_layout`), so building these
    # arguments imports no torch.
    p.add_argument("--weight-layout", default="auto", metavar="LAYOUT",
                   help="how linear layers multiply: auto (measured for fp32 on CPU; packed for bf16 on a CPU with "
                        "native bf16; row-major elsewhere), measured (each weight shape, at each row count, on the "
                        "kernel measured fastest on this machine: F.linear, (W xᵀ)ᵀ or oneDNN's packed weights; "
                        "measured once and cached), packed (oneDNN's packed weights everywhere), transposed ((W xᵀ)ᵀ "
                        "for more than one row), column (column-major weights), row. Only GEMM rounding changes; "
                        "bench's header names the kernels taken")
    p.add_argument("--step", default="auto", choices=("auto", "lean", "hf"),
                   help="the target's forward in the engine: lean (fused q/k/v and gate/up products, fewer calls per "
                        "layer; Llama, Qwen2, Qwen3 and Mistral without sliding window), hf (the model's own forward), "
                        "auto (lean where the target allows it, else hf). Every method of a run uses the same one")
    p.add_argument("--compile", action="store_true",
                   help="compile the lean forward's decoder layers as one torch.compile graph (weights frozen in; "
                        "dynamic shapes: a few graphs serve every width and length; a minute or more per graph on a "
                        "small CPU, cached by torch's compile cache after); greedy output stays exact")
    p.add_argument("--backend", default="torch", choices=("torch", "llamacpp"),
                   help="what runs the target under the engine: torch (our PyTorch forward, --step and --compile) or "
                        "llamacpp (llama.cpp's CPU kernels through libllama, built once from the pinned release; the "
                        "same proposers, trees, verification and sampling; docs/llamacpp.md)")
    p.add_argument("--gguf", metavar="PRECISION|FILE",
                   help="with --backend llamacpp: the target's GGUF, a precision (f32, bf16, q8_0: converted once by "
                        "llama.cpp's converter and cached; q4_1: the default target's shipped file) or a .gguf file of "
                        "the same weights. Default: f32, or bf16 with --dtype bfloat16")
    p.add_argument("--fp32-head", action="store_true",
                   help="with --dtype bfloat16/float16: compute the target's final norm and LM head in fp32, so logits "
                        "near a tie round alike in one-token and tree steps (costs an fp32 LM head product per "
                        "position)")
    p.add_argument("--adapter", metavar="DIR",
                   help="verify against the target with this LoRA adapter merged in (a medusa2 run's final/adapter): "
                        "greedy output then equals plain greedy decoding of the adapted target, not the original one")


def add_sampling(p: argparse.ArgumentParser, *, temperature_help: str = "0 = greedy (default)",
                 seed_help: str | None = None) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help=temperature_help)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, help=seed_help)


def add_questions(p: argparse.ArgumentParser, *, per_category_help: str, help: str = QUESTIONS_HELP,
                  group: argparse._MutuallyExclusiveGroup | None = None, limit_help: str | None = None,
                  per_category_default: int | None = None) -> None:
    """`--questions` (required unless it is one choice of `group`), `--limit` where `limit_help` is given, and
    `--per-category`."""
    (p if group is None else group).add_argument("--questions", required=group is None, help=help)
    if limit_help is not None:
        p.add_argument("--limit", type=int, help=limit_help)
    p.add_argument("--per-category", type=int, metavar="N", default=per_category_default, help=per_category_help)


def add_max_new_tokens(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, required=True)


def add_max_tokens(p: argparse.ArgumentParser, *, default: int, help: str) -> None:
    p.add_argument("--max-tokens", type=int, default=default, help=help)


def add_api_key(p: argparse.ArgumentParser, *, help: str) -> None:
    p.add_argument("--api-key", help=help)


def add_output(p: argparse.ArgumentParser, *, help: str, required: bool = False, type: type | None = Path) -> None:
    p.add_argument("--output", type=type, required=required, help=help)


def add_method(p: argparse.ArgumentParser, *, help: str | None = None, default: str | None = "ar") -> None:
    """`--method` (required when `default` is None; `help` None lists every method) and every method's options."""
    from specheads.inference.methods import METHODS, flag, option_flags

    if help is None:
        help = "; ".join(f"{name}: {m.summary}" for name, m in METHODS.items()) + " (default ar)"
    p.add_argument("--method", default=default, required=default is None, help=help)
    methods = p.add_argument_group("method options", "each applies to the methods named in its help; giving one "
                                                     "that the chosen --method does not take is an error")
    for opt in option_flags():
        methods.add_argument(flag(opt.name), dest=opt.name, type=opt.type, help=opt.help)


def method_options(args: argparse.Namespace):
    """`--method`'s options from the flags (checked: a flag the method does not take is refused)."""
    from specheads.inference.methods import METHODS, option_flags

    return METHODS.get(args.method).make_options({opt.name: getattr(args, opt.name) for opt in option_flags()})


def load_model(args: argparse.Namespace):
    """The target and tokenizer the model-setting flags name."""
    from specheads.target import load_target

    return load_target(args.target, device=args.device, dtype=args.dtype, weight_layout=args.weight_layout,
                       fp32_head=args.fp32_head, adapter=args.adapter)


def target_backend(args: argparse.Namespace, max_rows: int = 1):
    """The backend `--backend` names for an engine of `max_rows` rows; None for our PyTorch forward (which the engine
    builds from --step and --compile)."""
    if args.backend == "torch":
        if args.gguf:
            raise ValueError("--gguf names the target's GGUF for --backend llamacpp; add --backend llamacpp or drop it")
        return None
    if args.step != "auto" or args.compile:
        raise ValueError("--step and --compile choose our PyTorch forward; --backend llamacpp runs llama.cpp's")
    if args.device != "cpu":
        raise ValueError(f"--backend llamacpp runs on the CPU, not --device {args.device}; drop --device or use "
                         "--backend torch")
    import torch

    from specheads.inference.engine.llamacpp_backend import llamacpp_backend

    gguf = args.gguf or ("bf16" if args.dtype in ("bfloat16", "bf16") else "f32")
    return llamacpp_backend(args.target, gguf, max_rows=max_rows, threads=torch.get_num_threads())


def draft_loader(model, tokenizer, args: argparse.Namespace):
    """Loads a draft model (`draft:PATH`, `hf-assisted:PATH`) beside the target, refusing another vocabulary."""
    from specheads.draft_models import check_same_vocabulary
    from specheads.target import load_target

    def load_draft(name: str):
        draft, draft_tok = load_target(name, device=args.device, dtype=model.dtype, weight_layout=args.weight_layout)
        check_same_vocabulary(model, tokenizer, draft, draft_tok)
        return draft

    return load_draft


def make_method(args: argparse.Namespace, options, model, tokenizer):
    """The proposer `--method` and `options` name, and its label (`method_label`)."""
    from specheads.inference.methods import make_proposer, method_label

    return make_proposer(args.method, model, options, draft_loader(model, tokenizer, args)), \
        method_label(args.method, options)
