"""Helpers for kvtier's differential tests against vLLM 0.33.0 (see tests/python/README.md).

* :data:`clock`: the switchable ``time.monotonic`` installed before vLLM is imported, so a
  test can run vLLM's own code on an injected clock.
* :func:`replay`: runs the ``kvtier-replay`` driver (JSON in, JSON out) to observe kvtier.
* :func:`float_diff`: exact float comparison with a readable message.
* :func:`shrink`: the shortest diverging prefix of a sequence, then its items removed one by
  one while it still diverges.
* :func:`engine_id`, :func:`region_files`: vLLM engine ids that name this test run, and the
  ``/dev/shm`` region files vLLM created for them (conftest fails a test that leaves one).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import subprocess
import time
from pathlib import Path

#: Times on this grid are exact both as Python floats and as whole nanoseconds (1e9 = 2^9 * 5^9),
#: so kvtier's Duration arithmetic and vLLM's float arithmetic see the same values.
TIME_QUANTUM_S = 1.0 / 512


class SwitchableMonotonic:
    """``time.monotonic`` that is real time unless a test sets it.

    Installed as ``time.monotonic`` before any vLLM module is imported, so that module-level
    references (``field(default_factory=time.monotonic)``) see it too. Modules imported
    earlier (pytest, threading) keep the real clock.
    """

    def __init__(self) -> None:
        self._real = time.monotonic
        self._now: float | None = None

    def __call__(self) -> float:
        return self._real() if self._now is None else self._now

    @contextlib.contextmanager
    def manual(self, start: float):
        """Inside the block time stands still at ``start`` until :meth:`advance` or :meth:`set`."""
        previous = self._now
        self._now = float(start)
        try:
            yield self
        finally:
            self._now = previous

    def set(self, t: float) -> None:
        assert self._now is not None, "clock.set outside clock.manual()"
        self._now = float(t)

    def advance(self, dt: float) -> None:
        assert self._now is not None, "clock.advance outside clock.manual()"
        self._now += dt


clock = SwitchableMonotonic()
time.monotonic = clock

#: Carries this test run's id (the pytest process's pid, set by conftest) to the Python
#: processes its tests start, so that the engine ids they make name the run too.
RUN_ID_ENV = "KVTIER_TEST_RUN"

#: Where vLLM 0.33 puts its shared offload region: ``vllm_offload_<engine_id>.mmap``.
SHM_DIR = Path("/dev/shm")

_engine_ids = itertools.count()


def run_id() -> str:
    """This test run's id: ``$KVTIER_TEST_RUN``, else this process's pid."""
    return os.environ.get(RUN_ID_ENV) or str(os.getpid())


def engine_id(kind: str) -> str:
    """A vLLM engine id unique to this process that names this run: ``kvtier-KIND-RUN-PID-N``.

    vLLM's scheduler side (``TieringOffloadingSpec.get_manager``) creates
    ``/dev/shm/vllm_offload_<engine_id>.mmap`` for it and removes it only when the manager shuts
    down (vLLM 0.33 unlinks the region early only when its workers share a barrier)."""
    return f"kvtier-{kind}-{run_id()}-{os.getpid()}-{next(_engine_ids)}"


def region_files(run: str | None = None, pid: int | None = None) -> set[Path]:
    """The ``/dev/shm`` region files (and segment files) of engines named by :func:`engine_id`
    in test run ``run`` (this one by default), by process ``pid`` if given; other runs' files,
    however many run at once, are never among them."""
    by = r"\d+" if pid is None else str(pid)
    name = re.compile(
        rf"vllm_offload_kvtier-[a-z]+-{re.escape(run or run_id())}-{by}-\d+\.mmap(\.\d+)?"
    )
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return set()
    return {SHM_DIR / n for n in names if name.fullmatch(n)}


class ReplayError(AssertionError):
    """The driver failed; the message carries its stderr."""


def replay_path() -> str:
    path = os.environ.get("KVTIER_REPLAY")
    if not path:
        raise ReplayError(
            "KVTIER_REPLAY is not set: run the Python tests through "
            "`cargo test --test python_suite` (which builds kvtier-replay and sets it), or set "
            "KVTIER_REPLAY=target/debug/kvtier-replay after `cargo build -p kvtier-cli --features test-support --bin kvtier-replay`"
        )
    return path


def replay(
    command: str, payload, *, extra_args: tuple[str, ...] = (), dumps=json.dumps
) -> object:
    """Runs ``kvtier-replay COMMAND`` with ``payload`` as JSON on stdin (written by ``dumps``);
    returns its JSON."""
    proc = subprocess.run(
        [replay_path(), command, *extra_args],
        input=dumps(payload),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise ReplayError(
            f"kvtier-replay {command} exited {proc.returncode}:\n{proc.stderr.strip()[-4000:]}"
        )
    return json.loads(proc.stdout)


def kvtier_bin() -> str:
    path = os.environ.get("KVTIER_BIN")
    if not path:
        raise ReplayError("KVTIER_BIN is not set: run through `cargo test --test python_suite`")
    return path


def float_diff(what: str, vllm_value, kvtier_value) -> str | None:
    """None when equal (floats bit for bit), else a message with both values in hex."""
    if isinstance(vllm_value, float) or isinstance(kvtier_value, float):
        a, b = float(vllm_value), float(kvtier_value)
        if a == b or (a != a and b != b):
            return None
        return f"{what}: vLLM {a!r} ({a.hex()}) != kvtier {b!r} ({b.hex()})"
    if vllm_value == kvtier_value:
        return None
    return f"{what}: vLLM {vllm_value!r} != kvtier {kvtier_value!r}"


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def shrink(scenario: dict, field: str, diverges) -> dict:
    """The shortest prefix of ``scenario[field]`` that still diverges, then items removed one
    by one while it does (``diverges(candidate)`` is truthy when it does)."""
    items = scenario[field]
    best = dict(scenario)
    for i in range(1, len(items) + 1):
        cand = dict(scenario, **{field: items[:i]})
        if diverges(cand):
            best = cand
            break
    i = len(best[field]) - 2
    while i >= 0:
        cand = dict(best, **{field: best[field][:i] + best[field][i + 1:]})
        if diverges(cand):
            best = cand
        i -= 1
    return best
