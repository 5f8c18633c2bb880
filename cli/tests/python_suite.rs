//! Runs the Python test suite (`tests/python/`, pytest) from `cargo test`: the differential
//! tests that replay the same inputs through vLLM 0.33.0's own code and through kvtier.
//!
//! Steps (each reuses what an earlier run left):
//! 1. a virtual environment under `target/tmp/python-venv`, with `tests/python/requirements.txt`
//!    installed (reinstalled only when that file changes);
//! 2. the vLLM and SGLang sources: `tests/python/fetch_vllm.py` and `fetch_sglang.py` (wheel
//!    cache outside the checkout, `$KVTIER_CACHE_DIR` or `~/.cache/kvtier`);
//! 3. the Python package `python/` built into a wheel with maturin (pinned in
//!    `requirements.txt`) and installed into the venv (in the workspace's target directory with
//!    the features this test was built with, so it links the kvtier library cargo has just
//!    built: `python/Cargo.toml` keeps the dependency features equal, and the step says when
//!    they drift and kvtier was compiled again; the extension is stripped);
//! 4. `pytest tests/python` with `KVTIER_REPLAY` (the `kvtier-replay` driver), `KVTIER_BIN`
//!    (the `kvtier` CLI), `KVTIER_VLLM_SRC` and `KVTIER_SGLANG_SRC` set.
//!
//! Without Python (3.11 or newer, with `venv`) or a reachable package index on the first run,
//! the test skips with a printed reason, unless `KVTIER_REQUIRE_PYTHON_TESTS=1` (set by
//! `.ci/run`), which turns every such skip into a failure. `PYTEST_ADDOPTS` passes options
//! through (`PYTEST_ADDOPTS="-k backpressure -x"`). To add a step, add a function like
//! [`build_package`] and call it from [`python_suite`] before [`run_pytest`]. See
//! `tests/python/README.md`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use sha2::{Digest, Sha256};

/// The oldest Python vLLM 0.33.0 supports.
const MIN_PYTHON: (u32, u32) = (3, 11);

fn repo_root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

fn python_dir() -> PathBuf {
    repo_root().join("tests").join("python")
}

fn required() -> bool {
    std::env::var("KVTIER_REQUIRE_PYTHON_TESTS").is_ok_and(|v| v == "1")
}

/// Why the suite cannot run here: a skip, or a failure under `KVTIER_REQUIRE_PYTHON_TESTS=1`.
fn unavailable(reason: &str) {
    if required() {
        panic!("KVTIER_REQUIRE_PYTHON_TESTS=1 but the Python suite cannot run: {reason}");
    }
    kvtier::skip_test!("Python test suite not run: {reason}");
}

/// A line straight to stderr (not captured by the test harness), like `skip_test!`.
fn note(msg: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "python_suite: {msg}");
}

