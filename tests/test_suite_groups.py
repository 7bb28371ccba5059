"""The suite's own scheduling (tests/conftest.py): tests sharing a module-scoped fixture run on one xdist worker."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def shared() -> object:
    return object()


def test_a_test_with_a_module_fixture_runs_in_its_files_xdist_group(request, shared):
    """xdist writes a test's group into its id while collecting, so conftest's grouping must run before it; when it
    ran after (pytest-xdist 3.8), every worker built each two-process training run of test_distributed.py anew."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("checks xdist's grouping: run under the suite's default -n auto")
    assert request.node.nodeid.endswith("@tests/test_suite_groups.py"), request.node.nodeid
