"""Shared fixtures for all test rings."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# The suite's own process loads native libraries in process (llama.cpp through llama-cpp-python, torch, Ray's core
# worker), whose threads may still run while CPython finalizes: once, after every test had passed, the integration
# run's process died there (a segfault on a non-main thread's stack, jumping into freed heap), and `make test` failed
# on a run that had passed. The outcome is known by then: the main process writes its report, then leaves without
# finalizing (xdist's workers are left to end as xdist ends them).
_EXIT_STATUS = pytest.StashKey[int]()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or _EXIT_STATUS not in config.stash:
        return
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(config.stash[_EXIT_STATUS])
