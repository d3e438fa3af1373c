"""What an ingress replica, the residency service and a node agent say to each other to count a
prompt's tokens (Anthropic's count_tokens) without loading anything.

- the residency service's `count_site` answers a `CountSite`: a ready instance's model server to
  ask, if there is one, and the places whose files hold the model's tokenizer (`TokenizerSite`), or
  a `Refusal` (deployments/wire/leases.py);
- a node agent's `count_tokens` takes a `CountOrder` and answers the count (an int)."""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deployments.wire.generation import GenerationRequest


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TokenizerSite(_Message):
    """A node whose files hold the model's folder, and where the folder is on that node."""

    node_id: str
    folder: str


class CountSite(_Message):
    """Where `model`'s prompts can be counted now, and what the ingress needs to build the model's
    request (the kind and output-parsing config a lease's Grant carries)."""

    model: str
    kind: str
    tool_parser: str | None = None
    reasoning: Any = None
    actor_name: str | None = None  # a ready instance's model server: its engine counts
    folders: list[TokenizerSite] = Field(default_factory=list)  # best first: a node's store, then the registry's path


class CountOrder(_Message):
    """Count `request`'s prompt tokens with the tokenizer in `folder`, on the agent's own node."""

    model: str
    folder: str
    request: GenerationRequest
