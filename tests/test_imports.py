"""The import directions of proxy/DESIGN.md ("Import directions"), read from every module's AST.

- ``engines`` imports nothing of ``proxy``;
- in ``proxy``, only the composition root (``proxy.startup``, and
  ``proxy.__main__`` that starts it) imports ``engines``;
- the request path (``proxy.relay``, ``proxy.app``, ``proxy.entry``) imports no
  composition-root module;
- the leaves (every other module of ``proxy``) import neither the request
  path nor the composition root;
- outside ``proxy/relay/``, the relay is imported only through what its
  ``__init__`` exports;
- no module imports inside a function body, but for the few listed in
  ``LAZY`` with their reason.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (module, imported module): an import inside a function body, and why it waits.
LAZY = {
    # These run in the engine's own venv (python -m ...), where the packages are; the gateway's has none.
    ("engines.mlx_lm_server", "mlx_lm"): "mlx-lm, in the mlx engine's venv (the child's wrapper)",
    ("engines.mlx_lm_server", "mlx_lm.models"): "mlx-lm, in the mlx engine's venv (the child's wrapper)",
    ("engines.demo_model", "numpy"): "made inside the mlx engine's venv",
    ("engines.demo_model", "tokenizers"): "made inside the mlx engine's venv",
    ("engines.gguf_to_mlx", "tokenizers"): "converted inside the mlx engine's venv",
    ("engines.gguf_to_mlx", "mlx.core"): "converted inside the mlx engine's venv",
    ("engines.gguf_model", "numpy"): "made inside the llamacpp engine's venv",
    ("engines.gguf_model", "gguf"): "made inside the llamacpp engine's venv",
    # An optional dependency: without the uv wheel, uv is looked up on PATH.
    ("engines.install", "uv"): "optional; find_uv falls back to PATH",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> list[tuple[str, ast.Module]]:
    paths = sorted((*ROOT.glob("proxy/**/*.py"), *ROOT.glob("engines/**/*.py")))
    return [(module_name(p), ast.parse(p.read_text(), str(p))) for p in paths]


def imports(tree: ast.Module) -> Iterator[tuple[str, bool]]:
    """Each module imported (``from x import y`` as ``x.y`` and ``x``), and whether in a function body."""

    def visit(node: ast.AST, in_function: bool) -> Iterator[tuple[str, bool]]:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, in_function
            elif isinstance(child, ast.ImportFrom):
                # The house writes absolute imports only; a relative one is read as its own rule.
                base = child.module or ""
                yield ("." * child.level + base), in_function
                for alias in child.names:
                    yield f"{base}.{alias.name}", in_function
            yield from visit(child, inside)

    yield from visit(tree, False)


def kind(module: str) -> str:
    if module.startswith("engines"):
        return "engines"
    if module.startswith("proxy.startup") or module == "proxy.__main__":
        return "startup"
    if module.startswith("proxy.relay") or module in ("proxy.app", "proxy.entry"):
        return "request path"
    return "leaf"


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def broken_rules(module: str, imported: str, in_function: bool) -> list[str]:
    """What importing ``imported`` from ``module`` breaks, if anything."""
    mine, theirs = (
        kind(module),
        kind(imported) if within(imported, "proxy") or within(imported, "engines") else "",
    )
    broken = []
    if mine == "engines" and within(imported, "proxy"):
        broken.append("engines imports no proxy")
    if mine in ("request path", "leaf") and within(imported, "engines"):
        broken.append("only the composition root (proxy.startup) imports engines")
    if mine in ("request path", "leaf") and theirs == "startup":
        broken.append("nothing outside the composition root imports it")
    if mine == "leaf" and theirs == "request path":
        broken.append("the leaves import no request-path module")
    if imported.startswith("."):
        broken.append("imports are absolute")
    if _past_relay(module, imported):
        broken.append("outside proxy/relay/, import what proxy.relay exports")
    if (
        in_function
        and (module, imported) not in LAZY
        and not any((module, base) in LAZY for base in _parents(imported))
    ):
        broken.append("no import inside a function body (or list it in LAZY with its reason)")
    return broken


def _past_relay(module: str, imported: str) -> bool:
    """Outside the relay, ``proxy.relay.X`` where X is a name it exports; not ``proxy.relay.ticket``."""
    if not within(imported, "proxy.relay") or within(module, "proxy.relay") or imported == "proxy.relay":
        return False
    return imported.count(".") > 2 or not _exported(imported)


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


_RELAY_EXPORTS: set[str] = set()


def _exported(imported: str) -> bool:
    """``proxy.relay.X``: X is a name proxy/relay/__init__.py exports (not a submodule reached past it)."""
    if not _RELAY_EXPORTS:
        tree = ast.parse((ROOT / "proxy" / "relay" / "__init__.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                _RELAY_EXPORTS.update(ast.literal_eval(node.value))
    return imported.rsplit(".", 1)[1] in _RELAY_EXPORTS


def test_every_module_imports_only_in_the_allowed_directions() -> None:
    found = modules()
    assert len(found) > 40  # the walk sees the packages
    problems = [
        f"{module} imports {imported}: {rule}"
        for module, tree in found
        for imported, in_function in imports(tree)
        for rule in broken_rules(module, imported, in_function)
    ]
    assert problems == []


def test_every_lazy_import_listed_is_still_there() -> None:
    seen = {
        (module, imported)
        for module, tree in modules()
        for imported, in_function in imports(tree)
        if in_function
    }
    assert set(LAZY) <= seen


@pytest.mark.parametrize(
    ("module", "imported", "rule"),
    [
        ("engines.registry", "proxy.routing", "engines imports no proxy"),
        ("proxy.relay.handler", "engines.spec", "only the composition root (proxy.startup) imports engines"),
        ("proxy.payload", "engines.spec", "only the composition root (proxy.startup) imports engines"),
        ("proxy.app", "proxy.startup.settings", "nothing outside the composition root imports it"),
        ("proxy.routing", "proxy.relay", "the leaves import no request-path module"),
        ("proxy.startup.cli", "proxy.relay.ticket", "outside proxy/relay/, import what proxy.relay exports"),
        (
            "proxy.startup.cli",
            "proxy.relay.ticket.Ticket",
            "outside proxy/relay/, import what proxy.relay exports",
        ),
        ("proxy.relay.handler", ".ticket", "imports are absolute"),
    ],
)
def test_each_rule_catches_what_it_forbids(module: str, imported: str, rule: str) -> None:
    assert rule in broken_rules(module, imported, False)


def test_an_unlisted_import_in_a_function_body_is_caught() -> None:
    tree = ast.parse("def f():\n    from engines import spec\n")
    (found,) = [broken_rules("proxy.startup.cli", m, f) for m, f in imports(tree) if m == "engines"]
    assert found == ["no import inside a function body (or list it in LAZY with its reason)"]
    assert broken_rules("proxy.startup.cli", "engines.spec", False) == []
