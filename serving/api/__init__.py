"""The OpenAI wire pieces shared by the gateway, the backends and the edge routes: request-body parsing
(body.py), OpenAI-shaped errors (errors.py), tool calling (tools.py: prompt rendering, call grammar,
output parsing)."""
