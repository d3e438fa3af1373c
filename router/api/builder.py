"""The app builder `serve run ray-config.yaml` imports (`router.api.builder:build_app`): the
`args:` validated here, before anything is deployed, so a wrong field fails `serve run` /
`serve deploy` at once with its name; then the residency service and the ingress, bound."""

from pathlib import Path
from typing import Annotated, Any, Literal

import ray
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve

from cluster.node_agent import alive_nodes
from cluster.serve_endpoints import serve_http_host
from deployments.engines.options import LLMEngineOptions
from policy import PolicyConfig
from router.api.app import IngressDeployment
from router.api.guard import is_loopback
from router.api.ingress import STREAM_WRITE_TIMEOUT_S
from router.api.keys import KeyEntry, Principal, resolve
from router.console.view import ConsoleSettings, facts_of
from router.protocols.responses.store import StoreSettings
from router.residency.registry import from_config, from_manifest, parse_entries
from router.residency.service import ResidencyService
from router.serving.output.parsing import OutputConfig


class AppArgs(BaseModel):
    """The `args:` of ray-config.yaml. Without `models`, every model of the prepared set in
    models_dir is registered (with `overrides` per model)."""

    model_config = ConfigDict(extra="forbid")

    models_dir: str = "models"
    models: list[dict] | None = None
    overrides: dict[str, dict] = Field(default_factory=dict)
    policy: dict = Field(default_factory=dict)
    chunk_timeout_s: float = Field(default=60.0, gt=0)
    # Ingress replicas on the head node (more than one: keys' limits still hold, counted by the
    # residency service), or "every_node": one on each node alive at deploy time, so that (each
    # serving HTTP itself under Serve's direct ingress) any node's address serves the whole API
    # (docs/cluster.md).
    ingress_replicas: Annotated[int, Field(ge=1)] | Literal["every_node"] = 1
    # An ingress replica routes requests through standing leases (router/serving/standing.py) and
    # gives one back after this many seconds with nothing in flight on it; 0: a lease per request,
    # asked of the residency service each time (one round trip: 3.4-4.4 ms on this VM).
    route_linger_s: float = Field(default=2.0, ge=0)
    # Among the standing leases an ingress holds on a model's copies, a request goes to the copy it
    # sent the longest beginning of the request's prompt to (its prefix cache likely holds it),
    # unless that copy has more than this many requests in flight beyond the least loaded copy's;
    # negative: always the least loaded (router/serving/affinity.py, docs/cluster.md).
    prefix_affinity_max_extra_in_flight: int = 4
    # A streamed response whose client takes none of a write for this long ends (its generation
    # cancelled if it still runs, its lease released) and its connection is reset (router/api/sse.py).
    stream_write_timeout_s: float = Field(default=STREAM_WRITE_TIMEOUT_S, gt=0)
    # Scoped keys (router/api/keys.py): {key_env | key_sha256, role, name, models, rpm, tpm, max_concurrent}
    api_keys: list[KeyEntry] = Field(default_factory=list)
    watch_period_s: float = Field(default=1.0, gt=0)
    # Deltas per Ray item from a model server: the first at once, then every N tokens or M ms.
    # 8 / 50 ms measured better than 4 / 25 ms through the full path (docs/serve-benchmark.md).
    coalesce_tokens: int = Field(default=8, ge=1)
    coalesce_ms: float = Field(default=50.0, ge=0)
    # ... stretched linearly to this at 16+ streams on one instance (docs/serve-benchmark.md).
    coalesce_max_ms: float = Field(default=100.0, ge=0)
    # The model-server actor's GIL switch interval: how long the engine thread can wait for the
    # GIL held by the event loop or Ray's threads (Python's default: 5 ms, a whole fast GPU step).
    # 0.1 ms: H200, 10M model, 64 streams 0.68 -> 0.93 of in-process; none lost on the CPU.
    gil_switch_ms: float | None = Field(default=0.1, gt=0)
    # The ingress replicas' GIL switch interval (None: Python's 5 ms), for the same reason: Ray's
    # threads hand submits and channel batches to and from the replica's event loop.
    ingress_gil_switch_ms: float | None = Field(default=None, gt=0)
    # The LLM engines' scheduling (deployments/engines/llm.py; measured in docs/serve-path.md).
    llm_engine: LLMEngineOptions = Field(default_factory=LLMEngineOptions)
    # Vision: image parts may be data: URLs; http(s) URLs only when the operator allows fetching.
    allow_remote_images: bool = False
    max_audio_bytes: int = Field(default=25 * 1024**2, ge=1)  # OpenAI's transcription limit
    # Every other request's body (JSON: a few images as data: URLs fit). Both limits are checked at
    # the door (router/api/guard.py): a larger Content-Length is a 413 before the body is read, and
    # any other body is cut off at the limit.
    max_request_bytes: int = Field(default=16 * 1024**2, ge=1)
    # Host names (the Host header) the API answers to, beyond localhost, IP literals and the nodes'
    # own host names (with and without .local); "*.example.com" for its subdomains; "*" for any
    # (behind a proxy that checks them). Others are a 421: a DNS-rebinding page's name is refused.
    allowed_hosts: list[str] = Field(default_factory=list)
    # A cap on each node-to-node copy of weights (bytes/s), so copies leave a shared link room for
    # serving traffic; None: as fast as the nodes go.
    fetch_max_bytes_per_s: float | None = Field(default=None, gt=0)
    # The Ray dashboard's address as a browser reaches it, for the console's links to each instance's
    # actor (docs/console.md); None: the address the dashboard records in Ray's GCS.
    dashboard_url: str | None = Field(default=None, pattern=r"^https?://")
    # Stored Responses (store / previous_response_id, kept in Ray's GCS key-value store): how long a
    # response is kept (ttl_s, 24 h), the most one may hold (max_response_bytes, 8 MiB: a larger
    # conversation to be stored is a 400) and all together (max_total_bytes, 256 MiB: the oldest
    # are deleted first). router/protocols/responses/store.py.
    responses_store: StoreSettings = Field(default_factory=StoreSettings)


