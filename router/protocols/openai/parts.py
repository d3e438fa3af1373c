"""The nested objects of OpenAI request bodies: messages and their content parts, tools, response_format
and stream_options. Unknown keys inside them are ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.protocols.openai.errors import _invalid, _unsupported


class _Part(BaseModel):
    """Nested objects: unknown keys ignored (they never change what Orchard does)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ImageURL(_Part):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(_Part):
    """One part of a message's content. One model for every part type (not a union) so a bad part
    is reported at its own path, not under a pydantic union tag."""

    type: Literal["text", "image_url", "input_audio", "file", "refusal"]
    text: str | None = None
    image_url: ImageURL | None = None
    input_audio: dict[str, Any] | None = None
    file: dict[str, Any] | None = None
    refusal: str | None = None

    @field_validator("image_url", mode="before")
    @classmethod
    def _url_string(cls, v: Any) -> Any:
        return {"url": v} if isinstance(v, str) else v  # some clients send the URL bare

    @model_validator(mode="after")
    def _payload(self) -> ContentPart:
        if self.type == "input_audio":
            raise _unsupported("audio input is not supported", at="type")
        if self.type == "file":
            raise _unsupported("file inputs are not supported", at="type")
        if getattr(self, self.type) is None:
            raise _invalid(f"a {self.type} part needs a '{self.type}' field", at=self.type, code="missing_required_parameter")
        return self


_PARTS_BY_ROLE = {
    "system": ("text",),
    "developer": ("text",),
    "tool": ("text",),
    "user": ("text", "image_url"),
    "assistant": ("text", "refusal"),
}


class ChatMessage(_Part):
    """A chat message. `content` is kept as a list of parts (a string becomes one text part)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # role tool (not required: a template that ignores it loses nothing)
    tool_calls: list[dict[str, Any]] | None = None  # assistant history; passed to the chat template
    function_call: dict[str, Any] | None = None  # deprecated; ignored
    refusal: str | None = None  # assistant history; ignored
    audio: dict[str, Any] | None = None  # assistant audio reference: unsupported

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if v is None or isinstance(v, list):
            return v
        if isinstance(v, str):
            return [{"type": "text", "text": v}]
        raise _invalid("content must be a string or an array of content parts", code="invalid_type")

    @model_validator(mode="after")
    def _by_role(self) -> ChatMessage:
        if self.audio is not None:
            raise _unsupported("audio messages are not supported", at="audio", code="unsupported_parameter")
        if self.content is None:
            if self.role != "assistant":
                raise _invalid(f"a {self.role} message needs content", at="content", code="missing_required_parameter")
            return self
        allowed = _PARTS_BY_ROLE[self.role]
        for j, part in enumerate(self.content):
            if part.type not in allowed:
                raise _invalid(f"{self.role} messages take {' or '.join(allowed)} parts, not {part.type}", at=f"content[{j}].type")
        return self

    def text(self) -> str:
        """The text parts joined by newlines (as vLLM does: parts are usually separate passages)."""
        # the part validator (_payload) guarantees the field its type names
        return "\n".join(p.text if p.type == "text" else p.refusal for p in self.content or () if p.type in ("text", "refusal"))  # type: ignore[misc]

    def has_images(self) -> bool:
        return any(p.type == "image_url" for p in self.content or ())


class StreamOptions(_Part):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # no obfuscation padding is ever added


class JSONSchemaFormat(_Part):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Part):
    """text, json_object or json_schema: the JSON ones are enforced while decoding (a grammar inside
    the batched engine), so the output always parses and, for json_schema, validates."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise _invalid(
                "response_format json_schema needs a 'json_schema' object with a 'schema'", at="json_schema", code="missing_required_parameter"
            )
        return self

    def constraint(self) -> dict[str, Any] | None:
        """The engine's Constraint (deployments.engines.constrained) as a dict, or None for text."""
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.type == "json_schema" and (schema := self.json_schema) is not None:  # not None: _schema_given
            return {"type": "json_schema", "schema": schema.schema_, "strict": bool(schema.strict)}
        return None


def object_schema_error(schema: dict[str, Any] | None) -> str | None:
    """Why a tool's parameters schema cannot describe a call's arguments, or None: the arguments
    are a JSON object, so the schema's type is "object" (or left out, meaning the same). Every
    protocol's tool model checks it (a forced call's grammar is built from it)."""
    if schema is None or schema.get("type", "object") == "object":
        return None
    return f"a function's parameters must be a JSON schema of type 'object' (its arguments are an object), not {schema['type']!r}"


class FunctionDefinition(_Part):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        error = object_schema_error(v)
        if error is not None:
            raise _invalid(error)
        return v


class Tool(_Part):
    type: Literal["function"]
    function: FunctionDefinition

    def as_dict(self) -> dict[str, Any]:
        """The OpenAI tool dict chat templates take (parameters default to an empty object schema)."""
        f = self.function
        out = {"name": f.name, "parameters": f.parameters if f.parameters is not None else {"type": "object", "properties": {}}}
        if f.description is not None:
            out["description"] = f.description
        return {"type": "function", "function": out}
