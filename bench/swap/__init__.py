"""`python -m bench.swap` (make bench-swap): more models than fit, with requests for all of them,
Orchard against vllm-mlx's multi-model registry on the same budget (bench/swap/__main__.py)."""