fn tail(out: &Output, lines: usize) -> String {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn run(cmd: &mut Command) -> std::io::Result<Output> {
    cmd.output()
}

/// The `(major, minor)` version `python` reports, or why it did not.
fn python_version(python: &Path) -> Result<(u32, u32), String> {
    let out =
        run(Command::new(python).args(["-c", "import sys; print('%d %d' % sys.version_info[:2])"]))
            .map_err(|e| format!("{} not runnable: {e}", python.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let version: Vec<u32> = text
        .split_whitespace()
        .filter_map(|s| s.parse().ok())
        .collect();
    match version[..] {
        [major, minor] if out.status.success() => Ok((major, minor)),
        _ => Err(format!(
            "{} did not report its version ({}):\n{}",
            python.display(),
            out.status,
            tail(&out, 4)
        )),
    }
}

/// The interpreter to build the venv from: `$KVTIER_PYTHON`, else `python3`, if it is at
/// least [`MIN_PYTHON`].
fn find_python() -> Result<PathBuf, String> {
    let python = std::env::var_os("KVTIER_PYTHON").map_or_else(|| "python3".into(), PathBuf::from);
    match python_version(&python)? {
        v if v >= MIN_PYTHON => Ok(python),
        (major, minor) => Err(format!(
            "{} is Python {major}.{minor}; vLLM 0.33.0 needs {}.{} or newer (set KVTIER_PYTHON)",
            python.display(),
            MIN_PYTHON.0,
            MIN_PYTHON.1
        )),
    }
}

struct Venv {
    dir: PathBuf,
}

impl Venv {
    fn python(&self) -> PathBuf {
        self.dir.join("bin").join("python")
    }
}

/// Whether `python` starts and reports a version of at least [`MIN_PYTHON`].
fn interpreter_runs(python: &Path) -> Result<(), String> {
    match python_version(python)? {
        v if v >= MIN_PYTHON => Ok(()),
        (major, minor) => Err(format!("{} is Python {major}.{minor}", python.display())),
    }
}

/// The venv under `target/tmp/python-venv` (see [`prepare_venv_at`]).
fn prepare_venv(python: &Path) -> Result<Venv, String> {
    prepare_venv_at(
        python,
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("python-venv"),
    )
}

/// The venv in `dir`, created from `python` unless one whose interpreter runs is there. A venv
/// left broken (made under another `PATH`, its interpreter gone after a Python upgrade: its
/// `bin/python` no longer starts) is removed and made again, with a note; an error only when
/// `python` itself cannot make one.
fn prepare_venv_at(python: &Path, dir: PathBuf) -> Result<Venv, String> {
    let venv = Venv { dir };
    if venv.dir.exists() {
        match interpreter_runs(&venv.python()) {
            Ok(()) => return Ok(venv),
            Err(why) => {
                note(&format!(
                    "the venv {} is broken ({why}); making it again",
                    venv.dir.display()
                ));
                std::fs::remove_dir_all(&venv.dir)
                    .map_err(|e| format!("removing the broken venv {}: {e}", venv.dir.display()))?;
            }
        }
    }
    note(&format!("creating {}", venv.dir.display()));
    let out = run(Command::new(python).args(["-m", "venv"]).arg(&venv.dir))
        .map_err(|e| format!("python -m venv: {e}"))?;
    if !out.status.success() {
        return Err(format!("python -m venv failed:\n{}", tail(&out, 8)));
    }
    interpreter_runs(&venv.python()).map_err(|why| format!("the new venv: {why}"))?;
    Ok(venv)
}

/// Installs `tests/python/requirements.txt` into the venv unless the stamp says it is there.
fn install_requirements(venv: &Venv) -> Result<(), String> {
    let requirements = python_dir().join("requirements.txt");
    let text = std::fs::read(&requirements)
        .map_err(|e| format!("reading {}: {e}", requirements.display()))?;
    let digest = hex::encode(Sha256::digest(&text));
    let stamp = venv.dir.join(".kvtier-requirements.sha256");
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s.trim() == digest) {
        return Ok(());
    }
    note("installing tests/python/requirements.txt into the venv (once)");
    let out = run(Command::new(venv.python())
        .args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "-q",
            "-r",
        ])
        .arg(&requirements))
    .map_err(|e| format!("pip: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "pip install -r tests/python/requirements.txt failed (package index unreachable?):\n{}",
            tail(&out, 8)
        ));
    }
    std::fs::write(&stamp, digest).map_err(|e| format!("writing {}: {e}", stamp.display()))
}

/// Why a step did not complete: the machine cannot (skip) or something is wrong (fail).
enum StepError {
    Unavailable(String),
    Failed(String),
}

/// Runs `fetch_vllm.py` and returns the source directory.
fn fetch_vllm(venv: &Venv) -> Result<PathBuf, StepError> {
    fetch_sources(venv, "fetch_vllm.py", "the vLLM wheel")
}

/// Runs `fetch_sglang.py` (SGLang's sources for `test_kvtier_sglang.py`) and returns the
/// source directory.
fn fetch_sglang(venv: &Venv) -> Result<PathBuf, StepError> {
    fetch_sources(venv, "fetch_sglang.py", "the SGLang wheel")
}

