//! `cargo xtask`: the project's commands.
//!
//! * `test`: installs what the tests need on a machine without a GPU (Mesa's
//!   software Vulkan driver) and runs every test of the workspace on it, or on
//!   CUDA with `--cuda`.
//! * `bench`: builds and runs the benchmark program.
//! * `device-bundle`: builds the CUDA test and benchmark binaries into a
//!   folder, with a script that runs them on a machine without Rust.

mod bundle;
mod setup;

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
    /// Run every test of the workspace (software Vulkan by default).
    Test {
        /// Run the kernel tests on CUDA instead of the software Vulkan driver.
        #[arg(long)]
        cuda: bool,
        /// Do not install missing system packages.
        #[arg(long)]
        no_setup: bool,
        /// Extra arguments passed to `cargo test`.
        #[arg(last = true)]
        rest: Vec<String>,
    },
    /// Run the benchmarks and write the results.
    Bench {
        /// `rms-norm` (all ops when omitted).
        #[arg(long)]
        op: Option<String>,
        /// `cuda` or `wgpu`; CUDA when `nvidia-smi` finds a GPU, else wgpu with tiny shapes.
        #[arg(long)]
        runtime: Option<String>,
        /// Small shapes (forced on wgpu).
        #[arg(long)]
        tiny: bool,
        /// Results file (JSON; Markdown is written beside it).
        #[arg(long)]
        out: Option<String>,
        /// Further `bastile-bench` arguments, e.g. `-- --model qwen3-0.6b --seq 1024,4096`.
        #[arg(last = true)]
        rest: Vec<String>,
    },
    /// Build the CUDA test and benchmark binaries for a machine without Rust.
    DeviceBundle {
        /// Output folder (git-ignored).
        #[arg(long, default_value = ".device")]
        out: String,
        /// Bundle only these GPU test binaries (names such as `rope` or
        /// `cross_entropy`), to stay under the carry limit; all by default.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
    },
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Cmd::Test {
            cuda,
            no_setup,
            rest,
        } => test(cuda, no_setup, &rest),
        Cmd::Bench {
            op,
            runtime,
            tiny,
            out,
            rest,
        } => bench(op, runtime, tiny, out, &rest),
        Cmd::DeviceBundle { out, only } => bundle::build(&out, &only),
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

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn test(cuda: bool, no_setup: bool, rest: &[String]) -> Result<(), String> {
    if !cuda {
        setup::software_vulkan(!no_setup)?;
    }
    let mut cmd = cargo();
    cmd.args(["test", "--workspace", "--all-features"])
        .args(rest);
    cmd.env("BASTILE_TEST_RUNTIMES", if cuda { "cuda" } else { "wgpu" });
    setup::runtime_dir(&mut cmd);
    run(&mut cmd)
}

fn bench(
    op: Option<String>,
    runtime: Option<String>,
    tiny: bool,
    out: Option<String>,
    rest: &[String],
) -> Result<(), String> {
    let runtime = runtime.unwrap_or_else(|| {
        if setup::has_nvidia_gpu() {
            "cuda".into()
        } else {
            "wgpu".into()
        }
    });
    let tiny = tiny || runtime == "wgpu";
    if runtime == "wgpu" {
        setup::software_vulkan(true)?;
        eprintln!(
            "xtask: no CUDA GPU selected: running the tiny configuration on wgpu (functional, not performance numbers)"
        );
    }
    let out = out.unwrap_or_else(|| {
        format!(
            "benches/results/{runtime}{}.json",
            if tiny { "-tiny" } else { "" }
        )
    });
    let mut cmd = cargo();
    cmd.args([
        "run",
        "-p",
        "bastile-benches",
        "--all-features",
        "--bin",
        "bastile-bench",
        "--",
    ]);
    cmd.args(["--runtime", &runtime, "--out", &out]);
    if tiny {
        cmd.arg("--tiny");
    }
    if let Some(op) = op {
        cmd.args(["--op", &op]);
    }
    cmd.args(rest);
    setup::runtime_dir(&mut cmd);
    run(&mut cmd)
}
