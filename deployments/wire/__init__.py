"""What crosses a process boundary between Orchard's processes (ingress replicas, the residency
service, model servers, node agents): the messages both ends import from here, so neither reaches
into the other's modules (a protocol encoder need not import an engine, nor the residency service
the model server's internals).

- `failure`: the one failure type (`OrchardError`) and its code-to-status table;
- `generation`: a generation's request, the deltas a model server streams back (a TypedDict: the
  token path is hot) and its whole reply;
- `reports`: what a model server reports about itself (memory after a load and on asking, health);
- `results`: what it answers for embeddings, a rerank, a transcription.

Importing this package imports nothing of Orchard's but policy's kinds, and nothing heavy (no Ray,
no MLX): every process and every layer may use it."""
