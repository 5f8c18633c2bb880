"""pytest setup: vLLM 0.33.0 from the cache, stand-ins for its heavy imports, the driver.

Order matters and is fixed here, before any test module imports vLLM:
1. ``stubs/`` goes first on ``sys.path`` (the metadata-only ``torch``) and the placeholder
   packages are registered (``kvtier_placeholders.VLLM_STAND_INS``);
2. ``harness`` installs the switchable ``time.monotonic``;
3. the vLLM sources: ``$KVTIER_VLLM_SRC`` (set by tests/python_suite.rs after its fetch
   step), else ``fetch_vllm.ensure()`` (downloads into the cache on first use).
"""

from __future__ import annotations

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


def pytest_report_header(config):
    return [f"vLLM sources: {VLLM_SRC}", f"kvtier-replay: {os.environ.get('KVTIER_REPLAY')}"]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    calls = sorted(kvtier_placeholders.CALLS)
    if calls:
        terminalreporter.write_line(
            f"stand-ins: vLLM's imports made {len(calls)} placeholder calls "
            f"(registrations; none may be used as a value), e.g. {', '.join(calls[:4])}"
        )
