#!/usr/bin/env python3
"""Fetch vLLM's Python sources for the differential tests (stdlib only).

Downloads the pinned vLLM wheel (``vllm-wheel.toml``, about 340 MB) with pip, checks its
sha256 against the hash PyPI publishes (recorded in ``vllm-wheel.toml``), and unpacks only
the ``vllm/**/*.py`` sources and the ``.dist-info`` metadata (about 60 MB) into
``$KVTIER_CACHE_DIR/vllm-<version>-py-<sha12>/`` (default cache ``~/.cache/kvtier``). The
wheel is downloaded into ``/dev/shm`` when that has room (memory, not disk: CI machines may
have little disk), else into ``$KVTIER_CACHE_DIR/wheels``, and deleted once its sources are
unpacked; a wheel already in ``$KVTIER_CACHE_DIR/wheels`` is used and kept. The unpacked tree
is reused, so only the first run needs the package index. Nothing of vLLM is written into
the checkout.

Usage: ``python fetch_vllm.py [--cache-dir DIR] [--print-src]``. With ``--print-src`` the
last line of stdout is the directory to put on ``sys.path``.

Exit status: 0 ready; 3 the wheel is not cached and could not be downloaded (no package
index: callers may skip); 1 anything else (a hash mismatch, a broken cache), which must fail.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PIN_FILE = HERE / "vllm-wheel.toml"
# Marker written last into an unpacked source tree; holds the wheel's sha256.
COMPLETE_MARKER = ".kvtier-complete"
EXIT_UNAVAILABLE = 3


class FetchError(Exception):
    """A failure that no retry on this machine fixes (exit 1)."""


class Unavailable(Exception):
    """The wheel is not cached and the package index could not provide it (exit 3)."""


def cache_dir() -> Path:
    """``$KVTIER_CACHE_DIR``, else ``~/.cache/kvtier``."""
    env = os.environ.get("KVTIER_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvtier"


def load_pin(pin_file: Path = PIN_FILE) -> dict:
    """The pinned wheel (``version``, ``filename``, ``sha256``) from the TOML ``pin_file``."""
    with pin_file.open("rb") as f:
        pin = tomllib.load(f)
    for key in ("version", "filename", "sha256"):
        if not isinstance(pin.get(key), str) or not pin[key]:
            raise FetchError(f"{pin_file}: {key} must be a non-empty string")
    return pin


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive flock on ``path``: several checkouts share one cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def log(msg: str) -> None:
    print(f"fetch_vllm: {msg}", file=sys.stderr, flush=True)


# Room the download needs in /dev/shm before it goes there: the wheel and some to spare.
SHM_NEEDED_BYTES = 1 << 30


def download_dir(cache: Path) -> Path:
    """Where the wheel is downloaded: ``/dev/shm`` (memory) when it is a writable directory
    with room, else ``cache/wheels`` on disk."""
    shm = Path("/dev/shm")
    try:
        st = os.statvfs(shm)
        if st.f_bavail * st.f_frsize >= SHM_NEEDED_BYTES and os.access(shm, os.W_OK):
            return shm
    except OSError:
        pass
    return cache / "wheels"


@contextlib.contextmanager
def verified_wheel(cache: Path, pin: dict):
    """The verified wheel: the one kept in ``cache/wheels`` if there is one, else a fresh
    download that is deleted when the block ends."""
    kept = cache / "wheels" / pin["filename"]
    if kept.exists():
        found = sha256_of(kept)
        if found == pin["sha256"]:
            yield kept
            return
        bad = kept.with_name(kept.name + f".sha256-{found[:12]}.rejected")
        log(f"{kept} has sha256 {found}, expected {pin['sha256']}; moved to {bad}")
        kept.replace(bad)
    with downloaded_wheel(cache, pin, "vllm", "manylinux_2_28_x86_64", "abi3", "340 MB") as got:
        yield got


@contextlib.contextmanager
def downloaded_wheel(cache: Path, pin: dict, package: str, platform: str, abi: str, size: str):
    """``package``'s pinned wheel (``pin``: version, filename, sha256), downloaded with ``pip
    download --require-hashes`` into :func:`download_dir` and deleted when the block ends.
    Raises ``Unavailable`` without a package index, ``FetchError`` for other bytes."""
    where = download_dir(cache)
    where.mkdir(parents=True, exist_ok=True)
    log(f"downloading {pin['filename']} (about {size}, once) into {where}")
    with tempfile.TemporaryDirectory(dir=where, prefix=f".kvtier-{package}-download-") as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{package}=={pin['version']} --hash=sha256:{pin['sha256']}\n")
        # The platform flags pick exactly the pinned file whatever this host is (only its
        # Python sources are used); --require-hashes refuses any other bytes.
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--platform", platform, "--implementation", "cp",
            "--python-version", "3.11", "--abi", abi, "--require-hashes",
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


def _member_path(root: Path, name: str) -> Path:
    parts = Path(name).parts
    if Path(name).is_absolute() or ".." in parts:
        raise FetchError(f"unsafe path in wheel: {name!r}")
    return root.joinpath(*parts)


def source_dir(cache: Path, pin: dict) -> Path:
    return cache / f"vllm-{pin['version']}-py-{pin['sha256'][:12]}"


def ensure_sources(cache: Path, pin: dict, wheel: Path) -> Path:
    """``cache/vllm-<version>-py-<sha12>``: the wheel's ``vllm/**/*.py`` and dist-info."""
    target = source_dir(cache, pin)
    marker = target / COMPLETE_MARKER
    if marker.exists() and marker.read_text().strip() == pin["sha256"]:
        return target
    if target.exists():
        log(f"{target} is incomplete; unpacking again")
        shutil.rmtree(target)
    return unpack_sources(wheel, "vllm", target, pin["sha256"])


