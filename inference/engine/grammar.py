"""Structured-output requests turned into grammars (llguidance's formats), and the tokenizer those grammars run on.

A request asks for structure the way the OpenAI API and vLLM spell it: `response_format` (`{"type": "json_object"}`,
`{"type": "json_schema", "json_schema": {"schema": {...}}}`), or vLLM's `structured_outputs` / `guided_*` fields
(`json`, `regex`, `grammar` (Lark), `choice`). `grammar_from_request` turns any of them into one `Grammar`; the
engine's `GrammarConstraint` (`constraint.py`) applies it to every tree node.

llguidance was chosen over xgrammar by measurement and maintenance (docs/results.md, "structured outputs"): both
mask a token in 5-25 µs on the default target's tokenizer, a few hundred µs for a 16-node tree against a step of tens
of ms, so speed does not decide; llguidance is one wheel with no dependencies for every Python from 3.9 (xgrammar
pins its own torch-side packages and Triton), and it gives the grammar's forced tokens and rollback, which tree
verification needs.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import Any

INSTALL_HINT = "structured outputs need llguidance: pip install 'specheads[structured]' (or pip install llguidance)"


def _llguidance():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401  (the tokenizer bridge)
    except ImportError as err:
        raise ValueError(INSTALL_HINT) from err
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """One request's grammar in llguidance's serialized form, and what it was made from (for messages and logs)."""

    source: str  # llguidance grammar (from LLMatcher.grammar_from_*)
    kind: str  # json_schema, json_object, regex, grammar or choice

    def check(self, tokenizer: Any = None) -> None:
        """Raise one clear error if the grammar does not compile (for `tokenizer`, if given): a bad schema, regex or
        Lark grammar."""
        llg = _llguidance()
        error = llg.LLMatcher.validate_grammar(self.source, lltokenizer(tokenizer) if tokenizer is not None else None)
        if error:
            raise ValueError(f"the {self.kind} constraint does not compile: {error}; "
                             f"fix the {self.kind}")


# Accept any JSON value at the top level: OpenAI's json_object asks for an object, which is what this schema says.
_ANY_OBJECT = {"type": "object"}


# JSON is written `{"key": value, "other": [1, 2]}`: one space after `:` and `,`, none elsewhere. Fixed whitespace makes
# every key and separator a token the grammar forces (drafted for free), and keeps small targets out of the endless
# newlines that free whitespace lets them emit. `"disable_any_whitespace": false` (vLLM's switch) allows any.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_grammar(schema: dict | str, *, kind: str = "json_schema", any_whitespace: bool = False) -> Grammar:
    llg = _llguidance()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise ValueError(f"the JSON schema is not valid JSON ({err}); pass the schema as a JSON object") from None
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    try:
        source = llg.LLMatcher.grammar_from_json_schema(schema, overrides=None if any_whitespace else COMPACT_JSON)
    except ValueError as err:
        raise ValueError(f"the JSON schema is not usable: {err}") from None
    return Grammar(source=source, kind=kind)


def regex_grammar(pattern: str) -> Grammar:
    return Grammar(source=_llguidance().LLMatcher.grammar_from_regex(pattern), kind="regex")


def lark_grammar(lark: str) -> Grammar:
    return Grammar(source=_llguidance().LLMatcher.grammar_from_lark(lark), kind="grammar")


def choice_grammar(choices: list[str]) -> Grammar:
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("`choice` must be a non-empty list of strings")
    lark = "start: " + " | ".join(json.dumps(c) for c in choices)  # Lark string literals use JSON's escapes
    return Grammar(source=_llguidance().LLMatcher.grammar_from_lark(lark), kind="choice")


def grammar_from_request(body: dict[str, Any]) -> Grammar | None:
    """The grammar a request body asks for, or None: OpenAI's `response_format`, vLLM's `structured_outputs`
    ({json, regex, grammar, choice}) or its older `guided_json` / `guided_regex` / `guided_grammar` /
    `guided_choice`. More than one constraint is refused, naming them."""
    so = body.get("structured_outputs") or {}
    if not isinstance(so, dict):
        raise ValueError("structured_outputs must be an object with one of json, regex, grammar, choice")
    so = dict(so)
    any_whitespace = so.pop("disable_any_whitespace", True) is False
    found: list[tuple[str, Grammar]] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or "type" not in rf:
            raise ValueError("response_format must be an object with a \"type\" (text, json_object or json_schema)")
        kind = rf["type"]
        if kind == "json_object":
            found.append(("response_format", json_schema_grammar(_ANY_OBJECT, kind="json_object",
                                                                 any_whitespace=any_whitespace)))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise ValueError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
            found.append(("response_format", json_schema_grammar(spec["schema"], any_whitespace=any_whitespace)))
        elif kind != "text":
            raise ValueError(f"response_format type {kind!r} is not supported; use text, json_object or json_schema")
    fields = {f"structured_outputs.{k}": v for k, v in so.items() if v is not None}
    fields.update({k: body[k] for k in ("guided_json", "guided_regex", "guided_grammar", "guided_choice")
                   if body.get(k) is not None})
    for name, value in fields.items():
        what = name.rsplit(".", 1)[-1].removeprefix("guided_")
        if what == "json":
            found.append((name, json_schema_grammar(value, any_whitespace=any_whitespace)))
        elif what == "json_object":
            if value:
                found.append((name, json_schema_grammar(_ANY_OBJECT, kind="json_object",
                                                        any_whitespace=any_whitespace)))
        elif what == "regex":
            found.append((name, regex_grammar(str(value))))
        elif what == "grammar":
            found.append((name, lark_grammar(str(value))))
        elif what == "choice":
            found.append((name, choice_grammar(value)))
        else:
            raise ValueError(f"{name} is not a known constraint; use json, json_object, regex, grammar or choice")
    if len(found) > 1:
        raise ValueError(f"the request asks for several constraints ({', '.join(n for n, _ in found)}); pass one")
    return found[0][1] if found else None


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def lltokenizer(tokenizer: Any) -> Any:
    """llguidance's view of an HF fast tokenizer, built once per tokenizer (it takes a few hundred ms)."""
    llg = _llguidance()
    try:
        return _TOKENIZERS[tokenizer]
    except KeyError:
        pass
    try:
        built = llg.hf.from_tokenizer(tokenizer)
    except Exception as err:  # noqa: BLE001 - llguidance names what it cannot read in the tokenizer
        raise ValueError(f"structured outputs cannot read this tokenizer's tokens as bytes ({err}); they need a "
                         "byte-level BPE or SentencePiece tokenizer with its decoder") from None
    _TOKENIZERS[tokenizer] = built
    return built
