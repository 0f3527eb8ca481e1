//! `device-bundle`: CUDA test and benchmark binaries for a machine that has
//! a GPU but no Rust toolchain. CUDA is loaded at run time (cudarc), so the
//! binaries build anywhere.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::{cargo, run};

/// The test binaries that exercise kernels (the others need no GPU).
const GPU_TESTS: &[&str] = &[
    "rms_norm",
    "model_step",
    "swiglu",
    "geglu",
    "rope",
    "cross_entropy",
    "matmul",
    "hf_parity",
    "training",
];

/// Builds with cargo and returns the executables it reports.
fn build_executables(args: &[&str]) -> Result<Vec<(String, PathBuf)>, String> {
    let mut cmd = cargo();
    cmd.args(args)
        .args(["--all-features", "--message-format=json-render-diagnostics"]);
    cmd.stdout(Stdio::piped());
    eprintln!("xtask: running {cmd:?}");
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("could not start cargo: {e}"))?;
    let mut out = Vec::new();
    for line in BufReader::new(child.stdout.take().expect("piped stdout")).lines() {
        let line = line.map_err(|e| e.to_string())?;
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if let (Some(exe), Some(name)) =
            (msg["executable"].as_str(), msg["target"]["name"].as_str())
        {
            let pkg = msg["package_id"].as_str().unwrap_or_default();
            let crate_name = if pkg.contains("bastile-cubecl") {
                "cubecl"
            } else if pkg.contains("bastile-models") {
                "models"
            } else {
                "burn"
            };
            out.push((format!("{crate_name}-{name}"), PathBuf::from(exe)));
        }
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    if !status.success() {
        return Err(format!("cargo {args:?} failed with {status}"));
    }
    Ok(out)
}

/// Stages the binaries in `target/device-bundle`, then writes
/// `<dest>/bastile-cuda.tar.xz` (stripped binaries compress about 5×, which
/// keeps the bundle well under 64 MiB) and `<dest>/run.sh`, which unpacks
/// and runs it. `only` narrows the GPU tests to those names.
pub fn build(dest: &str, only: &[String]) -> Result<(), String> {
    if let Some(bad) = only.iter().find(|o| !GPU_TESTS.contains(&o.as_str())) {
        return Err(format!("unknown GPU test `{bad}`; known: {GPU_TESTS:?}"));
    }
    let wanted: Vec<&str> = if only.is_empty() {
        GPU_TESTS.to_vec()
    } else {
        only.iter().map(String::as_str).collect()
    };
    let dest = Path::new(dest);
    let out = Path::new("target/device-bundle");
    let _ = std::fs::remove_dir_all(out);
    let _ = std::fs::remove_dir_all(dest);
    std::fs::create_dir_all(out.join("tests")).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(dest).map_err(|e| e.to_string())?;
    let tests = build_executables(&[
        "test",
        "-p",
        "bastile-cubecl",
        "-p",
        "bastile",
        "-p",
        "bastile-models",
        "--no-run",
    ])?;
    let bench = build_executables(&["build", "-p", "bastile-benches", "--bin", "bastile-bench"])?;
    let mut names = Vec::new();
    for (name, exe) in tests
        .into_iter()
        .filter(|(n, _)| wanted.iter().any(|t| n.ends_with(&format!("-{t}"))))
    {
        let dest = out.join("tests").join(&name);
        std::fs::copy(&exe, &dest).map_err(|e| format!("copying {}: {e}", exe.display()))?;
        run(Command::new("strip").arg(&dest))?;
        names.push(name);
    }
    let (_, bench_exe) = bench.first().ok_or("cargo built no benchmark binary")?;
    std::fs::copy(bench_exe, out.join("bastile-bench")).map_err(|e| e.to_string())?;
    run(Command::new("strip").arg(out.join("bastile-bench")))?;
    // The tests run with CubeCL's bounds checks on, as in CI.
    std::fs::write(
        out.join("tests/cubecl.toml"),
        "[compilation]\ncheck_mode = \"validate\"\n",
    )
    .map_err(|e| e.to_string())?;
    let script = format!(
        r#"#!/usr/bin/env bash
# Runs Bastile's CUDA tests and benchmarks on a machine without Rust.
# Usage: run.sh [tests|bench|all] [results-dir] [test binaries...]
# Extra benchmark arguments (e.g. `--op swiglu`) come from $BENCH_ARGS.
set -uo pipefail
archive="$(cd "$(dirname "$0")" && pwd)/bastile-cuda.tar.xz"
here="${{TMPDIR:-/tmp}}/bastile-cuda"; rm -rf "$here"; mkdir -p "$here"
tar -C "$here" -xJf "$archive" || python3 -c "import sys,tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$archive" "$here"
what="${{1:-all}}"; results="${{2:-$here/results}}"; mkdir -p "$results"
shift 2 2>/dev/null || shift $#
selected="${{*:-{tests}}}"
export BASTILE_TEST_RUNTIMES=cuda XDG_RUNTIME_DIR="${{XDG_RUNTIME_DIR:-/tmp}}"
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  for t in $selected; do
    echo "== $t"; (cd "$here/tests" && "./$t" --test-threads=1) 2>&1 | tee "$results/$t.log" || status=1
  done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  (cd "$here" && ./bastile-bench --runtime cuda --out "$results/cuda-bench.json" ${{BENCH_ARGS:-}}) 2>&1 | tee "$results/bench.log" || status=1
fi
exit $status
"#,
        tests = names.join(" ")
    );
    let script_path = dest.join("run.sh");
    std::fs::write(&script_path, script).map_err(|e| e.to_string())?;
    run(Command::new("chmod").arg("+x").arg(&script_path))?;
    let archive = dest.join("bastile-cuda.tar.xz");
    run(Command::new("tar")
        .arg("-C")
        .arg(out)
        .args(["-cJf"])
        .arg(
            std::fs::canonicalize(dest)
                .map_err(|e| e.to_string())?
                .join("bastile-cuda.tar.xz"),
        )
        .arg(".")
        .env("XZ_OPT", "-T0 -6"))?;
    run(Command::new("du").args(["-sh"]).arg(&archive))?;
    eprintln!(
        "xtask: bundle ready in {}; run `{}` on the CUDA machine",
        dest.display(),
        script_path.display()
    );
    Ok(())
}
