"""Parsed OpenAI requests -> the engine's requests: chat messages for a text model's template, messages
and images for a VLM, and the GenerationRequest fields (sampling defaults as OpenAI's)."""

from __future__ import annotations

from typing import Any

from deployments.wire.generation import GenerationRequest
from router.protocols.openai.errors import ProtocolError, UnsupportedParameter
from router.protocols.openai.requests import ChatCompletionRequest, CompletionRequest, _Sampling

DEFAULT_MAX_TOKENS = 512  # OpenAI's chat default is "up to the context"; a bound keeps a slot from running away


_ENGINE_ROLE = {"developer": "system"}


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages for a text model's chat template: role ('developer' -> 'system') and string content
    (text parts joined); name / tool_call_id / tool_calls pass through. Image parts are a 400 here:
    a text model cannot see them (route the request to a VLM with `split_images`)."""
    out = []
    for i, m in enumerate(req.messages):
        for j, part in enumerate(m.content or ()):
            if part.type == "image_url":
                raise UnsupportedParameter("this model does not accept images; use a vision model", f"messages[{i}].content[{j}]")
        msg: dict[str, Any] = {"role": _ENGINE_ROLE.get(m.role, m.role), "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        out.append(msg)
    return out


def split_images(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list[str]]:
    """(messages, images) for the VLM engine: each image part becomes {"type": "image"} in place,
    its URL (data: URL or allowed path) goes to `images` in order; text parts stay text parts."""
    messages, images = [], []
    for i, m in enumerate(req.messages):
        if m.role == "tool":
            raise UnsupportedParameter("vision models do not take tool messages", f"messages[{i}].role")
        parts = []
        for p in m.content or ():
            if p.type == "image_url":
                parts.append({"type": "image"})
                images.append(p.image_url.url)  # type: ignore[union-attr]  # an image_url part has one (_payload)
            else:
                parts.append({"type": "text", "text": p.text if p.type == "text" else p.refusal})  # type: ignore[dict-item]
        messages.append({"role": _ENGINE_ROLE.get(m.role, m.role), "content": parts})
    return messages, images


def check_image_urls(req: ChatCompletionRequest, allow_remote: bool) -> None:
    """Image parts must be data: URLs, or http(s) URLs when the operator lets the server fetch
    them (`allow_remote_images`); anything else (a file path, another scheme) is a 400 naming it."""
    schemes = ("data:", "http://", "https://") if allow_remote else ("data:",)
    allowed = "a data: URL or an http(s) URL" if allow_remote else "a data: URL (this server does not fetch remote images)"
    for i, m in enumerate(req.messages):
        for j, part in enumerate(m.content or ()):
            if part.type == "image_url" and not part.image_url.url.startswith(schemes):  # type: ignore[union-attr]
                raise ProtocolError(400, "invalid_image_url", f"an image must be {allowed}", f"messages[{i}].content[{j}].image_url.url")


def _sampling(req: _Sampling) -> dict[str, Any]:
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    if top_p == 0:  # OpenAI accepts 0: the limit of nucleus sampling is greedy decoding
        temperature, top_p = 0.0, 1.0
    return {"temperature": temperature, "top_p": top_p, "stop": list(req.stop or [])}


def generation_fields(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The fields of a GenerationRequest, as a plain dict (router/serving/generation.py adds a forced
    tool call's grammar before it builds the request). max_tokens: max_completion_tokens, else max_tokens, else 512; temperature
    1.0 and top_p 1.0 as OpenAI."""
    out: dict[str, Any] = {}
    if isinstance(req, ChatCompletionRequest):
        out["messages"] = chat_messages(req)
        max_tokens = req.max_completion_tokens or req.max_tokens
        out["logprobs"] = bool(req.logprobs)
        out["top_logprobs"] = (req.top_logprobs or 0) if req.logprobs else 0
        template = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:
            template.setdefault("reasoning_effort", req.reasoning_effort)
        if template:
            out["chat_template_kwargs"] = template
        if req.tools:  # with tool_choice "none" too: the tools stay in the prompt, calls are not parsed
            out["tools"] = [t.as_dict() for t in req.tools]
        if req.response_format is not None and req.response_format.constraint() is not None:
            out["constraint"] = req.response_format.constraint()
    else:
        out["prompt" if isinstance(req.prompt, str) else "prompt_tokens"] = req.prompt
        max_tokens = req.max_tokens
        out["logprobs"] = req.logprobs is not None
        out["top_logprobs"] = req.logprobs or 0
    out["max_tokens"] = max_tokens or DEFAULT_MAX_TOKENS
    out.update(_sampling(req))
    out["top_k"] = max(0, req.top_k or 0)
    out["min_p"] = req.min_p or 0.0
    out["seed"] = req.seed
    out["presence_penalty"] = req.presence_penalty or 0.0
    out["frequency_penalty"] = req.frequency_penalty or 0.0
    out["repetition_penalty"] = req.repetition_penalty
    out["logit_bias"] = req.logit_bias or None
    return out


def to_generation_request(req: ChatCompletionRequest | CompletionRequest) -> GenerationRequest:
    """The model server's GenerationRequest (deployments/wire: no engine, no MLX)."""
    return GenerationRequest(**generation_fields(req))


def to_vlm_request(req: ChatCompletionRequest) -> dict[str, Any]:
    """The fields of the model server's VLMRequest as a dict (messages, images, max_tokens,
    temperature, top_p, stop).
    Sampling controls the VLM engine lacks are a 400 when set, never dropped silently."""
    used = {
        "logprobs": bool(req.logprobs),
        "seed": req.seed is not None,
        "presence_penalty": bool(req.presence_penalty),
        "frequency_penalty": bool(req.frequency_penalty),
        "logit_bias": bool(req.logit_bias),
        "top_k": bool(req.top_k and req.top_k > 0),
        "min_p": bool(req.min_p),
        "repetition_penalty": req.repetition_penalty not in (None, 1.0),
        "chat_template_kwargs": bool(req.chat_template_kwargs),
        "tools": bool(req.tools),
        "response_format": req.response_format is not None and req.response_format.type != "text",
    }
    bad = next((name for name, on in used.items() if on), None)
    if bad is not None:
        raise UnsupportedParameter(f"vision models do not support '{bad}'", bad, "unsupported_parameter")
    messages, images = split_images(req)
    return {"messages": messages, "images": images, "max_tokens": req.max_completion_tokens or req.max_tokens or DEFAULT_MAX_TOKENS, **_sampling(req)}
