"""JSON answers, serialized once.

A route that returns a dict has FastAPI run `jsonable_encoder` over it first, which walks every value
in Python: for a 384-float embedding that was about half of the ingress's CPU per request (py-spy,
1-string embeddings on this VM). Orchard's bodies are built from JSON types already (the protocol
encoders and the model servers' answers), so the hot routes hand them to Starlette's JSONResponse,
which is one `json.dumps`."""

from typing import Any

from fastapi.responses import JSONResponse


def json_body(content: dict[str, Any] | list[Any], status_code: int = 200, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(content, status_code=status_code, headers=headers)
