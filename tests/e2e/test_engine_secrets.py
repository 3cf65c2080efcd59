"""The gateway's secrets stay out of the real engine child's environment (mlx-0.32.0, builtin:tiny)."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_engine_mlx import DEMO, start_engine_gateway


def test_the_api_key_never_reaches_an_engine_childs_environment(
    logs_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BLAZAR_API_KEY and the gateway's other settings are not in /proc/<child>/environ; the key guards."""
    secret = f"sk-{uuid.uuid4().hex}"
    key_file = tmp_path / "keys"
    key_file.write_text("sk-from-the-file\n")
    monkeypatch.setenv("BLAZAR_API_KEY", secret)
    monkeypatch.setenv("BLAZAR_API_KEY_FILE", str(key_file))
    monkeypatch.setenv("BLAZAR_CORS_ORIGIN", "https://app.example.com")
    gateway = start_engine_gateway(logs_dir)
    try:
        assert b"mlx_lm_server.py" in Path(f"/proc/{gateway.child_pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{gateway.child_pid}/environ").read_bytes()
        names = {entry.split(b"=", 1)[0] for entry in environ.split(b"\0") if entry}
        # What the child needs still reaches it: its venv's PATH, the test run's mark.
        assert b"PATH" in names and b"BLAZAR_TEST_RUN" in names
        assert not [name for name in names if name.upper().startswith(b"BLAZAR_API_KEY")]
        assert b"BLAZAR_CORS_ORIGIN" not in names
        assert secret.encode() not in environ
        assert str(key_file).encode() not in environ
        # The key still guards the gateway, and the child still generates.
        body = {"model": DEMO, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        with httpx.Client(trust_env=False, timeout=60) as http:
            url = gateway.url + "/v1/chat/completions"
            assert http.post(url, json=body).status_code == 401
            answered = http.post(url, json=body, headers={"authorization": f"Bearer {secret}"})
            assert answered.status_code == 200, answered.text
            assert answered.json()["choices"][0]["message"]["content"]
    finally:
        gateway.stop()
