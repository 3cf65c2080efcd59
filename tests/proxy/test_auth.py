"""ApiKeys as a pure object: matching, schemes, and never showing a key."""

from __future__ import annotations

from pathlib import Path

from proxy.auth import ApiKeys, read_key_file


def scope(*headers: tuple[bytes, bytes]) -> dict[str, object]:
    return {"headers": list(headers)}


def test_bearer_and_x_api_key_match() -> None:
    """Either header with a configured key is allowed; the scheme is case-insensitive."""
    keys = ApiKeys(["k1", "k2"])
    assert keys.allows(scope((b"authorization", b"Bearer k1")))
    assert keys.allows(scope((b"authorization", b"BEARER  k2 ")))
    assert keys.allows(scope((b"x-api-key", b"k2")))
    assert keys.allows(scope((b"api-key", b"k1")))  # Azure OpenAI's header
    assert not keys.allows(scope((b"api-key", b"k3")))
    assert not keys.allows(scope((b"authorization", b"Bearer k3")))
    assert not keys.allows(scope((b"authorization", b"Token k1")))
    assert not keys.allows(scope())


def test_no_keys_is_falsy_and_repr_hides_keys() -> None:
    """An empty key set disables checking; repr never shows a key."""
    assert not ApiKeys(["", "  "])
    keys = ApiKeys(["secret-value"])
    assert keys and "secret-value" not in repr(keys)


def test_key_file_skips_comments_and_blanks(tmp_path: Path) -> None:
    """A key file holds one key per line; blank lines and # comments are skipped."""
    path = tmp_path / "keys"
    path.write_text("# comment\n k1 \n\n  # indented comment\nk2\n")
    assert read_key_file(path) == ["k1", "k2"]
