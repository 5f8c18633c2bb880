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
import subprocess
import sys
import tempfile
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
    where = fetch_vllm.download_dir(cache)
    where.mkdir(parents=True, exist_ok=True)
    log(f"downloading {pin['filename']} (about 40 MB, once) into {where}")
    with tempfile.TemporaryDirectory(dir=where, prefix=".kvtier-sglang-download-") as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{PACKAGE}=={pin['version']} --hash=sha256:{pin['sha256']}\n")
        # The platform flags pick exactly the pinned file whatever this host is (only its
        # Python sources are used); --require-hashes refuses any other bytes.
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--platform", "manylinux_2_34_x86_64", "--implementation", "cp",
            "--python-version", "3.11", "--abi", "cp311", "--require-hashes",
            "--disable-pip-version-check", "--progress-bar", "off", "--no-cache-dir",
            "-r", str(req), "-d", tmp,
        ]
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        got = Path(tmp) / pin["filename"]
        if result.returncode != 0 or not got.exists():
            tail = "\n".join(result.stdout.strip().splitlines()[-6:])
            if "HASH" in result.stdout.upper() and "MISMATCH" in result.stdout.upper():
                raise FetchError(f"pip download: the index served other bytes:\n{tail}")
            raise Unavailable(f"pip download failed (exit {result.returncode}):\n{tail}")
        found = sha256_of(got)
        if found != pin["sha256"]:
            raise FetchError(f"downloaded {got.name} has sha256 {found}, expected {pin['sha256']}")
        yield got


def ensure_sources(cache: Path, pin: dict, wheel: Path) -> Path:
    target = source_dir(cache, pin)
    if target.exists():
        shutil.rmtree(target)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=f".{target.name}-"))
    try:
        count = 0
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                name = info.filename
                wanted = (name.startswith(f"{PACKAGE}/") and name.endswith(".py")) or (
                    name.split("/", 1)[0].endswith(".dist-info") and not name.endswith("/")
                )
                if not wanted:
                    continue
                dest = fetch_vllm._member_path(tmp, name)
                dest.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, dest.open("wb") as out:
                    shutil.copyfileobj(src, out)
                count += 1
        if count == 0:
            raise FetchError(f"{wheel} holds no {PACKAGE}/*.py files")
        (tmp / COMPLETE_MARKER).write_text(pin["sha256"] + "\n")
        tmp.chmod(0o755)
        tmp.rename(target)
        log(f"unpacked {count} files into {target}")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target


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
