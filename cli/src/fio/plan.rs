//! The plan of `kvtier fio-compare`: what will run (paths, profiles, row size, depths, the
//! files of each side), resolved and validated from the arguments before anything runs.

use std::path::PathBuf;

use crate::args::InFlightArgs;
use crate::fio::args::{FioCompareArgs, KvtierSide};
use crate::fio::runner::Profile;
use crate::size::format_size;
use kvtier::error::{Error, Result};
use kvtier::geometry::ChunkGeometry;
use kvtier::size::count;

/// How the files are prepared, in the words the report uses (engine side).
pub const FILE_STATE: &str = "preallocated with fallocate and written in full once before the \
first pass; store passes overwrite written extents, load passes read them";

/// How the files are prepared when kvtier runs through the G3 tier.
pub const FILE_STATE_G3: &str = "preallocated (fio: fallocate; kvtier: the G3 slabs, \
posix_fallocate) and written in full once before the first pass (kvtier: an untimed store pass \
fills every slot); store passes overwrite written extents, load passes read them";

/// What will run, resolved and validated from the arguments.
#[derive(Debug)]
pub(crate) struct Plan {
    pub(crate) paths: Vec<PathBuf>,
    pub(crate) profiles: Vec<Profile>,
    pub(crate) row_size: u64,
    /// Every row size to run (with `--plot --row-sizes`), ascending; includes `row_size`.
    pub(crate) row_sizes: Vec<u64>,
    pub(crate) per_file: u64,
    pub(crate) depth: u32,
    pub(crate) depths: Vec<u32>,
    pub(crate) pairs: usize,
    pub(crate) fio_files: Vec<PathBuf>,
    pub(crate) kvtier_files: Vec<PathBuf>,
    pub(crate) g3_dirs: Vec<PathBuf>,
    pub(crate) file_state: &'static str,
    pub(crate) side_name: &'static str,
    /// Run fio checking what it loads too (`--fio-verify`; load profile only).
    pub(crate) fio_verify: bool,
}

impl Plan {
    pub(crate) fn from_args(args: &FioCompareArgs) -> Result<Self> {
        let paths = args.path.dirs()?;
        let row_sizes = row_sizes(args)?;
        // Files hold whole rows of every size: the largest row divides the others' multiples
        // when the sizes are powers of two, and `slots_per_file` rounds down to it.
        let largest = row_sizes.iter().copied().max().unwrap_or(args.row_size);
        let per_file = ChunkGeometry::slots_per_file(args.size, paths.len(), largest) * largest;
        if per_file == 0 {
            return Err(Error::config(
                "--size",
                format!(
                    "{} over {} is less than one {} row per path",
                    format_size(args.size),
                    count(paths.len() as u64, "path"),
                    format_size(largest)
                ),
            ));
        }
        let depth = depth(args)?;
        if args.pairs == 0 {
            return Err(Error::config("--pairs", "must be at least 1"));
        }
        check_plot_folder(args)?;
        let depths = depths(args, depth)?;
        let profiles = profiles(args)?;
        if args.fio_verify && !profiles.contains(&Profile::Load) {
            return Err(Error::config(
                "--fio-verify",
                "fio checks what it loads, so it needs the load profile: add --profile load \
                 (or leave --profile out for store and load)",
            ));
        }
        let in_each = |name: &str| -> Vec<PathBuf> { paths.iter().map(|p| p.join(name)).collect() };
        let fio_files = in_each("kvtier-fio-compare.fio.dat");
        let (kvtier_files, g3_dirs, file_state, side_name) = match args.kvtier_side {
            KvtierSide::Engine => (
                in_each("kvtier-fio-compare.kvtier.dat"),
                Vec::new(),
                FILE_STATE,
                "engine",
            ),
            KvtierSide::G3 => (
                Vec::new(),
                in_each("kvtier-fio-compare.g3"),
                FILE_STATE_G3,
                "g3",
            ),
        };
        let plan = Plan {
            paths,
            profiles,
            row_size: args.row_size,
            row_sizes,
            per_file,
            depth,
            depths,
            pairs: args.pairs,
            fio_files,
            kvtier_files,
            g3_dirs,
            file_state,
            side_name,
            fio_verify: args.fio_verify,
        };
        check_buffer_sets(args.buffer_sets, plan.max_row_size(), plan.max_depth())?;
        Ok(plan)
    }

    pub(crate) fn max_row_size(&self) -> u64 {
        self.row_sizes
            .iter()
            .copied()
            .max()
            .unwrap_or(self.row_size)
    }

    pub(crate) fn max_depth(&self) -> u32 {
        self.depths.iter().copied().max().unwrap_or(self.depth)
    }

    /// Every plain test file (fio's, and kvtier's on the engine side).
    pub(crate) fn all_files(&self) -> Vec<PathBuf> {
        self.fio_files
            .iter()
            .chain(&self.kvtier_files)
            .cloned()
            .collect()
    }
}

