"""Shared fixtures: tiny fixed-seed HF causal LMs built from configs (no downloads)."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from specheads.hf import causal_lm_class
from specheads.inference.proposers.verify_cost import VerifyCost

TINY_VOCAB = 96

if os.environ.get("PYTEST_XDIST_WORKER"):  # scripts/test.sh runs the suite in parallel workers (pytest-xdist)
    # Each worker takes its share of the cores: torch's intra-op threads in every worker would oversubscribe them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


def tiny_config(arch: str = "llama", *, layers: int = 4, vocab: int = TINY_VOCAB, hidden: int = 64):
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                  # A wide init gives peaked, context-dependent logits: varied greedy text, not one repeated token.
                  initializer_range=0.2)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":  # per-head q/k norms
        return Qwen3Config(**common, head_dim=hidden // common["num_attention_heads"])
    if arch == "mistral":  # without a sliding window: full attention in every layer
        return MistralConfig(**common, sliding_window=None)
    if arch == "qwen3_moe":  # a routed mixture of experts in every layer
        return transformers.Qwen3MoeConfig(**common, head_dim=hidden // common["num_attention_heads"], num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=hidden, decoder_sparse_step=1)
    if arch == "phi3":  # fused q/k/v and gate/up projections
        return transformers.Phi3Config(**common)
    if arch == "granite":  # embeddings multiplied, logits divided, residuals and attention scaled
        return transformers.GraniteConfig(**common, embedding_multiplier=2.0, residual_multiplier=0.5,
                                          attention_multiplier=0.25, logits_scaling=4.0)
    if arch == "olmo2":  # norms after attention and MLP, q/k norms over all heads
        return transformers.Olmo2Config(**common)
    # Windows of a few tokens, so a short test decodes past them.
    if arch == "mistral-window":  # a sliding window in every layer
        return MistralConfig(**common, sliding_window=WINDOW)
    if arch in ("gemma2", "gemma3_text"):  # local and global layers, embeddings scaled by sqrt(H), soft-capping
        cls = {"gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig"}[arch]
        return getattr(transformers, cls)(**common, head_dim=hidden // common["num_attention_heads"],
                                          sliding_window=WINDOW, query_pre_attn_scalar=hidden // 4,
                                          layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    if arch == "gpt_oss":  # alternating local and global layers, attention sinks, a routed mixture of experts
        return transformers.GptOssConfig(**common, head_dim=hidden // common["num_attention_heads"],
                                         sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                         layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    if arch == "gemma3":  # Gemma 3's image-text checkpoint: a vision tower beside the gemma3_text decoder
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                      patch_size=14)
        return transformers.Gemma3Config(text_config=tiny_config("gemma3_text", layers=layers, vocab=vocab,
                                                                 hidden=hidden).to_dict(),
                                         vision_config=vision, mm_tokens_per_image=4, boi_token_index=vocab - 3,
                                         eoi_token_index=vocab - 2, image_token_index=vocab - 1)
    if arch == "qwen2_5_vl":  # an image-text checkpoint: a vision tower beside a Qwen2 decoder with multimodal rotary
        rope = {"rope_type": "default", "mrope_section": [2, 2, 4], "rope_theta": 10000.0}
        text = dict(tiny_config("qwen2", layers=layers, vocab=vocab, hidden=hidden).to_dict(),
                    model_type="qwen2_5_vl_text", rope_parameters=rope)
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=dict(depth=1, hidden_size=32, num_heads=2,
                                                                                  out_hidden_size=hidden,
                                                                                  intermediate_size=64),
                                             vision_start_token_id=vocab - 3, video_token_id=vocab - 2,
                                             image_token_id=vocab - 1)
    if arch == "exaone4":  # local layers and a global one, q/k norms
        return transformers.Exaone4Config(**common, sliding_window=WINDOW,
                                          layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"])
    raise ValueError(arch)


WINDOW = 6  # the tiny windowed families' sliding window


def tiny_model(arch: str = "llama", seed: int = 0, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny_config(arch, **kwargs)
    auto = causal_lm_class(config)  # image-text checkpoints as load_target builds them
    try:
        model = auto.from_config(config, attn_implementation="sdpa")
    except ValueError:  # no SDPA path (soft-capping in Gemma 2, attention sinks in gpt-oss): eager, as load_target
        torch.manual_seed(seed)
        model = auto.from_config(config, attn_implementation="eager")
    return model.eval().requires_grad_(False)


def perturbed_copy(model: torch.nn.Module, noise: float, seed: int = 3) -> torch.nn.Module:
    """A draft model that agrees with `model` often but not always, like a distilled drafter."""
    import copy

    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std().clamp(min=1e-3))
    return draft


def random_eagle_head(target: torch.nn.Module, aux_layers: tuple[int, ...] = (1, 2),
                      draft_vocab: tuple[int, ...] | None = None) -> torch.nn.Module:
    """Untrained EAGLE heads, perturbed so they draft (mostly wrongly), on the target's device."""
    from specheads.heads.eagle import EagleConfig, EagleHead

    torch.manual_seed(0)
    vocab, hidden = target.get_output_embeddings().weight.shape
    head = EagleHead(EagleConfig(hidden_size=hidden, vocab_size=vocab, aux_layers=aux_layers, draft_vocab=draft_vocab),
                     target)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head.to(target.device).eval()


def start_proposer(proposer, target: torch.nn.Module, prompt: list[int], max_depth: int = 8):
    """Start `proposer` on `prompt` as the engine does after the prefill; returns the ProposalContext."""
    from specheads.inference.engine.proposer import ProposalContext
    from specheads.inference.engine.sampling import SamplingParams

    tokens = torch.tensor(prompt)
    ctx = ProposalContext(tokens=tokens, num_prompt_tokens=len(prompt), max_depth=max_depth,
                          sampling=SamplingParams(), generator=None)
    with torch.no_grad():
        hidden = target(tokens[None, :-1], output_hidden_states=True).hidden_states
    proposer.start(ctx, hidden)
    return ctx


