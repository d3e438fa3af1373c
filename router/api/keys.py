"""API keys as ray-config.yaml lists them, and who a request's key says it is.

    api_keys:
      - {key_env: ORCHARD_ADMIN_KEY, role: admin, name: ops}
      - {key_sha256: 9f86d0..., role: user, name: team-a, models: [qwen3-8b, bge-m3], rpm: 600, tpm: 200000, max_concurrent: 16}

A key never appears plain in the config, the Serve deployment's arguments (the dashboard shows
those), the logs or the events: `key_env` names the environment variable `serve run` reads it from,
`key_sha256` gives its SHA-256 (hex); the app builder turns both into hashes, and only hashes reach
the ingress replicas. A request's key is hashed and compared in constant time."""

import hashlib
import hmac
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Role = Literal["admin", "user"]


class KeyEntry(BaseModel):
    """One `api_keys:` entry. rpm / tpm / max_concurrent are the key's limits, counted across every
    ingress replica by the residency service (router/residency/limits.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=100)
    role: Role = "user"
    key_env: str | None = Field(default=None, min_length=1)
    key_sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")
    models: tuple[str, ...] | None = None  # a user key may use only these (others are a 404: names do not leak)
    rpm: int | None = Field(default=None, ge=1)
    tpm: int | None = Field(default=None, ge=1)
    max_concurrent: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _one_source(self) -> "KeyEntry":
        if (self.key_env is None) == (self.key_sha256 is None):
            raise ValueError("give exactly one of key_env (an environment variable holding the key) or key_sha256 (its SHA-256)")
        return self


class Principal(BaseModel):
    """Who a request is: a key's name, role and models, or `anonymous` when no keys are configured."""

    model_config = ConfigDict(frozen=True)

    name: str
    role: Role
    models: frozenset[str] | None = None
    key_sha256: str = ""
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    def may_use(self, model: str) -> bool:
        return self.admin or self.models is None or model in self.models

    def tenant(self) -> dict | None:
        """What the residency service counts this key's requests by (router/residency/limits.py)."""
        if self.rpm is None and self.tpm is None and self.max_concurrent is None:
            return None
        return {"name": self.name, "rpm": self.rpm, "tpm": self.tpm, "max_concurrent": self.max_concurrent}


OPEN = Principal(name="anonymous", role="admin")  # no keys configured: the embedded default, on 127.0.0.1


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def resolve(entries: list[KeyEntry], environ: dict[str, str] | None = None) -> list[Principal]:
    """The principals of `entries`, keys read from the environment and hashed. A ValueError names the
    entry whose variable is unset or whose names repeat."""
    environ = dict(os.environ) if environ is None else environ
    out: list[Principal] = []
    for i, e in enumerate(entries):
        if e.key_env is not None:
            value = environ.get(e.key_env, "")
            if not value:
                raise ValueError(f"api_keys[{i}] ({e.name}): the environment variable {e.key_env} is not set where `serve run` runs")
            sha = digest(value)
        else:
            assert e.key_sha256 is not None
            sha = e.key_sha256.lower()
        if any(p.name == e.name for p in out):
            raise ValueError(f"api_keys[{i}]: the name {e.name!r} is listed twice")
        models = frozenset(e.models) if e.models is not None else None
        out.append(Principal(name=e.name, role=e.role, models=models, key_sha256=sha, rpm=e.rpm, tpm=e.tpm, max_concurrent=e.max_concurrent))
    return out


def identify(given: str, principals: list[Principal]) -> Principal | None:
    """The principal whose key `given` is (constant time over every key), or None."""
    sha = digest(given).encode()
    found = None
    for p in principals:
        if hmac.compare_digest(sha, p.key_sha256.encode()):
            found = p
    return found
