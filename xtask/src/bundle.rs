//! `device-bundle`: CUDA test and benchmark binaries for a machine that has
//! a GPU but no Rust toolchain. CUDA is loaded at run time (cudarc), so the
//! binaries build anywhere.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{cargo, cargo_executables, run};

/// The test modules that exercise kernels (the others need no GPU). Each
/// crate's tests are one binary (`tests/main.rs`); these names are its
/// modules, passed to the binaries as filters (`rope::`).
const GPU_TESTS: &[&str] = &[
    "attention",
    "batched_linear",
    "rms_norm",
    "model_step",
    "swiglu",
    "geglu",
    "rope",
    "combine",
    "combine_rows",
    "cross_entropy",
    "embedding",
    "expert_groups",
    "gather",
    "gather_rows",
    "router",
    "lora",
    "reduce",
    "streams",
    "matmul",
    "adamw",
    "checkpointing",
    "hf_parity",
    "moe",
    "training",
    "parallel",
];

/// Builds with cargo and returns the executables it reports, named after
/// their crate and target (`cubecl-main`).
fn build_executables(args: &[&str]) -> Result<Vec<(String, PathBuf)>, String> {
    let mut cmd = cargo();
    // `distributed` is CUDA with data-parallel training (NCCL); `autotune`
    // is Burn's, on as programs (the benchmark among them) run.
    cmd.args(args).args([
        "--no-default-features",
        "--features",
        "distributed,autotune",
        "--message-format=json-render-diagnostics",
    ]);
    let built = cargo_executables(&mut cmd)?;
    Ok(built
        .iter()
        .map(|msg| {
            let pkg = msg["package_id"].as_str().unwrap_or_default();
            let crate_name = if pkg.contains("bastile-cubecl") {
                "cubecl"
            } else if pkg.contains("bastile-models") {
                "models"
            } else {
                "burn"
            };
            let name = msg["target"]["name"].as_str().unwrap_or("?");
            let exe = msg["executable"].as_str().unwrap_or_default();
            (format!("{crate_name}-{name}"), PathBuf::from(exe))
        })
        .collect())
}

/// Stages the binaries in `target/device-bundle`, then writes
/// `<dest>/bastile-cuda.tar.xz` (stripped binaries compress about 5×, which
/// keeps the bundle well under 64 MiB) and `<dest>/run.sh`, which unpacks
/// and runs it. `only` narrows the GPU test modules run by default to those
/// names; `with_bench` adds the benchmark program.
pub fn build(dest: &str, only: &[String], with_bench: bool) -> Result<(), String> {
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
    let mut names = Vec::new();
    for (name, exe) in tests.into_iter().filter(|(n, _)| n.ends_with("-main")) {
        let dest = out.join("tests").join(&name);
        std::fs::copy(&exe, &dest).map_err(|e| format!("copying {}: {e}", exe.display()))?;
        run(Command::new("strip").arg(&dest))?;
        names.push(name);
    }
    if with_bench {
        // Benchmarks measure the release build, as users run it.
        let bench = build_executables(&[
            "build",
            "--release",
            "-p",
            "bastile-benches",
            "--bin",
            "bastile-bench",
        ])?;
        let (_, bench_exe) = bench.first().ok_or("cargo built no benchmark binary")?;
        std::fs::copy(bench_exe, out.join("bastile-bench")).map_err(|e| e.to_string())?;
        run(Command::new("strip").arg(out.join("bastile-bench")))?;
    }
    // The tests run with CubeCL's bounds checks on, as in CI.
    std::fs::write(
        out.join("tests/cubecl.toml"),
        "[compilation]\ncheck_mode = \"validate\"\n",
    )
    .map_err(|e| e.to_string())?;
    let script = format!(
        r#"#!/usr/bin/env bash
# Runs Bastile's CUDA tests and benchmarks on a machine without Rust.
# Usage: run.sh [tests|bench|all] [results-dir] [test modules...]
# Each crate's tests are one binary; the modules (e.g. `rope attention`)
# select its tests. Extra benchmark arguments (e.g. `--op swiglu`) come from
# $BENCH_ARGS, extra test arguments (e.g. a test name) from $TEST_ARGS.
set -uo pipefail
archive="$(cd "$(dirname "$0")" && pwd)/bastile-cuda.tar.xz"
here="${{TMPDIR:-/tmp}}/bastile-cuda"; rm -rf "$here"; mkdir -p "$here"
tar -C "$here" -xJf "$archive" || python3 -c "import sys,tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$archive" "$here"
what="${{1:-all}}"; results="${{2:-$here/results}}"; mkdir -p "$results"
shift 2 2>/dev/null || shift $#
modules="${{*:-{modules}}}"
filters=""; for m in $modules; do filters="$filters $m::"; done
export BASTILE_TEST_RUNTIMES=cuda XDG_RUNTIME_DIR="${{XDG_RUNTIME_DIR:-/tmp}}"
# NCCL for data-parallel runs, loaded at run time: PyTorch's copy, where
# there is one, under the name the loader asks for.
nccl="$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)"
if [ -n "$nccl" ] && ls "$nccl"/libnccl.so* >/dev/null 2>&1; then
  mkdir -p "$here/nccl"
  ln -sf "$(ls "$nccl"/libnccl.so* | head -1)" "$here/nccl/libnccl.so"
  export LD_LIBRARY_PATH="$here/nccl${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"
fi
# The tests tune the tuned entry points; the benchmark runs as users do.
test_tune="${{BASTILE_TUNE:-full}}"
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  for t in {binaries}; do
    echo "== $t:$modules"
    (cd "$here/tests" && BASTILE_TUNE="$test_tune" "./$t" --test-threads=1 $filters ${{TEST_ARGS:-}}) 2>&1 | tee "$results/$t.log" || status=1
  done
fi
if [ "$what" = bench ] && [ ! -x "$here/bastile-bench" ]; then
  echo "this bundle was built with --no-bench: it has no benchmark program" >&2; exit 2
fi
if {{ [ "$what" = bench ] || [ "$what" = all ]; }} && [ -x "$here/bastile-bench" ]; then
  (cd "$here" && ./bastile-bench --runtime cuda --out "$results/cuda-bench.json" ${{BENCH_ARGS:-}}) 2>&1 | tee "$results/bench.log" || status=1
fi
exit $status
"#,
        modules = wanted.join(" "),
        binaries = names.join(" ")
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
