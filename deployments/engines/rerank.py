"""The rerank engine: scores one query against many documents, for a Cohere/Jina-style /v1/rerank.

Two scoring modes, chosen by what the model folder is:
- cross-encoder (config architectures *ForSequenceClassification, BERT): the pair
  [CLS] query [SEP] doc [SEP] runs through mlx-embeddings' BERT and the checkpoint's own
  classifier on the pooled [CLS]; the score is sigmoid(logit), sentence-transformers' default.
- bi-encoder (a sentence-transformers embedding folder with mean pooling, e.g. all-MiniLM-L6-v2):
  cosine of the mean-pooled, normalised embeddings. The stand-in that gives real relevance
  ordering with the only real weights that exist here.
Documents are tokenized once, sorted by length and run in padded batches with an attention mask,
so padding never changes a score. Every MLX and tokenizer call runs on the engine's worker."""

import json
from pathlib import Path
from typing import Literal

import deployments  # noqa: F401  (OpenBLAS before MLX)

# isort: split
import mlx.core as mx
import mlx.nn as nn
import numpy as np

from deployments.engine import RequestError
from deployments.engines.encoder import EncoderEngine, mean_pooled_embeddings, run_batches
from deployments.wire.results import RerankItem, RerankResult, RerankUsage

Mode = Literal["cross-encoder", "bi-encoder"]


class CrossEncoder(nn.Module):
    """Hugging Face BertForSequenceClassification: `bert` (mlx-embeddings' BERT, pooler included)
    + `classifier`. Same module names as the checkpoint, so its weights load strictly, unrenamed."""

    def __init__(self, args):
        super().__init__()
        from mlx_embeddings.models import bert

        self.bert = bert.Model(args)
        self.classifier = nn.Linear(args.hidden_size, 1)

    def __call__(self, input_ids, token_type_ids, attention_mask):
        pooled = self.bert(input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask).pooler_output
        return self.classifier(pooled)[:, 0]

    def sanitize(self, weights: dict) -> dict:
        return {k: v for k, v in weights.items() if "position_ids" not in k}


def scoring_mode(path: str | Path) -> Mode:
    """Cross-encoder for a sequence-classification checkpoint, bi-encoder for a mean-pooling
    sentence-embedding folder; anything else is refused at load rather than scored wrongly."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    if any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or []):
        if config.get("model_type") != "bert" or len(config.get("id2label") or {0: ""}) != 1:
            raise ValueError("only single-label BERT cross-encoders are supported")
        return "cross-encoder"
    pooling = path / "1_Pooling" / "config.json"
    if pooling.exists() and json.loads(pooling.read_text()).get("pooling_mode_mean_tokens"):
        return "bi-encoder"
    raise ValueError(f"{path} is neither a cross-encoder nor a mean-pooling sentence-embedding model")


class RerankEngine(EncoderEngine):
    kind = "rerank"

    def __init__(self, name: str, path: str, *, max_documents: int = 1000, max_length: int | None = None, batch_size: int = 32):
        super().__init__(name, path, max_length=max_length, batch_size=batch_size)
        self.max_documents = max_documents

    def _load_model(self, path: Path) -> None:
        from mlx_embeddings.models import bert
        from mlx_embeddings.tokenizer_utils import load_tokenizer
        from mlx_embeddings.utils import load, load_model

        self.mode = scoring_mode(path)
        if self.mode == "cross-encoder":
            self.model = load_model(path, get_model_classes=lambda config: (CrossEncoder, bert.ModelArgs, None, None))
            self.tokenizer = load_tokenizer(path)
        else:
            self.model, self.tokenizer = load(str(path))

    async def rerank(self, query: str, documents: list[str], *, top_n: int | None = None) -> RerankResult:
        self._check_ready()
        self._validate(query, documents, top_n)
        try:
            scores, tokens = await self._run(self._score, query, list(documents))
        except RequestError:
            raise
        except Exception as e:  # one bad request must not take the engine down
            raise RequestError("internal", f"rerank failed: {type(e).__name__}: {e}") from e
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: top_n or len(scores)]
        return RerankResult(
            model=self.name,
            results=tuple(RerankItem(index=i, relevance_score=float(scores[i])) for i in order),
            usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
        )

    def _validate(self, query, documents, top_n) -> None:
        if not isinstance(query, str) or not query.strip():
            raise RequestError("invalid_request", "query must be a non-empty string", "query")
        if not isinstance(documents, (list, tuple)) or not documents:
            raise RequestError("invalid_request", "documents must be a non-empty list of strings", "documents")
        if len(documents) > self.max_documents:
            raise RequestError("invalid_request", f"at most {self.max_documents} documents per request, got {len(documents)}", "documents")
        bad = next((i for i, d in enumerate(documents) if not isinstance(d, str)), None)
        if bad is not None:
            raise RequestError("invalid_request", f"documents[{bad}] must be a string", "documents")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
            raise RequestError("invalid_request", f"top_n must be an integer >= 1, got {top_n!r}", "top_n")

    def _score(self, query: str, documents: list[str]) -> tuple[np.ndarray, int]:
        """On the worker: one score per document, and the number of tokens run."""
        if self.mode == "bi-encoder":
            vectors, tokens = mean_pooled_embeddings(self.model, self.tokenizer, [query, *documents], self.max_length, self.batch_size)
            return vectors[1:] @ vectors[0], tokens
        enc = self.tokenizer([query] * len(documents), documents, truncation=True, max_length=self.max_length)
        ids = enc["input_ids"]
        scores = run_batches(
            ids,
            enc.get("token_type_ids"),
            self.batch_size,
            self.tokenizer.pad_token_id or 0,
            lambda input_ids, types, mask: mx.sigmoid(self.model(input_ids, types, mask)),
        )
        return np.array(scores), sum(len(x) for x in ids)
