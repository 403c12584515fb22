"""The OpenAI-compatible HTTP API: routes, request schemas, preprocessing, response bodies, metrics."""