/// `--row-size` and, with `--plot`, `--row-sizes`: every row size to run, ascending, each a
/// positive multiple of the row alignment and dividing the largest.
fn row_sizes(args: &FioCompareArgs) -> Result<Vec<u64>> {
    ChunkGeometry::check_row_size("--row-size", args.row_size)?;
    if !args.row_sizes.is_empty() && args.plot.is_none() {
        return Err(Error::config(
            "--row-sizes",
            "sweeps row sizes for --plot only",
        ));
    }
    let mut row_sizes = args.row_sizes.clone();
    row_sizes.push(args.row_size);
    row_sizes.sort_unstable();
    row_sizes.dedup();
    for &r in &row_sizes {
        ChunkGeometry::check_row_size("--row-sizes", r)?;
    }
    let largest = row_sizes.iter().copied().max().unwrap_or(args.row_size);
    if let Some(odd) = row_sizes.iter().find(|r| !largest.is_multiple_of(**r)) {
        return Err(Error::config(
            "--row-sizes",
            format!(
                "{} does not divide the largest row size {}",
                format_size(*odd),
                format_size(largest)
            ),
        ));
    }
    Ok(row_sizes)
}

/// Rows in flight per direction: `--iodepth`, or the rows `--max-bytes-in-flight` holds.
fn depth(args: &FioCompareArgs) -> Result<u32> {
    match args.iodepth {
        Some(0) => Err(Error::config("--iodepth", "must be at least 1")),
        Some(d) => Ok(d),
        None => u32::try_from(ChunkGeometry::rows_in_flight(
            args.in_flight.for_row(args.row_size)?,
            args.row_size,
        ))
        .map_err(|_| Error::config(InFlightArgs::KEY, "too large")),
    }
}

/// The `--plot` file's folder exists: found out before the runs, not after minutes of them.
fn check_plot_folder(args: &FioCompareArgs) -> Result<()> {
    if let Some(svg) = &args.plot {
        let parent = svg.parent().filter(|p| !p.as_os_str().is_empty());
        if parent.is_some_and(|p| !p.is_dir()) {
            return Err(Error::config(
                "--plot",
                format!("{}: its folder does not exist", svg.display()),
            ));
        }
    }
    Ok(())
}

/// Every depth to run, ascending, `depth` included: with `--plot`, `--depths` or the powers
/// of two below `depth`.
fn depths(args: &FioCompareArgs, depth: u32) -> Result<Vec<u32>> {
    let mut depths = if args.plot.is_some() {
        if args.depths.is_empty() {
            std::iter::successors(Some(1u32), |d| d.checked_mul(2))
                .take_while(|d| *d < depth)
                .collect()
        } else {
            args.depths.clone()
        }
    } else {
        Vec::new()
    };
    if depths.contains(&0) {
        return Err(Error::config("--depths", "depths must be at least 1"));
    }
    depths.push(depth);
    depths.sort_unstable();
    depths.dedup();
    Ok(depths)
}

/// The most bytes of buffer rows `--buffer-sets` may ask for.
const MAX_BUFFER_BYTES: u64 = 4 << 30;

/// `--buffer-sets` above 1: its rows (2 x sets x depth of the largest row, on either side)
/// must fit [`MAX_BUFFER_BYTES`].
fn check_buffer_sets(sets: u32, largest_row: u64, max_depth: u32) -> Result<()> {
    if sets == 1 {
        return Ok(()); // the rows of every run before --buffer-sets existed
    }
    let bytes = 2 * u64::from(sets) * u64::from(max_depth) * largest_row;
    if bytes > MAX_BUFFER_BYTES {
        return Err(Error::config(
            "--buffer-sets",
            format!(
                "{} sets of 2 x {max_depth} rows of {} need {} of buffers; at most {} (take \
                 fewer sets, a lower depth or smaller rows)",
                sets,
                format_size(largest_row),
                format_size(bytes),
                format_size(MAX_BUFFER_BYTES)
            ),
        ));
    }
    Ok(())
}

