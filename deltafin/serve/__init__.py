"""``deltafin serve``: the OpenAI-compatible HTTP server. ``protocol``: the wire format and request
validation (no HTTP, no engine); ``http``: listening and the header time limit; ``metrics``: the
Prometheus text format; ``admission``: the engine's slots and wait queue; ``memo``: answers to
deterministic requests; ``prefix_cache``: decode states kept between requests; ``server_metrics``:
the server's counters and gauges; ``service``: the model's use by requests; ``app``: the routes and
one generation's HTTP response; ``cli``: the ``deltafin serve`` command."""
