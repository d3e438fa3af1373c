"""The one pydantic base every policy type shares: immutable, no unknown fields."""

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    """Plain immutable data: the policy never mutates its inputs, it returns new values."""

    model_config = ConfigDict(frozen=True, extra="forbid")
