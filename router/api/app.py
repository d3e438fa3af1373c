"""The OpenAI- and Anthropic-compatible app: FastAPI routes (router/api/routes), the request's door
(router/api/guard.py: Host, the key, cross-site POSTs and body size, all from the headers before the
body is read), errors from one set of handlers, all served by the `IngressDeployment`, through the
Serve proxy and on each replica's own direct-ingress port alike (both call this app).

The ingress is stateless (several replicas may run): per request it asks the residency service for
a lease on an instance, streams straight from that instance's model-server actor (one channel per
actor carries all of this replica's streams, one Ray item per flush), and releases the lease at
the end, on error and on client disconnect (the generation is cancelled in the engine). A per-item
inactivity timeout keeps a frozen node from hanging a stream."""

from typing import Any

from fastapi import Depends, FastAPI
from fastapi.routing import APIRoute
from ray import serve

from cluster.ray_api import on_head
from cluster.serve_endpoints import node_host_names
from router.api import errors, guard
from router.api.auth import principal
from router.api.ingress import Ingress
from router.api.keys import Principal
from router.api.request_context import RequestContext
from router.api.routes import audio, chat, cluster, console, embeddings, health, messages, metrics, models, responses
from router.console.view import ConsoleSettings
from router.protocols.responses.store import StoreSettings

app = FastAPI(title="Orchard", description="Many MLX models, one OpenAI- and Anthropic-compatible URL", version="0.1.0")
errors.install(app)
for family in (chat, messages, responses, embeddings, audio, models, cluster, console, metrics):
    app.include_router(family.router, dependencies=[Depends(principal)])
app.include_router(health.router)  # for load balancers: no key
app.include_router(console.pages)  # the console's page and files: no key (the page asks for it)
app.add_middleware(RequestContext)
KEYLESS = frozenset(
    [r.path for r in health.router.routes if isinstance(r, APIRoute)]
    + [p for p in (app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url) if p]
    + list(console.KEYLESS_PATHS)
)
app.add_middleware(guard.Guard, routes=app.router, keyless=KEYLESS, uploads=frozenset({audio.TRANSCRIPTIONS}))  # outermost


@serve.deployment(name="Ingress", max_ongoing_requests=500, ray_actor_options=on_head())
@serve.ingress(app)
class IngressDeployment(Ingress):
    def __init__(
        self,
        residency: Any,
        chunk_timeout_s: float = 60.0,
        principals: list[Principal] | None = None,
        *,
        max_request_bytes: int = guard.GuardSettings().max_request_bytes,
        allowed_hosts: tuple[str, ...] = (),
        console_settings: ConsoleSettings | None = None,
        responses_store: dict[str, Any] | None = None,
        **options: Any,
    ):
        super().__init__(residency, chunk_timeout_s, principals, **options)
        console.configure(console_settings)
        responses.configure(StoreSettings.model_validate(responses_store or {}))
        names = {h.lower().rstrip(".") for h in allowed_hosts} | node_host_names()
        guard.configure(
            guard.GuardSettings(max_request_bytes=max_request_bytes, max_audio_bytes=self.max_audio_bytes, allowed_hosts=frozenset(names))
        )

    def __del__(self):  # Serve calls it when the replica shuts down
        self.close()
