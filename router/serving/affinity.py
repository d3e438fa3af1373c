"""Prefix affinity: an ingress replica sends a request to the instance of its model that already
holds the longest beginning of its prompt, unless that instance is too much busier than the least
loaded one.

Each instance keeps its own prefix cache (deployments/engines/), so a conversation's next turn
prefills only its new messages where its earlier turns ran, and all of them anywhere else. This
replica cannot see those caches; it remembers what it sent where instead. A request's prefix keys
(`prefix_keys`) are rolling hashes of its prompt's beginnings: the part every turn repeats (the
tools, the leading system messages, the template's variables), then that plus each message in turn
(a raw completion's prompt: every 512 characters, or 128 token ids). A chat request that names its
conversation (`prompt_cache_key`: Codex sends its conversation id, the Messages route passes Claude
Code's `metadata.user_id`) has that key first, so a turn whose messages were rewritten (a compacted
history) still goes where its conversation ran, where at least its tools and system prompt are. Two requests share a key
exactly when they share that whole beginning. `PrefixHistory` holds, per instance incarnation
(node, loaded_at: a new incarnation starts empty, like its cache), the keys of the last requests
sent there, an LRU of a bounded number; `choose` weighs the longest known prefix against load. The
history is a guess: an instance's cache may have evicted a prefix, and another replica's requests
are not known here. A wrong guess costs only the prefill it hoped to save."""

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

Instance = tuple[str, float]  # (node_id, loaded_at): one incarnation of a model on a node

KEYS_PER_INSTANCE = 4096  # about 40 conversations of 100 messages per instance
INSTANCES = 64  # incarnations remembered (older ones are gone or idle: their caches with them)
CHUNK_CHARS = 512  # a raw prompt's key step: about one 128-token block of the prefix cache
CHUNK_TOKENS = 128


def _dump(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def prefix_keys(body: Any) -> tuple[int, ...]:
    """The request's prefix keys, shortest prefix first (empty when it has no prompt to key).
    `body` is a chat request (router.protocols.openai.ChatCompletionRequest: `messages`) or a
    completion request (`prompt`, text or token ids)."""
    messages = getattr(body, "messages", None)
    if messages is None:
        return _prompt_keys(getattr(body, "prompt", None))
    keys: list[int] = []
    conversation = getattr(body, "prompt_cache_key", None)
    if conversation:  # the client's conversation key (Codex's prompt_cache_key, Claude Code's metadata.user_id): its own first key
        keys.append(int.from_bytes(hashlib.blake2b(b"conversation\n" + conversation.encode(), digest_size=8).digest()))
    h = hashlib.blake2b(digest_size=8)
    h.update(_dump([body.chat_template_kwargs, body.reasoning_effort]))
    for tool in body.tools or ():  # pydantic's own JSON (its field order is fixed): 4x faster than json.dumps
        h.update(tool.model_dump_json(exclude_none=True).encode() + b"\n")
    rest = 0
    while rest < len(messages) and messages[rest].role in ("system", "developer"):
        h.update(messages[rest].model_dump_json(exclude_none=True).encode() + b"\n")
        rest += 1
    if rest or body.tools:  # a head worth a key of its own: what many conversations share
        keys.append(int.from_bytes(h.digest()))
    for message in messages[rest:]:
        h.update(message.model_dump_json(exclude_none=True).encode() + b"\n")
        keys.append(int.from_bytes(h.digest()))
    return tuple(keys)


def _prompt_keys(prompt: Any) -> tuple[int, ...]:
    if isinstance(prompt, str):
        step = CHUNK_CHARS
    elif isinstance(prompt, list):
        step = CHUNK_TOKENS
    else:
        return ()
    h = hashlib.blake2b(digest_size=8)
    keys = []
    for at in range(0, len(prompt) - step + 1, step):  # whole steps only: a partial one is the request's own
        h.update(_dump(prompt[at : at + step]))
        keys.append(int.from_bytes(h.digest()))
    return tuple(keys)


class PrefixHistory:
    """Per instance incarnation, the prefix keys of the requests this replica last sent there."""

    def __init__(self, keys_per_instance: int = KEYS_PER_INSTANCE, instances: int = INSTANCES):
        if keys_per_instance < 1 or instances < 1:
            raise ValueError("PrefixHistory needs room for at least one key and one instance")
        self.keys_per_instance = keys_per_instance
        self.instances = instances
        self._sent: OrderedDict[Instance, OrderedDict[int, None]] = OrderedDict()

    def match(self, instance: Instance, keys: Sequence[int]) -> int:
        """How many of `keys` (a request's, shortest prefix first) the longest prefix this replica
        sent to `instance` covers: 0 when it knows none of them."""
        sent = self._sent.get(instance)
        if not sent:
            return 0
        for n in range(len(keys), 0, -1):
            if keys[n - 1] in sent:
                return n
        return 0

    def note(self, instance: Instance, keys: Sequence[int]) -> None:
        """A request with these keys was sent to `instance`."""
        if not keys:
            return
        sent = self._sent.get(instance)
        if sent is None:
            sent = self._sent[instance] = OrderedDict()
            while len(self._sent) > self.instances:
                self._sent.popitem(last=False)
        else:
            self._sent.move_to_end(instance)
        for key in keys:
            sent[key] = None
            sent.move_to_end(key)
        while len(sent) > self.keys_per_instance:
            sent.popitem(last=False)


def choose(in_flight: Sequence[int], matches: Sequence[int], max_extra_in_flight: int) -> int:
    """The index of the instance a request goes to, given each one's requests in flight and the
    length of the request's prefix it is known to hold (`PrefixHistory.match`): among those whose
    in-flight count exceeds the least loaded one's by at most `max_extra_in_flight`, the longest
    match, the less loaded of equal matches, the first of equals. With no match anywhere (or a
    negative bound) that is the least loaded."""
    if not in_flight or len(in_flight) != len(matches):
        raise ValueError("choose needs one in-flight count and one match length per instance")
    least = min(in_flight)
    best = in_flight.index(least)
    for i, (load, match) in enumerate(zip(in_flight, matches, strict=True)):
        if load - least <= max_extra_in_flight and (match > matches[best] or (match == matches[best] and load < in_flight[best])):
            best = i
    return best


def outcome(chosen: int, longest: int) -> str:
    """What routing did with a request's known prefixes, for the metrics, from the match of the
    instance it went to and the longest match of those it could have gone to: `hit` (it went where
    the longest is), `overloaded` (it went elsewhere for load: that instance was too busy, or a
    fresh copy was taken) or `miss` (no prefix of it is known)."""
    if max(chosen, longest) == 0:
        return "miss"
    return "hit" if chosen >= longest else "overloaded"
