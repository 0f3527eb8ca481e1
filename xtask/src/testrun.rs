//! `test`: builds the workspace's test binaries once, runs each of them and
//! the doc tests, and ends with the time spent building and running each,
//! so a slow test is visible the day it is added.
//!
//! The software-Vulkan run builds only the `wgpu` runtime (the CUDA code is
//! type-checked by the device bundle's build and by clippy), the CUDA run
//! only `cuda`: generic tests are instantiated once per compiled runtime,
//! and a runtime the run cannot select would only cost compile time.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use crate::{cargo, cargo_executables, setup, stream_stdout};

/// The environment variable capping how many candidates a tuning run
/// benchmarks (`bastile_cubecl::tune::tuned_candidates_limit`).
const TUNE_CANDIDATES: &str = "BASTILE_TUNE_CANDIDATES";

/// The environment variable choosing between each op's default launch
/// configuration and tuning (`bastile_cubecl::tune::tune_policy`).
const TUNE_POLICY: &str = "BASTILE_TUNE";

/// How many of the slowest tests the closing report lists.
const SLOWEST_SHOWN: usize = 12;

/// What `cargo xtask test` was asked for.
pub struct TestArgs {
    pub cuda: bool,
    /// Install the software Vulkan driver if it is missing (off CUDA).
    pub setup: bool,
    /// Packages to test (`-p`); the whole workspace when empty.
    pub packages: Vec<String>,
    /// Arguments for every test binary (filters, `--test-threads`, ...).
    pub test_args: Vec<String>,
}

/// One test binary cargo built.
struct TestBinary {
    package: String,
    /// `tests/main.rs`, `lib`, `bin bastile`, ...
    target: String,
    executable: PathBuf,
    /// The package's folder: cargo runs tests from there, and the tests read
    /// their `cubecl.toml` and fixtures relative to it.
    dir: PathBuf,
}

/// A libtest summary line's counts.
#[derive(Default, Clone, Copy)]
struct Counts {
    passed: u64,
    failed: u64,
    ignored: u64,
}

impl Counts {
    /// Parses `test result: ok. 3 passed; 0 failed; 1 ignored; ...`.
    fn parse(line: &str) -> Option<Counts> {
        let rest = line.trim().strip_prefix("test result: ")?;
        let number = |label: &str| -> Option<u64> {
            rest.split(';')
                .map(|part| {
                    part.trim()
                        .trim_start_matches("ok. ")
                        .trim_start_matches("FAILED. ")
                })
                .find_map(|part| part.strip_suffix(label)?.trim().parse().ok())
        };
        Some(Counts {
            passed: number("passed")?,
            failed: number("failed")?,
            ignored: number("ignored").unwrap_or(0),
        })
    }

    fn add(&mut self, other: Counts) {
        self.passed += other.passed;
        self.failed += other.failed;
        self.ignored += other.ignored;
    }
}

impl TestArgs {
    /// The one runtime the run builds and tests.
    fn runtime(&self) -> &'static str {
        if self.cuda { "cuda" } else { "wgpu" }
    }
}

/// The cargo arguments selecting the packages and the one runtime. Without
/// the default features, Burn's own autotuning (`autotune`) stays out: on
/// the software driver it compiled and timed every candidate kernel of
/// Burn's for each new shape, about half of each model test's time, and
/// the tests check values, which Burn's default kernels give as well.
fn selection(args: &TestArgs) -> Vec<String> {
    let mut out: Vec<String> = if args.packages.is_empty() {
        vec!["--workspace".into()]
    } else {
        args.packages
            .iter()
            .flat_map(|p| ["-p".to_string(), p.clone()])
            .collect()
    };
    out.extend([
        "--no-default-features".into(),
        "--features".into(),
        args.runtime().into(),
    ]);
    out
}

/// The label of a library's unit tests.
const LIB_LABEL: &str = "lib (unit tests)";

fn target_label(target: &serde_json::Value) -> String {
    let kind = target["kind"][0].as_str().unwrap_or("?");
    let src = target["src_path"].as_str().unwrap_or("");
    match kind {
        "test" => src.rsplit_once("/tests/").map_or_else(
            || format!("test {}", target["name"]),
            |(_, f)| format!("tests/{f}"),
        ),
        "lib" => LIB_LABEL.into(),
        other => format!(
            "{other} {} (unit tests)",
            target["name"].as_str().unwrap_or("?")
        ),
    }
}

