//! Running fio with kvtier's job files (`fio-profiles/`) and reading its JSON output.
//!
//! The job files are compiled into the binary, written to a scratch directory for each run and
//! parameterised through the environment (`KVTIER_FIO_FILE`, `KVTIER_FIO_SIZE`,
//! `KVTIER_FIO_BS`, `KVTIER_FIO_IODEPTH`, `KVTIER_FIO_MEM`, `KVTIER_FIO_BATCH`), so `kvtier fio-compare` runs exactly the files a user
//! can run by hand. The JSON report goes to a file (`--output`) so fio's warnings on stdout
//! cannot corrupt it.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Serialize;
use serde_json::Value;

use kvtier::error::{Error, ErrorKind, Result};

/// How to install fio, printed when it is missing.
pub const INSTALL_HINT: &str =
    "install it with `apt-get install fio` (Debian/Ubuntu) or `dnf install fio` (Fedora/RHEL)";

/// A workload both fio and kvtier run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Profile {
    /// Primary -> G3: one row per write, in slot order.
    Store,
    /// G3 -> primary: one row per read, every slot once, in random order.
    Load,
    /// Both at once: a writer and a random reader, each with the full depth.
    Mixed,
}

impl Profile {
    /// The profile's name (also its job file's stem).
    pub fn name(self) -> &'static str {
        match self {
            Profile::Store => "store",
            Profile::Load => "load",
            Profile::Mixed => "mixed",
        }
    }

    /// The fio job file text.
    pub fn job_file(self) -> &'static str {
        match self {
            Profile::Store => include_str!("../../../fio-profiles/store.fio"),
            Profile::Load => include_str!("../../../fio-profiles/load.fio"),
            Profile::Mixed => include_str!("../../../fio-profiles/mixed.fio"),
        }
    }

    /// The job file's name and text with fio's data check (`verify=crc32c`): a store writes
    /// blocks carrying fio's verify headers, a load checks every block it reads against
    /// them. `None` for `mixed`.
    pub fn verify_job_file(self) -> Option<(&'static str, &'static str)> {
        match self {
            Profile::Store => Some((
                "store-verify",
                include_str!("../../../fio-profiles/store-verify.fio"),
            )),
            Profile::Load => Some((
                "load-verify",
                include_str!("../../../fio-profiles/load-verify.fio"),
            )),
            Profile::Mixed => None,
        }
    }
}

/// One fio run's parameters.
#[derive(Debug, Clone)]
pub struct FioRun {
    /// The workload.
    pub profile: Profile,
    /// The files (one per path; fio visits them round-robin, one I/O each).
    pub files: Vec<PathBuf>,
    /// Bytes covered per job, over all files.
    pub size: u64,
    /// Bytes per I/O (one row).
    pub block_size: u64,
    /// I/Os in flight per job.
    pub iodepth: u32,
    /// Buffer memory and submission batching.
    pub setup: crate::fio::memory::FioSetup,
    /// With fio's data check (`Profile::verify_job_file`).
    pub verify: bool,
}

/// What fio measured in one direction of one run, summed over its jobs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct FioDirection {
    /// Bytes moved.
    pub io_bytes: u64,
    /// Throughput in bytes per second (sum over jobs).
    pub bytes_per_sec: f64,
    /// I/Os per second (sum over jobs).
    pub iops: f64,
    /// Median completion latency in nanoseconds (largest over jobs).
    pub clat_p50_ns: u64,
    /// 99th percentile completion latency in nanoseconds (largest over jobs).
    pub clat_p99_ns: u64,
}

/// What one fio run measured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct FioReport {
    /// Reads.
    pub read: FioDirection,
    /// Writes.
    pub write: FioDirection,
    /// The longest job's run time in milliseconds (0 if fio did not say).
    pub job_runtime_ms: u64,
    /// CPU seconds (user + system) over all jobs: each job's `usr_cpu` + `sys_cpu` percent of
    /// its run time.
    pub cpu_seconds: f64,
}

impl FioReport {
    /// Reads plus writes, in bytes per second: all bytes over the longest job's run time (jobs
    /// of one group run concurrently), or the sum of per-job bandwidths when fio gave no time.
    pub fn total_bytes_per_sec(&self) -> f64 {
        if self.job_runtime_ms > 0 {
            (self.read.io_bytes + self.write.io_bytes) as f64 * 1000.0 / self.job_runtime_ms as f64
        } else {
            self.read.bytes_per_sec + self.write.bytes_per_sec
        }
    }
}

/// The fio binary to run (`KVTIER_FIO_BIN` overrides `fio` on `PATH`).
fn fio_binary() -> String {
    std::env::var("KVTIER_FIO_BIN").unwrap_or_else(|_| "fio".to_string())
}