/// Runs one of the fetch scripts (exit 3: not cached and not downloadable).
fn fetch_sources(venv: &Venv, script: &str, what: &str) -> Result<PathBuf, StepError> {
    let out = run(Command::new(venv.python())
        .arg(python_dir().join(script))
        .arg("--print-src"))
    .map_err(|e| StepError::Failed(format!("{script}: {e}")))?;
    match out.status.code() {
        Some(0) => {
            let stdout = String::from_utf8_lossy(&out.stdout);
            let src = stdout.lines().last().unwrap_or_default().trim().to_string();
            Ok(PathBuf::from(src))
        }
        Some(3) => Err(StepError::Unavailable(format!(
            "{what} is not cached and could not be downloaded:\n{}",
            tail(&out, 8)
        ))),
        _ => Err(StepError::Failed(format!(
            "{script} failed:\n{}",
            tail(&out, 20)
        ))),
    }
}

/// The workspace's target directory (`target/`), where cargo has just built kvtier.
fn target_dir() -> PathBuf {
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().map_or(tmp.clone(), Path::to_path_buf)
}

/// Builds `python/` into a wheel with maturin and installs it into the venv (`import kvtier`
/// then finds it), as `pip install ./python` would, without leaving anything in the source
/// tree. A build failure is a real failure; only a missing maturin is "this machine cannot".
fn build_package(venv: &Venv) -> Result<(), StepError> {
    let maturin = venv.dir.join("bin").join("maturin");
    if !maturin.exists() {
        return Err(StepError::Unavailable(format!(
            "{} is missing (tests/python/requirements.txt installs it)",
            maturin.display()
        )));
    }
    let wheels = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("python-wheel");
    let _ = std::fs::remove_dir_all(&wheels);
    // The same kvtier features as this test binary, so cargo reuses that build of the library.
    let mut features = Vec::new();
    if cfg!(feature = "gds") {
        features.push("gds");
    }
    if cfg!(feature = "test-support") {
        features.push("test-support");
    }
    let mut cmd = Command::new(&maturin);
    // `--strip`: the extension without its debug symbols (6 MB instead of 80 MB, in the
    // target directory and again in the venv); it is linked from the same kvtier library.
    cmd.args(["build", "--strip", "--manifest-path"])
        .arg(repo_root().join("python").join("Cargo.toml"))
        .arg("--interpreter")
        .arg(venv.python())
        .arg("--out")
        .arg(&wheels)
        // A local test build: no manylinux audit (the wheel is installed here only).
        .args(["--compatibility", "linux"])
        .env("CARGO_TARGET_DIR", target_dir())
        .current_dir(repo_root());
    if !features.is_empty() {
        cmd.arg("--features").arg(features.join(","));
    }
    let started = std::time::Instant::now();
    let out = run(&mut cmd).map_err(|e| StepError::Failed(format!("maturin: {e}")))?;
    if !out.status.success() {
        return Err(StepError::Failed(format!(
            "maturin build (python/) failed:\n{}",
            tail(&out, 40)
        )));
    }
    let compiled = String::from_utf8_lossy(&out.stderr)
        .lines()
        .chain(String::from_utf8_lossy(&out.stdout).lines())
        .any(|l| l.trim_start().starts_with("Compiling kvtier v"));
    if compiled {
        // Not a failure: the package works, the build only cost a second copy of kvtier.
        note(&format!(
            "maturin compiled kvtier a second time ({:.0} s): the package build resolves \
             kvtier's dependencies with other features than this test build (align them in \
             python/Cargo.toml: `cargo tree -e features` on both)",
            started.elapsed().as_secs_f64()
        ));
    }
    let wheel = std::fs::read_dir(&wheels)
        .ok()
        .and_then(|mut d| d.find_map(|e| e.ok().map(|e| e.path())))
        .ok_or_else(|| {
            StepError::Failed(format!("maturin left no wheel in {}", wheels.display()))
        })?;
    let out = run(Command::new(venv.python())
        .args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "-q",
            "--no-deps",
            "--no-index",
            "--force-reinstall",
        ])
        .arg(&wheel))
    .map_err(|e| StepError::Failed(format!("pip: {e}")))?;
    if !out.status.success() {
        return Err(StepError::Failed(format!(
            "pip install {} failed:\n{}",
            wheel.display(),
            tail(&out, 20)
        )));
    }
    let _ = std::fs::remove_dir_all(&wheels);
    Ok(())
}