def _field(e: ValidationError, prefix: str) -> str:
    first = e.errors()[0]
    return f"{prefix}{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"


def validate_args(args: dict) -> tuple[AppArgs, list[dict], list[Principal]]:
    """The args, the registry's entries and the API keys' principals (keys read from the
    environment and hashed here: only hashes reach the replicas), or a ValueError naming the field
    that is wrong."""
    try:
        a = AppArgs.model_validate(args)
    except ValidationError as e:
        raise ValueError(f"ray-config.yaml args: {_field(e, 'args.')}") from None
    try:
        PolicyConfig.model_validate(a.policy)
    except ValidationError as e:
        raise ValueError(f"ray-config.yaml args: {_field(e, 'args.policy.')}") from None
    models = a.models if a.models is not None else from_manifest(str(Path(a.models_dir).resolve()), a.overrides)
    try:
        entries = parse_entries(models)
    except ValueError as e:
        raise ValueError(f"ray-config.yaml args: {e}") from None
    unknown = sorted(set(a.overrides) - {m.name for m in entries})
    if unknown:
        raise ValueError(f"ray-config.yaml args.overrides: no model {', '.join(unknown)} in the registry")
    for i, m in enumerate(entries):
        try:
            OutputConfig(tool_parser=m.tool_parser, reasoning=m.reasoning)
        except (ValueError, ValidationError) as e:
            raise ValueError(f"ray-config.yaml args: models[{i}] ({m.name}).tool_parser / reasoning: {e}") from None
    try:
        principals = resolve(a.api_keys)
    except ValueError as e:
        raise ValueError(f"ray-config.yaml args.{e}") from None
    names = {m.name for m in entries}
    for i, key in enumerate(a.api_keys):
        unknown = sorted(set(key.models or ()) - names)
        if unknown:
            raise ValueError(f"ray-config.yaml args.api_keys[{i}] ({key.name}).models: no model {', '.join(unknown)} in the registry")
    return a, models, principals


def ingress_options(replicas: int | str) -> dict[str, Any]:
    """The ingress deployment's options: `replicas` on the head, or one on every alive node."""
    if replicas != "every_node":
        return {"num_replicas": replicas}
    if not ray.is_initialized():
        raise ValueError("ray-config.yaml args.ingress_replicas: every_node counts the nodes of a running Ray cluster; none is connected")
    return {"num_replicas": len(alive_nodes()), "max_replicas_per_node": 1, "ray_actor_options": {"num_cpus": 0}}


def check_exposure(principals: list[Principal], host: str | None) -> None:
    """Without an admin key, Orchard serves on loopback only: every route is open (no keys) or no
    one can operate it (user keys only), so another address is a ValueError naming why. `host`:
    where Serve's HTTP servers bind (None: not started yet, Serve's default 127.0.0.1)."""
    if host is None or is_loopback(host) or any(p.admin for p in principals):
        return
    raise ValueError(
        f"Serve's http_options.host is {host!r}, not a loopback address (the proxy and every node's direct-ingress port listen "
        "there), and no admin key is configured: anyone who reaches it could load, unload, pin, pull and delete models. "
        "Add an api_keys entry with role: admin (ray-config.yaml, docs/cluster.md), or serve on 127.0.0.1"
    )


def console_settings(models: list[dict], models_dir: str, policy: dict, dashboard_url: str | None, llm_engine: dict | None = None) -> ConsoleSettings:
    """What every ingress's console knows of the registry (kinds, roles, memory split, keep-warm; the
    residency service's catalog, read the same way) and where the Ray dashboard is."""
    catalog, _ = from_config(models, models_dir, llm_engine)
    config = PolicyConfig.model_validate(policy)
    return ConsoleSettings(models={name: facts_of(spec, config) for name, spec in catalog.items()}, dashboard_url=dashboard_url)


def build_app(args: dict) -> serve.Application:
    a, models, principals = validate_args(args)
    check_exposure(principals, serve_http_host())
    models_dir = str(Path(a.models_dir).resolve())
    server_options = {
        "coalesce_tokens": a.coalesce_tokens,
        "coalesce_ms": a.coalesce_ms,
        "coalesce_max_ms": a.coalesce_max_ms,
        "gil_switch_ms": a.gil_switch_ms,
        "llm_engine": a.llm_engine.model_dump(),
    }
    # mypy keeps a decorated class's own type: @serve.deployment made these Deployments, which have bind()
    residency = ResidencyService.bind(  # type: ignore[attr-defined]
        models, a.policy, models_dir, a.watch_period_s, server_options, fetch_max_bytes_per_s=a.fetch_max_bytes_per_s
    )
    return IngressDeployment.options(**ingress_options(a.ingress_replicas)).bind(  # type: ignore[attr-defined]
        residency,
        a.chunk_timeout_s,
        principals,
        allow_remote_images=a.allow_remote_images,
        max_audio_bytes=a.max_audio_bytes,
        max_request_bytes=a.max_request_bytes,
        allowed_hosts=tuple(a.allowed_hosts),
        route_linger_s=a.route_linger_s,
        prefix_affinity_max_extra_in_flight=a.prefix_affinity_max_extra_in_flight,
        stream_write_timeout_s=a.stream_write_timeout_s,
        gil_switch_ms=a.ingress_gil_switch_ms,
        console_settings=console_settings(models, models_dir, a.policy, a.dashboard_url, a.llm_engine.model_dump()),
        responses_store=a.responses_store.model_dump(),
    )