def unpack_sources(wheel: Path, package: str, target: Path, sha256: str) -> Path:
    """Unpacks ``package/**/*.py`` and the ``.dist-info`` metadata of ``wheel`` into ``target``
    (made whole in a temporary directory, marked complete with ``sha256``, then renamed)."""
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        count = 0
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                name = info.filename
                wanted = (name.startswith(f"{package}/") and name.endswith(".py")) or (
                    name.split("/", 1)[0].endswith(".dist-info") and not name.endswith("/")
                )
                if not wanted:
                    continue
                dest = _member_path(tmp, name)
                dest.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, dest.open("wb") as out:
                    shutil.copyfileobj(src, out)
                count += 1
        if count == 0:
            raise FetchError(f"{wheel} holds no {package}/*.py files")
        (tmp / COMPLETE_MARKER).write_text(sha256 + "\n")
        tmp.chmod(0o755)  # mkdtemp made it private; the cache is shared by checkouts
        tmp.rename(target)
        log(f"unpacked {count} files into {target}")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target


def ensure(cache: Path | None = None) -> Path:
    """Fetch (if needed) and unpack (if needed); returns the source directory."""
    cache = cache or cache_dir()
    pin = load_pin()
    with locked(cache / ".fetch_vllm.lock"):
        # A complete tree was unpacked from a verified wheel: no need to hash 340 MB again.
        ready = source_dir(cache, pin)
        marker = ready / COMPLETE_MARKER
        if marker.exists() and marker.read_text().strip() == pin["sha256"]:
            return ready
        with verified_wheel(cache, pin) as wheel:
            return ensure_sources(cache, pin, wheel)


# -- the source distribution's tests --------------------------------------------------------
#: What the suite takes from the sdist: vLLM's own offloading tests (never committed).
SDIST_TESTS_PREFIX = "tests/v1/kv_offload/"


def sdist_tests_dir(cache: Path, sdist: dict) -> Path:
    return cache / f"vllm-sdist-tests-{sdist['sha256'][:12]}"


