"""Which transformers class builds a target: causal LMs as themselves, image-text checkpoints as the image-text class
whose forward on token ids runs their text decoder, anything else refused by name."""

from __future__ import annotations

import pytest
import transformers
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from specheads.hf import causal_lm_class
from specheads.target import load_target
from tests.conftest import tiny_config, tiny_tokenizer


@pytest.mark.parametrize(("arch", "auto"), [("llama", AutoModelForCausalLM), ("gemma3", AutoModelForCausalLM),
                                            ("qwen2_5_vl", AutoModelForImageTextToText)])
def test_targets_build_with_the_class_that_runs_their_text_decoder(arch, auto):
    assert causal_lm_class(tiny_config(arch)) is auto


def test_a_model_that_generates_no_text_from_tokens_alone_is_refused_naming_its_type(tmp_path):
    config = transformers.T5Config(vocab_size=96, d_model=32, d_ff=64, num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match="'t5' model is neither a causal LM nor an image-text model"):
        causal_lm_class(config)
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="use a decoder-only causal LM"):
        load_target(str(tmp_path))
