"""The chunks of an OpenAI-style server-sent-events body, as the benchmarks' clients read it."""

import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any


class Chunks:
    """`async for chunk in Chunks(response.content)`: each `data:` line's JSON, in order, until
    `data: [DONE]` (then `done` is True; a body that ends without it leaves `done` False)."""

    def __init__(self, lines: AsyncIterable[bytes]):
        self.lines = lines
        self.done = False

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        async for line in self.lines:
            if not line.startswith(b"data: "):
                continue
            if line.startswith(b"data: [DONE]"):
                self.done = True
                return
            yield json.loads(line[6:])
