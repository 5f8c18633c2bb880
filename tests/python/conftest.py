"""pytest setup: vLLM 0.33.0 from the cache, stand-ins for its heavy imports, the driver.

Order matters and is fixed here, before any test module imports vLLM:
1. ``stubs/`` goes first on ``sys.path`` (the metadata-only ``torch``) and the placeholder
   packages are registered (``kvtier_placeholders.VLLM_STAND_INS``);
2. ``harness`` installs the switchable ``time.monotonic``;
3. the vLLM sources: ``$KVTIER_VLLM_SRC`` (set by cli/tests/python_suite.rs after its fetch
   step), else ``fetch_vllm.ensure()`` (downloads into the cache on first use).

Every test is checked for vLLM region files it leaves in ``/dev/shm`` (see
:func:`no_vllm_region_left_behind`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "stubs"))

import kvtier_placeholders  # noqa: E402

kvtier_placeholders.install(kvtier_placeholders.VLLM_STAND_INS)

import harness  # noqa: E402,F401  (installs the switchable clock before vLLM loads)

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _vllm_source_dir() -> Path:
    env = os.environ.get("KVTIER_VLLM_SRC")
    if env:
        return Path(env)
    import fetch_vllm

    return fetch_vllm.ensure()


VLLM_SRC = _vllm_source_dir()
sys.path.insert(0, str(VLLM_SRC))


@pytest.fixture(scope="session")
def vllm_src() -> Path:
    """The unpacked vLLM source directory (on ``sys.path``)."""
    return VLLM_SRC


def pytest_configure(config):
    # This run's id, inherited by the Python processes the tests start (harness.engine_id):
    # the region files of this run are told apart from those of runs in other checkouts.
    os.environ[harness.RUN_ID_ENV] = str(os.getpid())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.kvtier_call_passed = report.passed


@pytest.fixture(autouse=True)
def no_vllm_region_left_behind(request):
    """Fails a passing test that leaves a vLLM region file of this run in ``/dev/shm``.

    vLLM 0.33's scheduler side creates ``/dev/shm/vllm_offload_<engine_id>.mmap`` and removes
    it only in the manager's shutdown, so a test that drops a manager without shutting it down
    leaks the file (its memory too) for good. Files the test made are removed here either way;
    a failed test is not failed twice for them. Only files named by ``harness.engine_id`` for
    this run count, so runs in other checkouts at the same time do not disturb the check.
    """
    before = harness.region_files()
    yield
    left = sorted(harness.region_files() - before)
    for path in left:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    if left and getattr(request.node, "kvtier_call_passed", False):
        pytest.fail(
            f"the test left {len(left)} vLLM region file(s) in /dev/shm (removed now): "
            f"{', '.join(p.name for p in left)}; shut down the manager that made each "
            "(manager.shutdown() removes its region), also when the test fails",
            pytrace=False,
        )


def pytest_report_header(config):
    return [f"vLLM sources: {VLLM_SRC}", f"kvtier-replay: {os.environ.get('KVTIER_REPLAY')}"]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    calls = sorted(kvtier_placeholders.CALLS)
    if calls:
        terminalreporter.write_line(
            f"stand-ins: vLLM's imports made {len(calls)} placeholder calls "
            f"(registrations; none may be used as a value), e.g. {', '.join(calls[:4])}"
        )
