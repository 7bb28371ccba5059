import os

# Tests never touch the network: every model is built from a config.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

# The suite runs under pytest-xdist (pyproject's addopts: one worker per core, at most 4). Each worker uses one
# thread, so the workers' torch thread pools don't oversubscribe the cores; processes the tests start inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before xdist adds each group to the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests sharing a module-scoped fixture (a two-process training run, a loaded pipeline) run on one worker
    (``--dist loadgroup``), so the fixture is built once; every other test goes to whichever worker is free."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d and d[-1].scope in ("module", "package", "session") and d[-1].baseid for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
