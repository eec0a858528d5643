//! flashsample builds next to candle-core's `cudarc` feature. candle-core asks cudarc for
//! `dynamic-linking` and cudarc's build script rejects a second linking mode, so flashsample's
//! own linking choice must be the downstream crate's (its `dynamic-loading` /
//! `dynamic-linking` features). One cudarc is resolved per workspace build, so the check lives
//! in its own workspace, `ci/candle-cudarc`, and this test builds its library with
//! `cargo build --release`: cudarc's build script on the unified features, then flashsample's
//! CUDA code and the adapter compiled in the linked mode. Nothing is linked: that needs libcuda,
//! libnvrtc, libnccl, libcublas, libcublasLt and libcurand, which CI does not have.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn builds_next_to_candle_core_cudarc() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let check = root.join("ci/candle-cudarc");
    // This workspace's target directory: LLVM, Cranelift and the other dependencies whose
    // features do not change are reused from the outer build.
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    let out = Command::new(cargo)
        .current_dir(&check)
        .args(["build", "--release", "--locked", "--quiet", "--manifest-path"])
        .arg(check.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        .output()
        .expect("runs cargo");
    assert!(
        out.status.success(),
        "`cargo check` of ci/candle-cudarc failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
