#!/usr/bin/env python3
"""Fetch SGLang's Python sources for the HiCache backend tests (stdlib only).

Like ``fetch_vllm.py`` (whose helpers it uses): downloads the pinned SGLang wheel
(``sglang-wheel.toml``, about 40 MB) with ``pip download --require-hashes``, checks its sha256,
and unpacks only ``sglang/**/*.py`` and the ``.dist-info`` metadata into
``$KVTIER_CACHE_DIR/sglang-<version>-py-<sha12>/`` (default cache ``~/.cache/kvtier``), then
deletes the download. A wheel already in ``$KVTIER_CACHE_DIR/wheels`` is used and kept. Only
the first run needs the package index; nothing of SGLang is written into the checkout.

Usage: ``python fetch_sglang.py [--cache-dir DIR] [--print-src]``. Exit status: 0 ready; 3 not
cached and not downloadable (callers may skip); 1 anything else (a hash mismatch), which must
fail.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from pathlib import Path

import fetch_vllm
from fetch_vllm import COMPLETE_MARKER, sha256_of
from fetch_vllm import Unavailable  # noqa: F401 (re-exported: callers catch fetch_sglang.Unavailable)

HERE = Path(__file__).resolve().parent
PIN_FILE = HERE / "sglang-wheel.toml"
PACKAGE = "sglang"


def load_pin() -> dict:
    return fetch_vllm.load_pin(PIN_FILE)


def source_dir(cache: Path, pin: dict) -> Path:
    return cache / f"{PACKAGE}-{pin['version']}-py-{pin['sha256'][:12]}"


@contextlib.contextmanager
def verified_wheel(cache: Path, pin: dict):
    """The verified wheel: kept in ``cache/wheels``, else downloaded and deleted after."""
    kept = cache / "wheels" / pin["filename"]
    if kept.exists() and sha256_of(kept) == pin["sha256"]:
        yield kept
        return
    with fetch_vllm.downloaded_wheel(
        cache, pin, PACKAGE, "manylinux_2_34_x86_64", "cp311", "40 MB"
    ) as got:
        yield got


def ensure_sources(cache: Path, pin: dict, wheel: Path) -> Path:
    target = source_dir(cache, pin)
    if target.exists():
        shutil.rmtree(target)
    return fetch_vllm.unpack_sources(wheel, PACKAGE, target, pin["sha256"])


def ensure(cache: Path | None = None) -> Path:
    """Fetch (if needed) and unpack (if needed); returns the source directory."""
    cache = cache or fetch_vllm.cache_dir()
    pin = load_pin()
    with fetch_vllm.locked(cache / ".fetch_sglang.lock"):
        ready = source_dir(cache, pin)
        marker = ready / COMPLETE_MARKER
        if marker.exists() and marker.read_text().strip() == pin["sha256"]:
            return ready
        with verified_wheel(cache, pin) as wheel:
            return ensure_sources(cache, pin, wheel)


def main() -> int:
    return fetch_vllm.run_cli(__doc__, ensure)


if __name__ == "__main__":
    sys.exit(main())