/// The profiles to compare (default store and load); mixed only on the engine side.
fn profiles(args: &FioCompareArgs) -> Result<Vec<Profile>> {
    let mut profiles = if args.profiles.is_empty() {
        vec![Profile::Store, Profile::Load]
    } else {
        args.profiles.clone()
    };
    profiles.dedup();
    if args.kvtier_side == KvtierSide::G3 && profiles.contains(&Profile::Mixed) {
        return Err(Error::config(
            "--profile",
            "mixed runs on the engine side only (concurrent stores would evict the keys \
             being loaded): add --kvtier-side engine",
        ));
    }
    Ok(profiles)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::parse_for_test;
    use kvtier::error::ErrorKind;

    fn plan(argv: &[&str]) -> Result<Plan> {
        Plan::from_args(&parse_for_test(argv))
    }

    #[test]
    fn defaults_are_store_and_load_at_2mib_depth_32_on_temp() {
        let p = plan(&[]).unwrap();
        assert_eq!(p.profiles, vec![Profile::Store, Profile::Load]);
        assert_eq!(p.row_size, 2 << 20);
        assert_eq!(p.depth, 32);
        assert_eq!(p.depths, vec![32]);
        assert_eq!(p.paths, vec![std::env::temp_dir()]);
        assert_eq!(p.per_file, 1 << 30);
        assert_eq!(p.pairs, 3);
    }

    #[test]
    fn buffer_sets_are_bounded() {
        let engine = |more: &[&str]| {
            let mut argv = vec!["--kvtier-side", "engine", "--iodepth", "32"];
            argv.extend_from_slice(more);
            plan(&argv)
        };
        let ok = engine(&["--buffer-sets", "64", "--row-size", "64KiB"]);
        assert!(ok.is_ok(), "{ok:?}");
        assert!(plan(&["--iodepth", "32", "--buffer-sets", "16"]).is_ok());
        // 2 directions x 64 sets x 32 rows x 2 MiB = 8 GiB.
        let big = engine(&["--buffer-sets", "64"]).unwrap_err();
        assert_eq!(big.kind(), ErrorKind::Config);
        assert!(big.to_string().contains("8 GiB"), "{big}");
        let zero = <FioCompareArgs as clap::Args>::augment_args(clap::Command::new("x"))
            .try_get_matches_from(["x", "--buffer-sets", "0"]);
        assert!(zero.is_err());
    }

    #[test]
    fn fio_verify_needs_the_load_profile() {
        assert!(!plan(&[]).unwrap().fio_verify);
        assert!(plan(&["--fio-verify"]).unwrap().fio_verify);
        assert!(
            plan(&["--fio-verify", "--profile", "load"])
                .unwrap()
                .fio_verify
        );
        let e = plan(&["--fio-verify", "--profile", "store"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains("--fio-verify"), "{e}");
        assert!(e.to_string().contains("--profile load"), "{e}");
    }

    #[test]
    fn plot_sweeps_powers_of_two_up_to_the_depth() {
        let p = plan(&["--plot", "x.svg", "--iodepth", "12"]).unwrap();
        assert_eq!(p.depths, vec![1, 2, 4, 8, 12]);
        let p = plan(&["--plot", "x.svg", "--depths", "4,1,4"]).unwrap();
        assert_eq!(p.depths, vec![1, 4, 32]);
        let p = plan(&[
            "--plot",
            "x.svg",
            "--row-sizes",
            "16MiB,64KiB",
            "--size",
            "40MiB",
        ])
        .unwrap();
        assert_eq!(p.row_sizes, vec![64 << 10, 2 << 20, 16 << 20]);
        assert_eq!(p.max_row_size(), 16 << 20);
        assert_eq!(p.per_file, 32 << 20, "whole rows of the largest size");
        assert_eq!(
            plan(&["--row-sizes", "64KiB"]).unwrap_err().kind(),
            kvtier::error::ErrorKind::Config
        );
        let e = plan(&["--plot", "x.svg", "--row-sizes", "3MiB"]).unwrap_err();
        assert!(e.to_string().contains("does not divide"), "{e}");
    }

    #[test]
    fn user_mistakes_are_config_or_path_errors() {
        assert_eq!(
            plan(&["--row-size", "1000"]).unwrap_err().kind(),
            ErrorKind::Config
        );
        assert_eq!(
            plan(&["--iodepth", "0"]).unwrap_err().kind(),
            ErrorKind::Config
        );
        assert_eq!(
            plan(&["--pairs", "0"]).unwrap_err().kind(),
            ErrorKind::Config
        );
        assert_eq!(
            plan(&["--size", "1MiB"]).unwrap_err().kind(),
            ErrorKind::Config
        );
        let e = plan(&["--path", "/nonexistent/kvtier"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidPath);
        assert!(e.to_string().contains("/nonexistent/kvtier"), "{e}");
        let f = tempfile::NamedTempFile::new().unwrap();
        let e = plan(&["--path", f.path().to_str().unwrap()]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidPath);
        assert!(e.to_string().contains("not a directory"), "{e}");
    }

    #[test]
    fn several_paths_split_the_size_in_whole_rows() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let (a, b) = (a.path().to_str().unwrap(), b.path().to_str().unwrap());
        let p = plan(&[
            "--path",
            a,
            "--path",
            b,
            "--size",
            "5MiB",
            "--row-size",
            "1MiB",
        ])
        .unwrap();
        assert_eq!(p.per_file, 2 << 20);
        assert_eq!(p.fio_files.len(), 2);
        assert_ne!(p.fio_files[0], p.fio_files[1]);
        let e = plan(&["--path", a, "--path", a]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains("given twice"), "{e}");
    }
}
