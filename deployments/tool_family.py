"""Which tool-call family a model speaks and whether it writes think blocks, read from its folder:
the chat template, the tokenizer's vocabulary and config. Plain names out; the parsers that read
those families live in the router (router/serving/output/tool_parsers.py), which this module does
not import (deployments/ imports only policy/ and itself), so the residency registry and the
serving path both ask here.

The registry's `tool_parser` names the family when given; otherwise it is inferred here from the
model folder's chat template, as mlx-lm does (`tokenizer_utils._infer_tool_parser`): each family's
template writes its own call markers, so the markers it names identify it. Orchard adds what mlx-lm
leaves out (gpt-oss's harmony, DeepSeek, Llama 3's JSON calls, Mistral's [ARGS] form) and one rule:
a template that does not render `tools` gets the engine's Hermes-style tool prompt
(deployments/engines/chat_format.py), so its model is read as "hermes" whatever else the template
names. Where the template names no markers, the vocabulary may (LFM2 conversions carry
`<|tool_call_start|>` without writing it in the template; Kimi K3's XTML tokens). A checkpoint that
declares its family (tokenizer_config.json `tool_parser_type`, as mlx-lm conversions may) is taken
at its word when the name is one Orchard parses."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from pathlib import Path

from deployments.engines.chat_format import template_supports_tools

# Every family Orchard parses, by name, and mlx-lm's other names for them: what a checkpoint may
# declare. The router's parser table (tool_parsers.FAMILIES, ALIASES) is the same set; a test holds
# them equal.
KNOWN_FAMILIES: frozenset[str] = frozenset(
    {
        "deepseek", "function_gemma", "gemma4", "glm47", "harmony", "hermes", "kimi_k2", "kimi_k3", "laguna",
        "llama3", "longcat", "minicpm5", "minimax_m2", "mistral", "mistral_v11", "muse_spark", "pythonic",
        "qwen3_coder",
    }
)  # fmt: skip
ALIASES: dict[str, str] = {"json_tools": "hermes"}

# (family, markers that must all appear in the template), first match wins: more specific first
# (Qwen3-Coder's `<tool_call>\n<function=` before Hermes' `<tool_call>`, Mistral's [ARGS] before
# [TOOL_CALLS]). The strings are the calls as each template writes them.
TEMPLATE_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("harmony", ("<|channel|>", "<|message|>", "to=")),
    ("deepseek", ("<｜tool▁calls▁begin｜>",)),
    ("minimax_m2", ("<minimax:tool_call>",)),
    ("gemma4", ("<|tool_call>", "<tool_call|>")),
    ("function_gemma", ("<start_function_call>",)),
    ("longcat", ("<longcat_tool_call>",)),
    ("glm47", ("<arg_key>",)),
    ("pythonic", ("<|tool_call_start|>",)),
    ("pythonic", ("<|tool_list_start|>",)),
    ("qwen3_coder", ("<tool_call>\\n<function=",)),
    ("qwen3_coder", ("<tool_call>\n<function=",)),
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("kimi_k3", ("<|open|>", "<|sep|>", "tools")),
    ("minicpm5", ('<function name="', '<param name="')),
    ("mistral_v11", ("[TOOL_CALLS]", "[ARGS]")),
    ("mistral", ("[TOOL_CALLS]",)),
    ("muse_spark", ("<atem:function_calls>",)),
    ("hermes", ("<tool_call>",)),
    ("llama3", ('"parameters": ', "<|start_header_id|>")),
)

VOCAB_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kimi_k3", ("<|open|>", "<|close|>", "<|sep|>")),
    ("pythonic", ("<|tool_call_start|>", "<|tool_call_end|>")),
)


def _matches(text: Collection[str] | str, markers: Iterable[str]) -> bool:
    return all(m in text for m in markers)


def infer_family(template: str | dict | list | None, vocab: Collection[str] = ()) -> str | None:
    """The tool-call family a chat template (a string, or a tokenizer's named templates) and its
    vocabulary say, or None when neither names one. A template that does not render tools is read
    as "hermes": the engine prompts its model with Hermes-style tools."""
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    if isinstance(template, str) and template:
        if not template_supports_tools(template):
            return "hermes"
        for family, markers in TEMPLATE_RULES:
            if _matches(template, markers):
                return family
    for family, markers in VOCAB_RULES:
        if _matches(vocab, markers):
            return family
    return None


def folder_template(folder: str | Path) -> str | dict | list | None:
    """The chat template a model folder carries: chat_template.jinja, chat_template.json, or
    tokenizer_config.json's `chat_template` (as transformers looks for them)."""
    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = folder / name
        if path.is_file():
            try:
                found = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
            except (ValueError, AttributeError):
                continue
            if found:
                return found
    return None


def folder_vocab(folder: str | Path) -> set[str]:
    """The added (special) tokens of a model folder's tokenizer.json: where tool-call tokens live."""
    path = Path(folder) / "tokenizer.json"
    try:
        added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens") or []
    except (OSError, ValueError, AttributeError):
        return set()
    return {t["content"] for t in added if isinstance(t, dict) and isinstance(t.get("content"), str)}


def declared_family(folder: str | Path) -> str | None:
    """The family a converted checkpoint declares in tokenizer_config.json (`tool_parser_type`,
    which mlx-lm reads before inferring), when it is one Orchard knows."""
    try:
        declared = json.loads((Path(folder) / "tokenizer_config.json").read_text(encoding="utf-8")).get("tool_parser_type")
    except (OSError, ValueError, AttributeError):
        return None
    declared = ALIASES.get(declared, declared) if isinstance(declared, str) else None
    return declared if declared in KNOWN_FAMILIES else None


def infer_folder_family(folder: str | Path) -> str | None:
    """The family a model folder declares (`declared_family`), else `infer_family` of its template
    and vocabulary (None when neither says)."""
    if declared := declared_family(folder):
        return declared
    template = folder_template(folder)
    family = infer_family(template)
    if family is None:
        family = infer_family(None, folder_vocab(folder))
    return family


THINK_START, THINK_END = "<think>", "</think>"


def generation_prompt(template: str) -> str | None:
    """What the template writes after one user message when asked for the assistant's turn, or
    None when it does not render here (rendered as transformers does: a sandbox, trimmed blocks)."""
    from datetime import datetime

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    try:
        compiled = env.from_string(template)
        messages = [{"role": "user", "content": "Hi"}]
        with_prompt = compiled.render(messages=messages, add_generation_prompt=True, bos_token="", eos_token="")
        without = compiled.render(messages=messages, add_generation_prompt=False, bos_token="", eos_token="")
    except Exception:  # a template this sandbox cannot render: no inference from it
        return None
    return with_prompt[len(without) :] if with_prompt.startswith(without) else with_prompt


def infer_reasoning(template: str | dict | list | None) -> dict | None:
    """The registry's `reasoning` a chat template implies: `<think>` blocks when it writes
    `</think>` (Qwen3, GLM, Kimi K2 Thinking, MiniMax M2, DeepSeek), opened already in the prompt
    (`starts_inside`) when its generation prompt ends with `<think>` (MiniMax M2); None when it knows
    no think blocks. gpt-oss's channels are the harmony parser's own."""
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(template, dict):
        template = template.get("default") or template.get("tool_use")
    if not isinstance(template, str) or THINK_END not in template:
        return None
    prompt = generation_prompt(template)
    return {"starts_inside": prompt is not None and prompt.rstrip().endswith(THINK_START)}
