"""One module per endpoint family; each binds typed bodies and calls the serving layer."""
