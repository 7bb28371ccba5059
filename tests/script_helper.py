"""scripts/*.py as modules, for tests that call a script's ``main`` or its helpers in this process (scripts/ is no
package, so they are loaded from their files)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str, *, register: bool = False) -> ModuleType:
    """``scripts/<name>.py`` executed as a fresh module named ``name``. ``register`` also enters it in
    ``sys.modules`` under that name, as dataclasses defined in it (which look their module up) and other scripts
    importing it by name need."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
