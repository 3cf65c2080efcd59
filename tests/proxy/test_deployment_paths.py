"""Azure OpenAI's deployment paths, as the relay's own paths (pure)."""

from __future__ import annotations

import pytest

from proxy.relay import ENDPOINTS, deployment_path


@pytest.mark.parametrize(
    ("path", "relayed"),
    [
        ("/openai/deployments/qwen/chat/completions", "/v1/chat/completions"),
        ("/openai/deployments/org%2Fm/completions", "/v1/completions"),
        ("/v1/deployments/qwen/embeddings", "/v1/embeddings"),
        ("/openai/deployments/qwen/images/generations", None),
        ("/openai/deployments/qwen", None),
        ("/openai/deployments//chat/completions", "/v1/chat/completions"),
        ("/deployments/qwen/chat/completions", None),
        ("/v1/chat/completions", None),
    ],
)
def test_a_deployment_path_stands_for_the_relayed_endpoint(path: str, relayed: str | None) -> None:
    """``…/deployments/NAME/ENDPOINT`` is ``/v1/ENDPOINT`` for the relayed endpoints only."""
    assert deployment_path(path) == relayed
    assert relayed is None or relayed in ENDPOINTS
