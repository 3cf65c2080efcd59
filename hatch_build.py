"""The wheel's build hook: the request path compiled by mypyc (``proxy/compiled.py`` says what and why).

``pip install .`` compiles ``MODULES`` in a copy of the sources and puts the
extensions in the wheel beside them; ``pip install -e .`` puts them beside the
sources themselves (an edit makes them stale: ``proxy/compiled.py`` then
imports the sources, and the next ``pip install -e .`` compiles them again).
Where it cannot compile (no C compiler, no Python headers) the wheel is the
sources alone, interpreted, and says why; ``BLAZAR_INTERPRETED=1`` at install
asks for that.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


def _compiled_module(root: Path) -> Any:
    """``proxy/compiled.py``, read without importing the package (its dependencies are not here)."""
    spec = importlib.util.spec_from_file_location("_blazar_compiled", root / "proxy" / "compiled.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CompiledRequestPath(BuildHookInterface):  # type: ignore[misc]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        root = Path(self.root)
        compiled = _compiled_module(root)
        editable = version == "editable"
        if editable:
            self._remove_in_place(root, compiled)
        if os.environ.get("BLAZAR_INTERPRETED", "0") not in ("", "0"):
            self.app.display_info("blazar-proxy: BLAZAR_INTERPRETED is set: the request path is not compiled")
            return
        self._work = Path(tempfile.mkdtemp(prefix="blazar-compiled-"))
        try:
            built = compiled.compile_modules(root, self._work)
        except (RuntimeError, OSError) as e:
            self.app.display_warning(
                "blazar-proxy: the request path could not be compiled, so it runs interpreted "
                "(compiled: about 40 % less CPU a request). A C compiler and Python's headers "
                f"compile it.\n{e}"
            )
            return
        record = compiled.manifest(root, compiled.MODULES)
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if editable:
            for name in built:
                shutil.copy2(self._work / name, root / name)
            (root / "proxy" / compiled.MANIFEST).write_text(record)
            return
        (self._work / "proxy" / compiled.MANIFEST).write_text(record)
        for name in [*built, Path("proxy") / compiled.MANIFEST]:
            build_data["force_include"][str(self._work / name)] = str(name)

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        work = getattr(self, "_work", None)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)

    @staticmethod
    def _remove_in_place(root: Path, compiled: Any) -> None:
        """An editable install's earlier extensions and their record, before this one's."""
        (root / "proxy" / compiled.MANIFEST).unlink(missing_ok=True)
        for path in [*root.glob(f"{compiled.GROUP}__mypyc.*"), *root.glob("proxy/**/*.so")]:
            path.unlink()
