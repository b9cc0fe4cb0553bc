"""The shared stacks with the response leg in the worker (``serve --response-leg worker``), for the test
files that run other files' tests through it (``test_response_leg*.py``): import the fixtures, and
``borrow`` the tests."""

from __future__ import annotations

import inspect

import pytest
from conftest import agent, plain

from derender.ops import envoy_config


@pytest.fixture(scope="module")
def plain_stack(qwen3_dir, script):
    """``conftest.plain_stack`` with the response leg in the worker."""
    s = plain(qwen3_dir, script, leg=True)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def agent_stack(qwen3_dir, tmp_path_factory):
    """``conftest.agent_stack`` with the response leg in the worker."""
    s = agent(qwen3_dir, tmp_path_factory, leg=True)
    yield s
    s.stop()


def with_the_leg(start_envoy):
    """``start_envoy`` (``stack.start_envoy``'s signature) giving every Envoy the leg's config too."""

    def leg_envoy(port, producer, *more, edit=None, **values):
        def both(config):
            if edit is not None:
                edit(config)
            envoy_config.response_leg(config)

        return start_envoy(port, producer, *more, edit=both, **values)

    return leg_envoy


def borrow(module, into: dict, uses: set[str], prefix: str = "", leave: frozenset[str] = frozenset()) -> None:
    """Into ``into`` (a test file's globals), as ``test_<prefix>...``: ``module``'s tests that ask for a
    fixture of ``uses``, less those named in ``leave`` or asking for a fixture named there."""
    for name, test in list(vars(module).items()):
        if not (name.startswith("test_") and callable(test)) or name in leave:
            continue
        asked = set(inspect.signature(test).parameters)
        if uses & asked and not leave & asked:
            into["test_" + prefix + name[len("test_") :]] = test
