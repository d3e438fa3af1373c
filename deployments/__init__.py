"""MLX engines and the model-server actor (issues 3 and 4). Empty until then."""
