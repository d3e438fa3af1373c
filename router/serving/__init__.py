"""From a parsed request to an engine call and back: leases, the stream mux, output parsing, renderers."""