/// fio's version string, or an [`ErrorKind::Unsupported`] error saying how to install it.
pub fn fio_version() -> Result<String> {
    let bin = fio_binary();
    match Command::new(&bin).arg("--version").output() {
        Ok(out) if out.status.success() => {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        }
        Ok(out) => Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "`{bin} --version` failed ({}); fio-compare needs a working fio: {INSTALL_HINT}",
                out.status
            ),
        )),
        Err(e) => Err(Error::new(
            ErrorKind::Unsupported,
            format!("fio was not found (`{bin}`: {e}); fio-compare needs it: {INSTALL_HINT}"),
        )),
    }
}

/// Runs fio once and returns what it measured. `scratch` holds the job and report files.
pub fn run_fio(run: &FioRun, scratch: &Path) -> Result<FioReport> {
    let files: Vec<String> = run.files.iter().map(|f| f.display().to_string()).collect();
    let (name, job) = match (run.verify, run.profile.verify_job_file()) {
        (true, Some(verifying)) => verifying,
        (true, None) => {
            return Err(Error::new(
                ErrorKind::Contract,
                format!(
                    "fio's {} profile has no verifying job file",
                    run.profile.name()
                ),
            ));
        }
        (false, _) => (run.profile.name(), run.profile.job_file()),
    };
    run_job_file(
        name,
        job,
        &[
            ("KVTIER_FIO_FILE", files.join(":")),
            ("KVTIER_FIO_SIZE", run.size.to_string()),
            ("KVTIER_FIO_BS", run.block_size.to_string()),
            ("KVTIER_FIO_IODEPTH", run.iodepth.to_string()),
            ("KVTIER_FIO_MEM", run.setup.memory.iomem()),
            (
                "KVTIER_FIO_BATCH",
                run.setup.batch_at(run.iodepth).to_string(),
            ),
        ],
        scratch,
    )
}

/// Runs the fio job file `job_text` (saved as `<name>.fio` in `scratch`) with `env` and returns
/// what it measured; the JSON report goes to `<name>.json` there.
pub fn run_job_file(
    name: &str,
    job_text: &str,
    env: &[(&str, String)],
    scratch: &Path,
) -> Result<FioReport> {
    let job_path = scratch.join(format!("{name}.fio"));
    std::fs::write(&job_path, job_text)
        .map_err(|e| Error::io("write fio job file", &job_path, e))?;
    let report_path = scratch.join(format!("{name}.json"));
    let bin = fio_binary();
    let out = Command::new(&bin)
        .arg("--output-format=json")
        .arg(format!("--output={}", report_path.display()))
        .arg(&job_path)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .map_err(|e| {
            Error::new(
                ErrorKind::Unsupported,
                format!("cannot run fio (`{bin}`: {e}): {INSTALL_HINT}"),
            )
        })?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let vars: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        return Err(Error::new(
            ErrorKind::Io,
            format!(
                "fio failed ({}) running {name} with {}: {}",
                out.status,
                vars.join(" "),
                stderr.trim()
            ),
        ));
    }
    let text = std::fs::read_to_string(&report_path)
        .map_err(|e| Error::io("read fio report", &report_path, e))?;
    parse_report(&text)
}

/// Parses fio's `--output-format=json` report: sums bandwidth and IOPS over jobs per direction.
/// A job with an error, or a report without jobs, is an error.
pub fn parse_report(text: &str) -> Result<FioReport> {
    // fio may print warnings before the JSON object when writing to stdout.
    let start = text.find('{').ok_or_else(|| bad_report("no JSON object"))?;
    let root: Value =
        serde_json::from_str(&text[start..]).map_err(|e| bad_report(&e.to_string()))?;
    let jobs = root
        .get("jobs")
        .and_then(Value::as_array)
        .filter(|j| !j.is_empty())
        .ok_or_else(|| bad_report("no \"jobs\" array"))?;
    let mut report = FioReport::default();
    for job in jobs {
        let name = job.get("jobname").and_then(Value::as_str).unwrap_or("?");
        let error = job.get("error").and_then(Value::as_i64).unwrap_or(0);
        if error != 0 {
            return Err(Error::new(
                ErrorKind::Io,
                format!("fio job {name:?} failed with error {error}"),
            ));
        }
        let runtime = job.get("job_runtime").and_then(Value::as_u64).unwrap_or(0);
        report.job_runtime_ms = report.job_runtime_ms.max(runtime);
        let pct = |k: &str| job.get(k).and_then(Value::as_f64).unwrap_or(0.0);
        report.cpu_seconds += (pct("usr_cpu") + pct("sys_cpu")) / 100.0 * runtime as f64 / 1000.0;
        add_direction(&mut report.read, job.get("read"));
        add_direction(&mut report.write, job.get("write"));
    }
    Ok(report)
}

fn add_direction(into: &mut FioDirection, dir: Option<&Value>) {
    let Some(dir) = dir else { return };
    let num = |key: &str| dir.get(key).and_then(Value::as_f64).unwrap_or(0.0);
    into.io_bytes += num("io_bytes") as u64;
    into.bytes_per_sec += num("bw_bytes");
    into.iops += num("iops");
    let pct = |p: &str| {
        dir.pointer(&format!("/clat_ns/percentile/{p}"))
            .and_then(Value::as_f64)
            .unwrap_or(0.0) as u64
    };
    into.clat_p50_ns = into.clat_p50_ns.max(pct("50.000000"));
    into.clat_p99_ns = into.clat_p99_ns.max(pct("99.000000"));
}

