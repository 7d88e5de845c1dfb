"""HTTP serving: an OpenAI-compatible speech API, saved voices, CosyVoice-style and WebSocket endpoints,
Prometheus metrics, a web page, Ray Serve scale-out and a Triton model repository.

Needs the `serve` extra (`pip install 'vocalis[serve]'`). Nothing is imported here, so `import vocalis.serve`
stays cheap; use `vocalis.serve.app.create_app` around `vocalis.serve.engine_backend.EngineBackend` (any
`vocalis.serve.backend.Backend` will do), and `vocalis.serve.server.make_server` to run it.
"""
