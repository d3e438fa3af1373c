"""A chat request's prompt tokens, counted exactly and without a lease (Anthropic's count_tokens).

A lease on a model that is not loaded places and loads it (a swap, when room must be made) and
waits behind the residency queue: too dear for a count, which Claude Code asks for often. So a count
asks the residency service only where it can be made now (router/residency/counting.py, which
changes nothing) and then asks, in order:

- a ready instance's model server, whose engine tokenizes it as it would for a generation;
- else (or when that instance went away meanwhile) the node agent of a node that has the model's
  folder: it renders the same request with the folder's tokenizer and chat template and no weights
  (deployments/engines/prompt_tokens.py, the function the engine itself tokenizes with), so the
  count equals the prompt_tokens a generation of the same request reports. The agent, not this
  process, reads the folder: it runs on every node, beside the node's store, and an ingress replica
  may run on a node that holds no model files.

The request the model gets is built as for a generation (router/serving/generation.py `prepare`:
tools, past tool calls in the model's family, the Anthropic translation's billing-line
normalisation before it), so what is counted is what would be fed."""

import asyncio
from typing import Any

import ray

from cluster.node_agent import NAMESPACE, agent_name
from deployments.failures import unwrap
from deployments.wire.counting import CountOrder, CountSite
from deployments.wire.failure import OrchardError
from deployments.wire.generation import GenerationRequest
from deployments.wire.leases import Refusal
from router.protocols import openai as oai
from router.serving.generation import prepare
from router.serving.lease import note_rate_limit

# What a place that could not count says when the next place may: the instance or agent went away
# or is stopping, or the folder is not on that node after all.
_TRY_NEXT = ("unavailable", "model_unavailable", "engine_stopped", "files_not_stored")


class Counter:
    """One ingress replica's counts: the residency service's answer, then the places it names,
    with the actor handles found by name kept (a name is one incarnation's; a failed one is dropped)."""

    def __init__(self, residency: Any):
        self.residency = residency
        self._handles: dict[str, Any] = {}

    async def count(self, chat: oai.ChatCompletionRequest, tenant: dict[str, Any] | None, *, allow_remote_images: bool) -> int:
        """The prompt tokens of `chat` on its model, counted by its own tokenizer; OrchardError for a
        model that is not there or cannot count (model_not_found, model_not_supported,
        files_not_stored when it is not loaded and no node has its files) and for a request it refuses."""
        site = await self.residency.count_site.remote(chat.model, tenant)
        if isinstance(site, Refusal):
            note_rate_limit(site.ratelimit)
            raise site.error()
        if site.kind != "llm":
            raise OrchardError("model_not_supported", f"model {chat.model} is a {site.kind} model: count_tokens counts text models' prompts", "model")
        request, _ = prepare(site, chat, allow_remote_images=allow_remote_images)
        assert isinstance(request, GenerationRequest)  # an llm's
        if site.actor_name is not None:
            counted = await self._ask(site.actor_name, lambda actor: actor.count_tokens.remote(request))
            if counted is not None:
                return counted
        for place in site.folders:
            order = CountOrder(model=site.model, folder=place.folder, request=request)
            counted = await self._ask(agent_name(place.node_id), lambda agent, order=order: agent.count_tokens.remote(order))
            if counted is not None:
                return counted
        raise _no_files(site)

    async def _ask(self, name: str, call: Any) -> int | None:
        """`call` on the actor `name`: its count, or None when the next place should be tried."""
        handle = self._handles.get(name)
        if handle is None:
            try:
                handle = self._handles[name] = await asyncio.to_thread(ray.get_actor, name, NAMESPACE)
            except ValueError:  # no actor of that name (any more)
                return None
        try:
            return int(await call(handle))
        except Exception as e:
            error = unwrap(e)
            if error.code not in _TRY_NEXT:
                raise error from None
            self._handles.pop(name, None)
            return None


def _no_files(site: CountSite) -> OrchardError:
    return OrchardError(
        "files_not_stored",
        f"model {site.model} is not loaded and no node could read its tokenizer to count with (count_tokens loads nothing)",
        "model",
    )