fn bad_report(why: &str) -> Error {
    Error::new(
        ErrorKind::Internal,
        format!("cannot read fio's JSON report: {why}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO_JOBS: &str = r#"note: both iodepth >= 1 and synchronous I/O engine are selected
{ "fio version": "fio-3.33", "jobs": [
  { "jobname": "store", "error": 0, "job_runtime": 1000, "usr_cpu": 10.0, "sys_cpu": 40.0,
    "read": { "io_bytes": 0, "bw_bytes": 0, "iops": 0.0 },
    "write": { "io_bytes": 1073741824, "bw_bytes": 1000000000, "iops": 476.8,
               "clat_ns": { "percentile": { "50.000000": 7962624, "99.000000": 13303808 } } } },
  { "jobname": "load", "error": 0, "job_runtime": 2000,
    "read": { "io_bytes": 1073741824, "bw_bytes": 2000000000, "iops": 953.6,
              "clat_ns": { "percentile": { "50.000000": 100, "99.000000": 200 } } },
    "write": { "io_bytes": 0, "bw_bytes": 0, "iops": 0.0 } } ] }"#;

    #[test]
    fn parses_and_sums_jobs() {
        let r = parse_report(TWO_JOBS).unwrap();
        assert_eq!(r.write.io_bytes, 1 << 30);
        assert_eq!(r.write.bytes_per_sec, 1e9);
        assert_eq!(r.read.bytes_per_sec, 2e9);
        assert_eq!(r.write.clat_p99_ns, 13303808);
        assert_eq!(r.read.clat_p50_ns, 100);
        assert_eq!(r.job_runtime_ms, 2000);
        // 50 % of the store job's 1 s; the load job says nothing.
        assert!((r.cpu_seconds - 0.5).abs() < 1e-9, "{}", r.cpu_seconds);
        // 2 GiB over the longest job's 2 s, not the sum of the two bandwidths.
        assert_eq!(r.total_bytes_per_sec(), (2u64 << 30) as f64 / 2.0);
        let no_time = FioReport {
            job_runtime_ms: 0,
            ..r
        };
        assert_eq!(no_time.total_bytes_per_sec(), 3e9);
    }

    #[test]
    fn rejects_failed_jobs_and_garbage() {
        let failed = TWO_JOBS.replacen("\"error\": 0", "\"error\": 5", 1);
        let e = parse_report(&failed).unwrap_err();
        assert!(
            e.to_string().contains("\"store\" failed with error 5"),
            "{e}"
        );
        assert!(parse_report("fio: no jobs").is_err());
        assert!(parse_report("{\"jobs\": []}").is_err());
        assert!(parse_report("{\"jobs\": [").is_err());
    }

    #[test]
    fn job_files_use_the_documented_variables() {
        let verifying = [Profile::Store, Profile::Load]
            .into_iter()
            .filter_map(|p| p.verify_job_file().map(|(_, t)| (p, t)));
        let plain = [Profile::Store, Profile::Load, Profile::Mixed]
            .into_iter()
            .map(|p| (p, p.job_file()));
        for (p, text) in plain.chain(verifying) {
            for var in [
                "KVTIER_FIO_FILE",
                "KVTIER_FIO_SIZE",
                "KVTIER_FIO_BS",
                "KVTIER_FIO_IODEPTH",
                "KVTIER_FIO_MEM",
                "KVTIER_FIO_BATCH",
            ] {
                assert!(
                    text.contains(&format!("${{{var}}}")),
                    "{} lacks {var}",
                    p.name()
                );
            }
            assert!(text.contains("direct=1") && text.contains("ioengine=io_uring"));
        }
    }

    #[test]
    fn verifying_job_files_are_the_plain_ones_with_fio_s_data_check() {
        assert!(Profile::Mixed.verify_job_file().is_none());
        for p in [Profile::Store, Profile::Load] {
            let (name, text) = p.verify_job_file().unwrap();
            assert_eq!(name, format!("{}-verify", p.name()));
            assert!(text.contains("verify=crc32c"), "{name}");
            assert!(
                text.contains("verify_state_save=0"),
                "{name} leaves no state files"
            );
            // The same workload as the plain job file: every line of its [global] and job
            // sections is in the verifying one too.
            let settings = |t: &'static str| {
                t.lines()
                    .filter(|l| !l.starts_with(';') && l.contains('='))
                    .collect::<Vec<_>>()
            };
            for line in settings(p.job_file()) {
                if !line.starts_with("end_fsync") {
                    assert!(text.contains(line), "{name} lacks `{line}`");
                }
            }
        }
        let (_, store) = Profile::Store.verify_job_file().unwrap();
        assert!(
            store.contains("do_verify=0"),
            "the store only writes the headers"
        );
        let (_, load) = Profile::Load.verify_job_file().unwrap();
        assert!(load.contains("verify_fatal=1"), "a bad block fails the run");
    }
}