/// Runs pytest on `tests/python`; the output is shown in full on failure.
fn run_pytest(venv: &Venv, vllm_src: &Path, sglang_src: &Path) -> Result<String, String> {
    let out = run(Command::new(venv.python())
        .args([
            "-m",
            "pytest",
            "-q",
            "-rs",
            "--color=no",
            "-p",
            "no:cacheprovider",
        ])
        .arg(python_dir())
        .current_dir(repo_root())
        .env("KVTIER_REPLAY", env!("CARGO_BIN_EXE_kvtier-replay"))
        .env("KVTIER_BIN", env!("CARGO_BIN_EXE_kvtier"))
        .env("KVTIER_VLLM_SRC", vllm_src)
        .env("KVTIER_SGLANG_SRC", sglang_src)
        .env("PYTHONDONTWRITEBYTECODE", "1"))
    .map_err(|e| format!("pytest: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout
            .lines()
            .rev()
            .find(|l| l.contains(" passed") || l.contains(" skipped"))
            .unwrap_or("pytest passed")
            .trim()
            .to_string())
    } else {
        Err(format!(
            "pytest tests/python failed ({}):\n{stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

#[test]
fn python_suite() {
    let python = match find_python() {
        Ok(p) => p,
        Err(reason) => return unavailable(&reason),
    };
    let venv = match prepare_venv(&python).and_then(|v| install_requirements(&v).map(|()| v)) {
        Ok(v) => v,
        Err(reason) => return unavailable(&reason),
    };
    let vllm_src = match fetch_vllm(&venv) {
        Ok(src) => src,
        Err(StepError::Unavailable(reason)) => return unavailable(&reason),
        Err(StepError::Failed(msg)) => panic!("{msg}"),
    };
    let sglang_src = match fetch_sglang(&venv) {
        Ok(src) => src,
        Err(StepError::Unavailable(reason)) => return unavailable(&reason),
        Err(StepError::Failed(msg)) => panic!("{msg}"),
    };
    match build_package(&venv) {
        Ok(()) => {}
        Err(StepError::Unavailable(reason)) => return unavailable(&reason),
        Err(StepError::Failed(msg)) => panic!("{msg}"),
    }
    match run_pytest(&venv, &vllm_src, &sglang_src) {
        Ok(summary) => note(&format!("pytest tests/python: {summary}")),
        Err(msg) => panic!("{msg}"),
    }
}

/// A venv whose interpreter no longer runs (its `bin/python` links to an interpreter that is
/// gone, as after a Python upgrade or when it was made under another `PATH`) is made again,
/// not reported as "python -m venv failed" on every later run.
#[test]
fn a_broken_venv_is_made_again() {
    let python = match find_python() {
        Ok(p) => p,
        Err(reason) => return unavailable(&reason),
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let venv_dir = dir.path().join("python-venv");
    let bin = venv_dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let gone = dir.path().join("pyenv/versions/3.11.1/bin/python3.11");
    for name in ["python", "python3"] {
        std::os::unix::fs::symlink(&gone, bin.join(name)).unwrap();
    }
    std::fs::write(venv_dir.join(".kvtier-requirements.sha256"), "stale").unwrap();
    std::fs::write(venv_dir.join("pyvenv.cfg"), "home = /nonexistent/bin\n").unwrap();
    assert!(interpreter_runs(&bin.join("python")).is_err());

    let venv = prepare_venv_at(&python, venv_dir.clone()).expect("the venv is made again");
    interpreter_runs(&venv.python()).expect("its interpreter runs");
    // Made afresh: the stale requirements stamp went with the broken venv.
    assert!(!venv_dir.join(".kvtier-requirements.sha256").exists());
    // A venv that runs is kept as it is.
    std::fs::write(venv_dir.join("marker"), "kept").unwrap();
    prepare_venv_at(&python, venv_dir.clone()).expect("kept");
    assert!(venv_dir.join("marker").exists());
}
