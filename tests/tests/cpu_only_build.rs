//! The CPU-only build: `flashsample` with `default-features = false` depends on no LLVM and no
//! CUDA crate, and it and its unit tests compile with LLVM hidden (`LLVM_SYS_221_PREFIX`
//! pointing nowhere makes any llvm-sys build script fail). Runs cargo itself, in a target
//! directory of its own (`target/cpu-only`) so it never waits on the outer build's lock, and
//! type-checks rather than builds, to keep CI's extra time to about a minute. Running the
//! CPU-only tests: `cargo test --release -p flashsample --no-default-features --lib`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ sits in the workspace").to_path_buf()
}

fn cargo(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO"));
    c.args(args).current_dir(workspace());
    c
}

#[test]
fn cpu_only_dependency_tree_has_no_llvm_or_cuda() {
    let out = cargo(&["tree", "-p", "flashsample", "--no-default-features", "-e", "normal", "--prefix", "none"]).output().expect("cargo runs");
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "cargo tree failed: {}", String::from_utf8_lossy(&out.stderr));
    assert!(tree.contains("flashsample-codegen-cpu"), "the tree lists the CPU backend:\n{tree}");
    for banned in ["llvm-sys", "inkwell", "cudarc", "flashsample-codegen-ptx"] {
        assert!(!tree.lines().any(|l| l.starts_with(banned)), "{banned} is in the CPU-only build:\n{tree}");
    }
    // The default build does have them: the check above can fail.
    let out = cargo(&["tree", "-p", "flashsample", "-e", "normal", "--prefix", "none"]).output().expect("cargo runs");
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(tree.lines().any(|l| l.starts_with("llvm-sys")) && tree.lines().any(|l| l.starts_with("cudarc")), "{tree}");
}

#[test]
fn cpu_only_build_compiles_without_llvm() {
    let target = workspace().join("target").join("cpu-only");
    let out = cargo(&["check", "--release", "-p", "flashsample", "--no-default-features", "--lib", "--tests"])
        .env("CARGO_TARGET_DIR", &target)
        .env("LLVM_SYS_221_PREFIX", "/nonexistent/llvm-hidden-by-flashsample-tests")
        .env_remove("RUSTFLAGS")
        .output()
        .expect("cargo runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the CPU-only build does not compile without LLVM:\n{stderr}\n{stdout}");
}