/// Builds every test binary (`cargo test --no-run --timings`) and returns
/// them in the order cargo reported them.
fn build(args: &TestArgs) -> Result<Vec<TestBinary>, String> {
    let mut cmd = cargo();
    cmd.args([
        "test",
        "--no-run",
        "--timings",
        "--message-format=json-render-diagnostics",
    ])
    .args(selection(args));
    let built =
        cargo_executables(&mut cmd).map_err(|e| format!("building the tests failed: {e}"))?;
    Ok(built
        .iter()
        .filter(|msg| msg["profile"]["test"].as_bool().unwrap_or(false))
        .map(|msg| {
            let manifest = PathBuf::from(msg["manifest_path"].as_str().unwrap_or("."));
            TestBinary {
                package: package_name(msg["package_id"].as_str().unwrap_or("?")),
                target: target_label(&msg["target"]),
                executable: PathBuf::from(msg["executable"].as_str().unwrap_or_default()),
                dir: manifest.parent().map(PathBuf::from).unwrap_or_default(),
            }
        })
        .collect())
}

/// `bastile-cubecl` from a package id (`path+file:///…/bastile-cubecl#0.1.0`
/// or the older `bastile-cubecl 0.1.0 (path+file://…)`).
fn package_name(id: &str) -> String {
    match id.split_once('#') {
        // `…/models#bastile-models@0.1.0` names the package after the '#'.
        Some((path, fragment)) => fragment
            .split_once('@')
            .map_or_else(|| path.rsplit('/').next().unwrap_or(path), |(name, _)| name)
            .to_string(),
        None => id.split_whitespace().next().unwrap_or(id).to_string(),
    }
}

/// A test's name and run time from libtest's `--report-time` line,
/// `test attention::masks ... ok <12.345s>`.
fn test_time(line: &str) -> Option<(String, f64)> {
    let rest = line.strip_prefix("test ")?;
    let (name, outcome) = rest.split_once(" ... ")?;
    let secs = outcome.rsplit_once('<')?.1.strip_suffix("s>")?;
    Some((name.to_string(), secs.parse().ok()?))
}

/// What one run of a test binary (or of the doc tests) printed.
#[derive(Default)]
struct RunOutput {
    counts: Counts,
    /// Each test's run time, where libtest reported it.
    times: Vec<(String, f64)>,
    ok: bool,
}

/// Runs `cmd`, echoing its standard output, and returns the libtest counts
/// and test times it printed and whether it succeeded.
fn run_counting(cmd: &mut Command) -> Result<RunOutput, String> {
    let mut out = RunOutput::default();
    out.ok = stream_stdout(cmd, |line| {
        println!("{line}");
        if let Some(c) = Counts::parse(line) {
            out.counts.add(c);
        }
        out.times.extend(test_time(line));
    })?;
    Ok(out)
}

/// Build times from the report `--timings` wrote.
struct BuildTimes {
    /// Each of the workspace's own units and its seconds.
    own: Vec<(String, f64)>,
    /// The dependencies' seconds, summed over the units (which overlap on
    /// several cores).
    deps: f64,
    dep_units: usize,
}

/// The build time of each of the workspace's own units, from the report
/// `--timings` wrote (`const UNIT_DATA = [...]` in its HTML), and the sum
/// over the dependencies.
fn build_times(target_dir: &str) -> Option<BuildTimes> {
    let html =
        std::fs::read_to_string(format!("{target_dir}/cargo-timings/cargo-timing.html")).ok()?;
    let start = html.find("UNIT_DATA = ")? + "UNIT_DATA = ".len();
    let end = start + html[start..].find("];")? + 1;
    let units: Vec<serde_json::Value> = serde_json::from_str(&html[start..end]).ok()?;
    let ours = ["bastile", "xtask"];
    let mut times = BuildTimes {
        own: Vec::new(),
        deps: 0.0,
        dep_units: 0,
    };
    for u in &units {
        let name = u["name"].as_str().unwrap_or("?");
        let duration = u["duration"].as_f64().unwrap_or(0.0);
        if ours.iter().any(|o| name.starts_with(o)) {
            let target = u["target"].as_str().unwrap_or("").trim();
            let label = if target.is_empty() {
                name.to_string()
            } else {
                format!("{name} {target}")
            };
            times.own.push((label, duration));
        } else {
            times.deps += duration;
            times.dep_units += 1;
        }
    }
    Some(times)
}

fn target_dir() -> String {
    let out = cargo()
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .output()
        .ok()
        .filter(|o| o.status.success());
    out.and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok())
        .and_then(|m| m["target_directory"].as_str().map(str::to_owned))
        .unwrap_or_else(|| "target".into())
}

