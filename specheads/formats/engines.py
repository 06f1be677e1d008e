"""The formats `specheads export --to` writes: one per engine that loads drafters, importable without torch.

Each drafter kind registers an exporter for the formats that can express it (`specheads.formats.base`); a
format is declared here first, so the command line lists the formats, and what reads each, without importing
any kind's code. `FORMATS` maps a format to the engine that loads it.
"""

from __future__ import annotations

HF_FORMAT = "hf"  # our own format plus a model card: every kind exports to it (`specheads.formats.export`)

FORMATS: dict[str, str] = {
    HF_FORMAT: "our own format and a model card, for `--heads` and the Hub (every drafter kind)",
    "speculators": "vLLM and the speculators library (speculators_model_type in config.json)",
    "sglang": "SGLang and SpecForge (`--speculative-draft-model-path`)",
    "vllm-medusa": "vLLM's Medusa model (MedusaModel)",
    "gguf": "llama.cpp (`llama-server -md FILE --spec-type draft-eagle3`), through llama.cpp's own converter; a "
            "target folder exports as its GGUF",
}
