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

import argparse
import contextlib
import shutil
import sys
import tomllib
import zipfile
from pathlib import Path

import fetch_vllm
from fetch_vllm import COMPLETE_MARKER, EXIT_UNAVAILABLE, FetchError, Unavailable, log, sha256_of

HERE = Path(__file__).resolve().parent
PIN_FILE = HERE / "sglang-wheel.toml"
PACKAGE = "sglang"


def load_pin() -> dict:
    with PIN_FILE.open("rb") as f:
        pin = tomllib.load(f)
    for key in ("version", "filename", "sha256"):
        if not isinstance(pin.get(key), str) or not pin[key]:
            raise FetchError(f"{PIN_FILE}: {key} must be a non-empty string")
    return pin


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, help="default: $KVTIER_CACHE_DIR or ~/.cache/kvtier")
    parser.add_argument("--print-src", action="store_true", help="print the source directory last")
    args = parser.parse_args()
    try:
        src = ensure(args.cache_dir)
    except Unavailable as e:
        log(str(e))
        return EXIT_UNAVAILABLE
    except (FetchError, OSError, zipfile.BadZipFile) as e:
        log(f"error: {e}")
        return 1
    if args.print_src:
        print(src)
    return 0


if __name__ == "__main__":
    sys.exit(main())
