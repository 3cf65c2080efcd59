"""blazar-proxy's request path: an OpenAI-compatible relay in front of engine servers."""

from proxy import compiled

__version__ = "0.1.0"

# Before any module of the request path is imported: its compiled build, or its sources.
compiled.use()
