"""``deltafin serve``: the OpenAI-compatible HTTP server. ``protocol``: the wire format and request
validation (no HTTP, no engine); ``http``: listening and the header time limit; ``metrics``: the
Prometheus text format; ``prefix_cache``: decode states kept between requests; ``app``: the routes
and the engine's use."""