/// Builds, runs every test binary and the doc tests, then prints the
/// timings and one closing line with the counts. Every binary runs even
/// when an earlier one failed; the error names the ones that did.
pub fn test(args: &TestArgs) -> Result<(), String> {
    if !args.cuda {
        setup::software_vulkan(args.setup)?;
    }
    let started = Instant::now();
    let binaries = build(args)?;
    let build_s = started.elapsed().as_secs_f64();
    let mut rows: Vec<(String, RunOutput, f64)> = Vec::new();
    // Every candidate is checked on its own by the `*_every_candidate` tests;
    // the tuned entry points tune (programs run each op's default instead):
    // off CUDA among the first two candidates, on CUDA (or
    // with BASTILE_TEST_THOROUGH=1, see `bastile_cubecl::testing::thorough`)
    // among all of them.
    let thorough = std::env::var("BASTILE_TEST_THOROUGH").is_ok_and(|v| v == "1");
    let cap_tuning = !args.cuda && !thorough && std::env::var_os(TUNE_CANDIDATES).is_none();
    for b in &binaries {
        let label = format!("{} {}", b.package, b.target);
        eprintln!("xtask: running {label} ({})", b.executable.display());
        let t = Instant::now();
        let mut cmd = Command::new(&b.executable);
        // Each test's time (`--report-time`) is a libtest option that
        // stable toolchains accept only with RUSTC_BOOTSTRAP set.
        cmd.args(["-Z", "unstable-options", "--report-time"])
            .args(&args.test_args)
            .current_dir(&b.dir)
            .env("RUSTC_BOOTSTRAP", "1")
            .env("CARGO_MANIFEST_DIR", &b.dir)
            .env("BASTILE_TEST_RUNTIMES", args.runtime());
        if std::env::var_os(TUNE_POLICY).is_none() {
            cmd.env(TUNE_POLICY, "full");
        }
        if cap_tuning {
            cmd.env(TUNE_CANDIDATES, "2");
        }
        setup::runtime_dir(&mut cmd);
        let out = run_counting(&mut cmd)?;
        rows.push((label, out, t.elapsed().as_secs_f64()));
    }
    // Doc tests are compiled when they run; filters apply to them too. Only
    // libraries have them (cargo refuses `--doc` for a binary-only package).
    if binaries.iter().any(|b| b.target == LIB_LABEL) {
        let t = Instant::now();
        let mut doc = cargo();
        doc.args(["test", "--doc"]).args(selection(args));
        if !args.test_args.is_empty() {
            doc.arg("--").args(&args.test_args);
        }
        eprintln!("xtask: running {doc:?}");
        let out = run_counting(&mut doc)?;
        rows.push((
            "doc tests (compiled and run)".into(),
            out,
            t.elapsed().as_secs_f64(),
        ));
    }

    eprintln!("\nxtask: time per step (build: cargo --timings; run: wall clock)");
    if let Some(times) = build_times(&target_dir()) {
        eprintln!(
            "  build  {:>8.1} s  dependencies ({} units, their times summed)",
            times.deps, times.dep_units
        );
        for (name, s) in times.own {
            eprintln!("  build  {s:>8.1} s  {name}");
        }
    }
    eprintln!("  build  {build_s:>8.1} s  wall clock, every test binary");
    let mut total = Counts::default();
    let mut slowest: Vec<(f64, String)> = Vec::new();
    for (label, out, secs) in &rows {
        total.add(out.counts);
        eprintln!(
            "  run    {secs:>8.1} s  {label}: {} passed, {} failed, {} ignored{}",
            out.counts.passed,
            out.counts.failed,
            out.counts.ignored,
            if out.ok { "" } else { " (FAILED)" }
        );
        slowest.extend(
            out.times
                .iter()
                .map(|(name, s)| (*s, format!("{label}: {name}"))),
        );
    }
    eprintln!("  total  {:>8.1} s", started.elapsed().as_secs_f64());
    slowest.sort_by(|a, b| b.0.total_cmp(&a.0));
    if !slowest.is_empty() {
        eprintln!("xtask: the slowest tests (tests of one binary run two at a time)");
        for (secs, name) in slowest.iter().take(SLOWEST_SHOWN) {
            eprintln!("  {secs:>8.1} s  {name}");
        }
    }
    println!(
        "tests: {} passed, {} failed, {} skipped",
        total.passed, total.failed, total.ignored
    );
    let failed: Vec<&str> = rows
        .iter()
        .filter(|r| !r.1.ok)
        .map(|r| r.0.as_str())
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("failed: {}", failed.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtest_summaries_are_counted() {
        let c = Counts::parse(
            "test result: FAILED. 12 passed; 2 failed; 3 ignored; 0 measured; 0 filtered out; finished in 1.20s",
        )
        .expect("a summary");
        assert_eq!((c.passed, c.failed, c.ignored), (12, 2, 3));
        assert!(Counts::parse("test foo ... ok").is_none());
    }

    #[test]
    fn reported_test_times_are_read() {
        assert_eq!(
            test_time("test attention::masks ... ok <12.345s>"),
            Some(("attention::masks".to_string(), 12.345))
        );
        assert_eq!(test_time("test attention::masks ... ok"), None);
    }

    #[test]
    fn package_names_come_from_both_id_forms() {
        assert_eq!(
            package_name("path+file:///w/bastile-cubecl#0.1.0"),
            "bastile-cubecl"
        );
        assert_eq!(
            package_name("path+file:///w/models#bastile-models@0.1.0"),
            "bastile-models"
        );
        assert_eq!(
            package_name("bastile 0.1.0 (path+file:///w/bastile-burn)"),
            "bastile"
        );
    }
}
