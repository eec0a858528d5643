//! flashsample builds next to candle-core's `cudarc` feature. candle-core asks cudarc for
//! `dynamic-linking` and cudarc's build script rejects a second linking mode, so flashsample's
//! own linking choice must be the downstream crate's (its `dynamic-loading` /
//! `dynamic-linking` features). One cudarc is resolved per workspace build, so the check lives
//! in its own workspace, `ci/candle-cudarc`, and this test runs `cargo check --tests` on it:
//! cudarc's build script on the unified features, then flashsample's CUDA code and the adapter
//! type-checked in the linked mode. Not a build: the dependency graph's features differ from
//! this workspace's, so nothing would be reused, and linking needs libcuda, libnvrtc, libnccl,
//! libcublas, libcublasLt and libcurand, which CI does not have.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn builds_next_to_candle_core_cudarc() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let check = root.join("ci/candle-cudarc");
    // This workspace's target directory; `check` writes to its `debug` half, which the release
    // build never locks.
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    let out = Command::new(cargo)
        .current_dir(&check)
        .args(["check", "--tests", "--locked", "--quiet", "--manifest-path"])
        .arg(check.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        .output()
        .expect("runs cargo");
    assert!(
        out.status.success(),
        "`cargo check` of ci/candle-cudarc failed ({}); if its lock file is behind this workspace's \
         dependencies, refresh it with `cargo metadata --format-version 1 --manifest-path \
         ci/candle-cudarc/Cargo.toml > /dev/null` and commit it:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
