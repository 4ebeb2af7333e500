"""The OpenAI-compatible HTTP gateway (FastAPI) in front of a serving backend (serving/backends).

app.create_app(backend, telemetry, GatewayConfig) builds the app; server.py runs it (`moa-serve serve`).
"""
