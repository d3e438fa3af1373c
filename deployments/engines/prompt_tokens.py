"""A generation request's prompt tokens, as the LLM engine feeds them, and tokenizers read from a
model folder without its weights.

`prompt_tokens` is the one rendering of a request into tokens: the chat template (mlx-lm's
TokenizerWrapper, so a model's Python renderer, its thinking switch and its tools are applied as
mlx-lm applies them), the tools fallback of chat_format.py for a template that does not render
tools, then the tokenizer. The LLM engine tokenizes every prompt with it, and so does a count made
where the model is not loaded (`Tokenizers`), so both counts are the same number.

`Tokenizers` loads a folder's tokenizer with mlx-lm's own `load_tokenizer` (what `mlx_lm.load`
calls after the weights: tokenizer.json, tokenizer_config.json, the chat template; no safetensors
read) and keeps the most recently used few: a large vocabulary's tokenizer holds tens of MB.
A node agent counts with it (cluster/node_agent.py) for Anthropic's count_tokens when no instance
of the model is ready, so counting never loads, places or evicts a model."""

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from deployments.engine import RequestError
from deployments.engines.chat_format import chat_inputs, template_kwargs_error, template_supports_tools
from deployments.failures import internal_error
from deployments.wire.failure import OrchardError
from deployments.wire.generation import GenerationRequest

# A tokenizer's own files (mlx-lm's load_tokenizer list); a folder with none of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model", "vocab.json")


def knows_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders `tools`: mlx-lm's own renderers (a Python chat
    template) take them; a Jinja one must name them (chat_format.template_supports_tools)."""
    return getattr(tokenizer, "_chat_template", None) is not None or template_supports_tools(getattr(tokenizer._tokenizer, "chat_template", None))


def prompt_tokens(tokenizer: Any, request: GenerationRequest, template_knows_tools: bool) -> list[int]:
    """The tokens the engine feeds for `request` (a mlx-lm TokenizerWrapper's chat template with
    the generation prompt, or the raw prompt's encoding, or the token ids as given). A message list
    the template refuses, or chat_template_kwargs that are not template variables, raise
    RequestError("invalid_request")."""
    if request.prompt_tokens is not None:
        return list(request.prompt_tokens)
    if request.messages is not None:
        if not request.messages:
            raise RequestError("invalid_request", "messages is empty")
        messages, extra = chat_inputs(request.messages, request.tools, template_knows_tools)
        if template_kwargs_error(request.chat_template_kwargs) is not None:  # the engine's start() refuses it first
            raise RequestError("invalid_request", "chat_template_kwargs holds more than template variables", "chat_template_kwargs")
        try:
            tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra, **request.chat_template_kwargs)
        except Exception as e:
            raise RequestError("invalid_request", f"the chat template rejected the messages: {e}") from e
        return list(tokens["input_ids"] if isinstance(tokens, dict) else tokens)
    return tokenizer.encode(request.prompt, add_special_tokens=False) if request.prompt else []


class _Loaded:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.knows_tools = knows_tools(tokenizer)
        self.lock = threading.Lock()  # one thread at a time uses a tokenizer (as the engine's preparation thread does)


class Tokenizers:
    """The tokenizers of the last `capacity` folders counted in, loaded on first use. Thread-safe:
    counts of different models run at once, counts of one model one after the other."""

    def __init__(self, capacity: int = 4):
        self.capacity = capacity
        self._loaded: OrderedDict[str, _Loaded] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}

    def count(self, model: str, folder: str, request: GenerationRequest) -> int:
        """`request`'s prompt tokens by the tokenizer of `folder` (model `model`'s, on this node).
        OrchardError: files_not_stored when the folder holds no tokenizer here, invalid_request for
        what the chat template refuses."""
        loaded = self._get(model, folder)
        try:
            with loaded.lock:
                return len(prompt_tokens(loaded.tokenizer, request, loaded.knows_tools))
        except RequestError as e:
            raise OrchardError(e.code, e.message, e.param) from None

    def __len__(self) -> int:
        return len(self._loaded)

    def _get(self, model: str, folder: str) -> _Loaded:
        with self._lock:
            found = self._loaded.get(folder)
            if found is not None:
                self._loaded.move_to_end(folder)
                return found
            loading = self._loading.setdefault(folder, threading.Lock())
        with loading:  # one load per folder; a second caller waits for it
            with self._lock:
                found = self._loaded.get(folder)
            if found is None:
                found = _Loaded(_load(model, folder))
            with self._lock:
                self._loaded[folder] = found
                self._loaded.move_to_end(folder)
                while len(self._loaded) > self.capacity:
                    self._loaded.popitem(last=False)
                self._loading.pop(folder, None)
            return found


def _load(model: str, folder: str) -> Any:
    path = Path(folder)
    if not path.is_dir() or not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise OrchardError("files_not_stored", f"model {model}'s folder {path.name} holds no tokenizer on this node")
    from mlx_lm.utils import load_tokenizer  # mlx-lm (and MLX) only in a process that counts

    try:
        return load_tokenizer(path)
    except Exception as e:
        raise internal_error(e, f"loading model {model}'s tokenizer") from None
