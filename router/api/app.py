"""The OpenAI- and Anthropic-compatible app: FastAPI routes (router/api/routes), the key check as
one dependency, errors from one set of handlers, all served by the `IngressDeployment`.

The ingress is stateless (several replicas may run): per request it asks the residency service for
a lease on an instance, streams straight from that instance's model-server actor (one channel per
actor carries all of this replica's streams, one Ray item per flush), and releases the lease at
the end, on error and on client disconnect (the generation is cancelled in the engine). A per-item
inactivity timeout keeps a frozen node from hanging a stream."""

from fastapi import Depends, FastAPI
from ray import serve

from router.api import errors
from router.api.auth import principal
from router.api.ingress import Ingress
from router.api.request_context import RequestContext
from router.api.routes import audio, chat, cluster, embeddings, health, messages, metrics, models, responses
from router.residency.service import ON_HEAD

app = FastAPI(title="Orchard", description="Many MLX models, one OpenAI- and Anthropic-compatible URL", version="0.1.0")
errors.install(app)
for family in (chat, messages, responses, embeddings, audio, models, cluster, metrics):
    app.include_router(family.router, dependencies=[Depends(principal)])
app.include_router(health.router)  # for load balancers: no key
app.add_middleware(RequestContext)


@serve.deployment(name="Ingress", max_ongoing_requests=500, ray_actor_options=ON_HEAD)
@serve.ingress(app)
class IngressDeployment(Ingress):
    def __del__(self):  # Serve calls it when the replica shuts down
        self.close()
