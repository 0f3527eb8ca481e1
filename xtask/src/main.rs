//! `cargo xtask`: the project's commands.
//!
//! * `test`: installs what the tests need on a machine without a GPU (Mesa's
//!   software Vulkan driver) and runs every test of the workspace on it, or on
//!   CUDA with `--cuda`, ending with the time each test binary took to build
//!   and to run.
//! * `bench`: builds and runs the benchmark program.
//! * `device-bundle`: builds the CUDA test and benchmark binaries into a
//!   folder, with a script that runs them on a machine without Rust.

mod bundle;
mod setup;
mod testrun;

use std::process::{Command, ExitCode};

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Bastile's project commands")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run every test of the workspace (software Vulkan by default) and
    /// print the time each test binary took to build and to run.
    Test {
        /// Run the kernel tests on CUDA instead of the software Vulkan driver.
        #[arg(long)]
        cuda: bool,
        /// Do not install missing system packages.
        #[arg(long)]
        no_setup: bool,
        /// Test only these packages (e.g. `-p bastile-cubecl`).
        #[arg(short, long = "package")]
        packages: Vec<String>,
        /// Arguments for every test binary: name filters such as
        /// `attention::`, `--test-threads=1`, `--nocapture`.
        #[arg(last = true)]
        test_args: Vec<String>,
    },
    /// Run the benchmarks and write the results (`cargo xtask bench --help`
    /// lists the options). With no arguments: the default suite on CUDA
    /// when `nvidia-smi` finds a GPU, else the tiny configuration on the
    /// software Vulkan driver; results go to `benches/results/<runtime>.json`
    /// (and `.md`, `-*.png`).
    #[command(disable_help_flag = true)]
    Bench {
        /// `bastile-bench` arguments, e.g. `--model qwen3-0.6b --seq 1024,4096
        /// --compare-pytorch`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build the CUDA test and benchmark binaries for a machine without Rust.
    DeviceBundle {
        /// Output folder (git-ignored).
        #[arg(long, default_value = ".device")]
        out: String,
        /// The GPU test modules `run.sh` runs when it is given none (names
        /// such as `rope` or `cross_entropy`); all by default.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        /// Leave the benchmark program out (a test-only bundle builds
        /// sooner).
        #[arg(long)]
        no_bench: bool,
    },
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Cmd::Test {
            cuda,
            no_setup,
            packages,
            test_args,
        } => testrun::test(&testrun::TestArgs {
            cuda,
            setup: !no_setup,
            packages,
            test_args,
        }),
        Cmd::Bench { args } => bench(args),
        Cmd::DeviceBundle {
            out,
            only,
            no_bench,
        } => bundle::build(&out, &only, !no_bench),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs `cmd`, echoing it; an error says which command failed.
pub fn run(cmd: &mut Command) -> Result<(), String> {
    eprintln!("xtask: running {cmd:?}");
    let status = cmd
        .status()
        .map_err(|e| format!("could not start {cmd:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed with {status}"))
    }
}

/// Runs `cmd`, hands each line of its standard output to `line` as it
/// comes (its standard error passes through), and returns whether it
/// succeeded.
pub fn stream_stdout(cmd: &mut Command, mut line: impl FnMut(&str)) -> Result<bool, String> {
    cmd.stdout(std::process::Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("could not start {cmd:?}: {e}"))?;
    let stdout = child.stdout.take().expect("piped stdout");
    for text in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
        line(&text.map_err(|e| e.to_string())?);
    }
    Ok(child.wait().map_err(|e| e.to_string())?.success())
}

/// Runs a cargo command given `--message-format=json-render-diagnostics`
/// (its diagnostics still reach the terminal) and returns the messages of
/// the artifacts it built that have an executable: test binaries, bins.
pub fn cargo_executables(cmd: &mut Command) -> Result<Vec<serde_json::Value>, String> {
    eprintln!("xtask: running {cmd:?}");
    let mut out = Vec::new();
    let ok = stream_stdout(cmd, |line| {
        if let Ok(msg) = serde_json::from_str::<serde_json::Value>(line)
            && msg["executable"].is_string()
        {
            out.push(msg);
        }
    })?;
    if ok {
        Ok(out)
    } else {
        Err(format!("{cmd:?} failed"))
    }
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

/// The value of `--name value` or `--name=value` in `args`.
fn flag_value(args: &[String], name: &str) -> Option<String> {
    let eq = format!("{name}=");
    args.iter().enumerate().find_map(|(i, a)| {
        if a == name {
            args.get(i + 1).cloned()
        } else {
            a.strip_prefix(&eq).map(str::to_owned)
        }
    })
}

fn bench(mut args: Vec<String>) -> Result<(), String> {
    let has = |args: &[String], flag: &str| args.iter().any(|a| a == flag);
    let help = has(&args, "--help") || has(&args, "-h");
    // Redrawing earlier results needs no device.
    let replot = flag_value(&args, "--replot").is_some();
    if !help && !replot {
        let runtime = flag_value(&args, "--runtime").unwrap_or_else(|| {
            let r = if setup::has_nvidia_gpu() {
                "cuda"
            } else {
                "wgpu"
            };
            args.extend(["--runtime".into(), r.into()]);
            r.into()
        });
        let tiny = has(&args, "--tiny") || runtime == "wgpu";
        if runtime == "wgpu" {
            setup::software_vulkan(true)?;
            if !has(&args, "--tiny") {
                args.push("--tiny".into());
            }
            eprintln!(
                "xtask: no CUDA GPU selected: running the tiny configuration on wgpu (functional, not performance numbers)"
            );
        }
        if flag_value(&args, "--out").is_none() {
            let out = format!(
                "benches/results/{runtime}{}.json",
                if tiny { "-tiny" } else { "" }
            );
            args.extend(["--out".into(), out]);
        }
    }
    let mut cmd = cargo();
    // Benchmarks measure the release build, as users run it.
    cmd.args([
        "run",
        "--release",
        "-p",
        "bastile-benches",
        "--all-features",
        "--bin",
        "bastile-bench",
        "--",
    ]);
    cmd.args(&args);
    setup::runtime_dir(&mut cmd);
    run(&mut cmd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_values_are_found_in_both_spellings() {
        let args: Vec<String> = ["--model", "m", "--out=x.json", "--tiny"]
            .map(String::from)
            .to_vec();
        assert_eq!(flag_value(&args, "--model").as_deref(), Some("m"));
        assert_eq!(flag_value(&args, "--out").as_deref(), Some("x.json"));
        assert_eq!(flag_value(&args, "--runtime"), None);
    }
}
