"""The HTTP face: the FastAPI app, its routes (one module per endpoint family), auth and error handlers."""
