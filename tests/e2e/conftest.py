"""The kind end-to-end tests: ``make e2e`` (``pytest -m e2e tests/e2e``)."""

from __future__ import annotations


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "e2e: end to end on a kind cluster (needs docker with a daemon, kind and kubectl)"
    )
