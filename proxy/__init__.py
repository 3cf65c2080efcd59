"""blazar-proxy's request path: an OpenAI-compatible relay in front of engine servers."""

__version__ = "0.1.0"