def _download_sdist(where: Path, sdist: dict) -> Path:
    """The pinned sdist from the package index (``$PIP_INDEX_URL``, else PyPI), by its JSON
    simple page (PEP 691). ``pip download`` is not used for it: pip prepares an sdist's
    metadata before saving it, which for vLLM builds cmake and needs torch."""
    import json
    import urllib.parse
    import urllib.request

    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    page = f"{index}/vllm/"
    log(f"downloading {sdist['filename']} (about 47 MB, once) into {where}")
    try:
        req = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            files = json.load(r)["files"]
        entry = next((f for f in files if f.get("filename") == sdist["filename"]), None)
        if entry is None:
            raise Unavailable(f"{page} does not list {sdist['filename']}")
        url = urllib.parse.urljoin(page, entry["url"])
        tmp = where / f".{sdist['filename']}.part"
        with urllib.request.urlopen(url, timeout=300) as r, tmp.open("wb") as out:
            shutil.copyfileobj(r, out, 1 << 20)
    except (OSError, ValueError, KeyError) as e:
        raise Unavailable(f"downloading {sdist['filename']} from {page}: {e}") from e
    found = sha256_of(tmp)
    if found != sdist["sha256"]:
        tmp.unlink()
        raise FetchError(f"downloaded {sdist['filename']} has sha256 {found}, expected {sdist['sha256']}")
    dest = where / sdist["filename"]
    tmp.replace(dest)
    return dest


def ensure_sdist_tests(cache: Path | None = None) -> Path:
    """``cache/vllm-sdist-tests-<sha12>``: ``tests/v1/kv_offload/**`` of the pinned vLLM sdist
    (downloaded once; a copy already in ``cache/wheels`` is used and kept, a download is
    deleted once unpacked). Raises ``Unavailable`` without a package index."""
    import tarfile

    cache = cache or cache_dir()
    with PIN_FILE.open("rb") as f:
        sdist = tomllib.load(f).get("sdist") or {}
    for key in ("filename", "sha256"):
        if not isinstance(sdist.get(key), str) or not sdist[key]:
            raise FetchError(f"{PIN_FILE}: sdist.{key} must be a non-empty string")
    target = sdist_tests_dir(cache, sdist)
    marker = target / COMPLETE_MARKER
    with locked(cache / ".fetch_vllm.lock"):
        if marker.exists() and marker.read_text().strip() == sdist["sha256"]:
            return target
        kept = cache / "wheels" / sdist["filename"]
        downloaded = None
        if kept.exists() and sha256_of(kept) == sdist["sha256"]:
            archive = kept
        else:
            where = download_dir(cache)
            where.mkdir(parents=True, exist_ok=True)
            archive = downloaded = _download_sdist(where, sdist)
        if target.exists():
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=f".{target.name}-"))
        try:
            count = 0
            with tarfile.open(archive, "r:gz") as tar:
                for member in tar.getmembers():
                    top, _, rest = member.name.partition("/")
                    if not member.isfile() or not rest.startswith(SDIST_TESTS_PREFIX):
                        continue
                    dest = _member_path(tmp, rest)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(member) as src, dest.open("wb") as out:
                        shutil.copyfileobj(src, out)
                    count += 1
            if count == 0:
                raise FetchError(f"{archive} holds no {SDIST_TESTS_PREFIX} files")
            (tmp / COMPLETE_MARKER).write_text(sdist["sha256"] + "\n")
            tmp.chmod(0o755)
            tmp.rename(target)
            log(f"unpacked {count} test files into {target}")
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
            if downloaded is not None:
                downloaded.unlink(missing_ok=True)
    return target


def run_cli(doc: str, ensure_sources) -> int:
    """The command line of a fetch script: ``--cache-dir``, ``--print-src``; runs
    ``ensure_sources(cache_dir)`` and exits 0, 1 on an error, or ``EXIT_UNAVAILABLE`` when
    this machine cannot fetch."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, help="default: $KVTIER_CACHE_DIR or ~/.cache/kvtier")
    parser.add_argument("--print-src", action="store_true", help="print the source directory last")
    args = parser.parse_args()
    try:
        src = ensure_sources(args.cache_dir)
    except Unavailable as e:
        log(str(e))
        return EXIT_UNAVAILABLE
    except (FetchError, OSError, zipfile.BadZipFile) as e:
        log(f"error: {e}")
        return 1
    if args.print_src:
        print(src)
    return 0


def main() -> int:
    return run_cli(__doc__, ensure)


if __name__ == "__main__":
    sys.exit(main())
