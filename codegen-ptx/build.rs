//! Hashes this crate's sources and the backend contract's (`abi`: Philox, f32 math, launch
//! layout, all emitted into the PTX) into `FLASHSAMPLE_PTX_SOURCE_HASH`, so the PTX cache key
//! (`COMPILER_VERSION`) changes with every edit of the code generator without anyone having
//! to remember to bump a number.
use std::{
    fs,
    path::{Path, PathBuf},
};

const SOURCE_DIRS: [&str; 2] = ["src", "../abi/src"];

fn main() {
    let mut files = Vec::new();
    for dir in SOURCE_DIRS {
        // Cargo scans a directory given here recursively, new files included.
        println!("cargo:rerun-if-changed={dir}");
        collect(Path::new(dir), &mut files);
    }
    files.sort();
    let mut bytes = Vec::new();
    for f in &files {
        bytes.extend_from_slice(f.to_string_lossy().as_bytes());
        bytes.extend(fs::read(f).unwrap_or_else(|e| panic!("reading {}: {e}", f.display())));
    }
    println!("cargo:rustc-env=FLASHSAMPLE_PTX_SOURCE_HASH={:016x}", xxhash_rust::xxh3::xxh3_64(&bytes));
}

fn collect(dir: &Path, files: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("listing {}: {e}", dir.display())) {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            collect(&path, files);
        } else {
            files.push(path);
        }
    }
}