@pytest.fixture(autouse=True)
def _verify_cost_cache(tmp_path_factory, monkeypatch):
    """Node budgets in tests decide on one fixed, mildly rising verify-cost curve, cached in a temporary folder
    (never the user's): a curve measured on a busy machine could make a test draft nothing. Measuring itself is
    tested in tests/inference/proposers/test_node_budget.py (`measure_verify_cost`) and, on llama.cpp,
    tests/inference/engine/test_llamacpp_backend.py (`measure_backend_verify_cost`)."""
    import specheads.inference.proposers.verify_cost as verify_cost

    folder = tmp_path_factory.getbasetemp() / "verify-cost"
    monkeypatch.setattr(verify_cost, "default_cache_dir", lambda: folder)
    monkeypatch.setattr(verify_cost, "measure_verify_cost", lambda *args, **kwargs: TEST_VERIFY_COST)
    monkeypatch.setattr(verify_cost, "measure_backend_verify_cost", lambda *args, **kwargs: TEST_VERIFY_COST)


# A tree of 8 nodes costs 1.2 one-token steps, 32 nodes 1.8: trees pay when drafts are accepted at all.
TEST_VERIFY_COST = VerifyCost(nodes=(1, 2, 4, 8, 16, 32, 64),
                              seconds=(0.010, 0.0105, 0.011, 0.012, 0.014, 0.018, 0.026))


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Forget accelerate's process-wide state after each test: a recipe run in this process leaves it set, and the
    next run's `Accelerator` may not change it (e.g. `mixed_precision=auto` chose bf16 on a CPU with native bf16,
    and the next run asks for fp32)."""
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


@pytest.fixture
def one_thread():
    """For tests made of thousands of tiny tensor ops: intra-op threads only add synchronisation
    (and stall badly when another process holds the other core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["llama", "qwen2"])
def arch(request) -> str:
    return request.param


@pytest.fixture
def target(arch):
    return tiny_model(arch, seed=0)


def repetitive_prompt(length: int = 24, seed: int = 1) -> list[int]:
    """A prompt with repeated spans, so n-gram lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    span = torch.randint(3, TINY_VOCAB, (6,), generator=g).tolist()
    noise = torch.randint(3, TINY_VOCAB, (length,), generator=g).tolist()
    return (noise[:8] + span + noise[8:14] + span + noise[14:])[:length]


def tiny_tokenizer(vocab: int = TINY_VOCAB):
    """A word-level tokenizer over words w3..w{vocab-1} with a chat template (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="<unk>")
    tok.chat_template = ("{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}"
                         "{% if add_generation_prompt %}<s> {% endif %}")
    return tok


@pytest.fixture
def tiny_model_dir(tmp_path_factory):
    """A saved tiny Llama target with its tokenizer, loadable by `--target DIR`."""
    path = tmp_path_factory.mktemp("tiny-target")
    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_run_inputs(tmp_path_factory):
    """A saved tiny target and a ShareGPT-format JSONL whose answers follow a learnable pattern."""
    root = tmp_path_factory.mktemp("recipe")
    target = root / "target"
    tiny_model("llama").save_pretrained(target)
    tiny_tokenizer().save_pretrained(target)
    rng = random.Random(0)
    rows = []
    for _ in range(48):
        conv = []
        for _ in range(2):
            conv.append({"from": "human", "value": " ".join(f"w{rng.randrange(3, 96)}" for _ in range(6))})
            start = rng.randrange(3, 60)
            conv.append({"from": "gpt", "value": " ".join(f"w{(start + 3 * k) % 93 + 3}" for k in range(16))})
        rows.append({"conversations": conv})
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return target, data


def base_args(inputs, out: Path, *extra: str) -> list[str]:
    target, data = inputs
    return ["recipe=eagle", f"target={target}", f"data.source={data}", f"output_dir={out}", "data.max_length=96",
            "optim.batch_size=4", "optim.warmup_steps=2", "draft_vocab_size=48", "log_every=1", "eval_every=100",
            "data.eval_fraction=0.1", *extra]



# The device `gpu` tests run on: CUDA, or the CPU where scripts/gpu_check.sh rehearses its run
# (SPECHEADS_GPU_TEST_DEVICE=cpu), so the GPU machine finds nothing to fix in them but CUDA itself.
GPU_TEST_DEVICE = os.environ.get("SPECHEADS_GPU_TEST_DEVICE", "cuda")


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip cleanly on machines without CUDA (unless rehearsed on the CPU)."""
    if torch.cuda.is_available() or GPU_TEST_DEVICE == "cpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


BYTE_VOCAB = 259  # <unk>, <s>, </s>, then one token per byte


def byte_tokenizer():
    """A byte-level tokenizer (one token per byte, id = byte + 3; no merges, no downloads) that grammar engines can
    read: any text, JSON included, tokenizes, and the tiny targets' logits cover it with `vocab=BYTE_VOCAB`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shown = dict(zip(printable, map(chr, printable)))
    others = [b for b in range(256) if b not in shown]
    shown.update({b: chr(256 + i) for i, b in enumerate(others)})  # the byte-level alphabet GPT-2 defined
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{shown[b]: 3 + b for b in range(256)}}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def text_batch(tokens: torch.Tensor, answer_from: int = 0) -> dict[str, torch.Tensor]:
    """A training batch of the texts `tokens` [B, T], every token attended, the loss on positions answer_from.."""
    loss = torch.zeros_like(tokens)
    loss[:, answer_from:] = 1
    return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "loss_mask": loss}
