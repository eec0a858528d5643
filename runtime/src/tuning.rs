//! Tuning files: the kernel config that won per device and shape bucket, written by
//! `flashsample-autotune` and read by the runtime.
//!
//! Lookup order: the file named by `$FLASHSAMPLE_TUNING`, then
//! `$XDG_CACHE_HOME/flashsample/tuning.json` (or `~/.cache/flashsample/tuning.json`), then the
//! defaults shipped in this crate (`runtime/tuning/*.json`). A file that is missing is skipped
//! silently; one that is corrupt, of another schema, or has no section for this device is
//! skipped with a warning on stderr, and so is an entry whose config is not a valid config of
//! the backend or needs more scratch memory than [`TunedConfig::unusable`] allows. With no
//! entry, backends use their documented heuristic.

use flashsample_abi::{Candidate, LsePartial, Scored};
use flashsample_codegen_cpu::CpuConfig;
#[cfg(feature = "cuda")]
use flashsample_codegen_ptx::GpuConfig;
use flashsample_ir::{DType, MAX_LIST_CAPACITY};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Version of the tuning-file layout; files of another version are ignored with a warning.
pub const TUNING_SCHEMA: u32 = 1;
/// Environment variable naming a tuning file.
pub const TUNING_ENV: &str = "FLASHSAMPLE_TUNING";

/// Tuning files shipped with the crate, measured on the named devices.
const SHIPPED: &[(&str, &str)] = &[("runtime/tuning/h200.json", include_str!("../tuning/h200.json"))];

/// Host scratch of one CPU launch per (row, vocab tile), at most: one sample's candidate, the
/// logsumexp partial and the largest top lists (`max_k` ≤ `MAX_LIST_CAPACITY` entries).
const CPU_SCRATCH_PER_ROW_TILE: usize =
    size_of::<Candidate>() + size_of::<LsePartial>() + MAX_LIST_CAPACITY as usize * size_of::<Scored>();

/// Scratch a tuned config may always use; above it, at most twice the heuristic's.
pub const SCRATCH_ALLOWANCE_BYTES: usize = 64 << 20;

/// Upper bound on the host scratch (candidates, logsumexp partials, top lists) of a CPU
/// launch of `shape` cut into vocab tiles of `vocab_tile` tokens.
pub fn cpu_scratch_bytes(shape: &ShapeKey, vocab_tile: u32) -> usize {
    let tiles = shape.vocab.div_ceil(vocab_tile.max(1) as usize);
    shape.batch.saturating_mul(tiles).saturating_mul(CPU_SCRATCH_PER_ROW_TILE)
}

/// A backend config as a tuning file holds it, checked before a launch uses it.
pub trait TunedConfig: DeserializeOwned {
    /// The backend's name in warnings ("CPU config").
    const WHAT: &'static str;
    /// Why this config must not run `shape`, if it must not.
    fn unusable(&self, shape: &ShapeKey) -> Option<String>;
}

impl TunedConfig for CpuConfig {
    const WHAT: &'static str = "CPU config";

    /// Invalid (`CpuConfig::validate`), or so many vocab tiles that its scratch passes both
    /// [`SCRATCH_ALLOWANCE_BYTES`] and twice the heuristic's.
    fn unusable(&self, shape: &ShapeKey) -> Option<String> {
        if let Err(e) = self.validate() {
            return Some(e.to_string());
        }
        let heuristic = CpuConfig::heuristic_for_engine(self.engine, shape.batch, shape.dim, shape.vocab);
        let allowed = SCRATCH_ALLOWANCE_BYTES.max(2 * cpu_scratch_bytes(shape, heuristic.vocab_tile));
        let needs = cpu_scratch_bytes(shape, self.vocab_tile);
        (needs > allowed).then(|| {
            format!(
                "vocab_tile {} needs up to {} MiB of scratch at B = {}, V = {}; at most {} MiB is allowed",
                self.vocab_tile,
                needs >> 20,
                shape.batch,
                shape.vocab,
                allowed >> 20
            )
        })
    }
}

#[cfg(feature = "cuda")]
impl TunedConfig for GpuConfig {
    const WHAT: &'static str = "GPU config";

    /// Its validity depends on the pipeline and the device: the CUDA backend checks it.
    fn unusable(&self, _shape: &ShapeKey) -> Option<String> {
        None
    }
}

/// What a tuning section is valid for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum DeviceIdentity {
    /// A CPU model (from `/proc/cpuinfo`) with a worker-thread count.
    Cpu {
        /// The model name.
        model: String,
        /// Worker threads.
        threads: usize,
    },
    /// An NVIDIA GPU.
    Cuda {
        /// The device name the driver reports.
        name: String,
        /// Its compute capability.
        compute_capability: (u32, u32),
        /// Its streaming multiprocessors.
        sm_count: u32,
    },
}

impl std::fmt::Display for DeviceIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceIdentity::Cpu { model, threads } => write!(f, "{model} ({threads} threads)"),
            DeviceIdentity::Cuda { name, compute_capability: (a, b), sm_count } => {
                write!(f, "{name} (sm_{a}{b}, {sm_count} SMs)")
            }
        }
    }
}

impl DeviceIdentity {
    /// This machine's CPU, from `/proc/cpuinfo` where it exists.
    pub fn this_cpu(threads: usize) -> DeviceIdentity {
        let model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| s.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split_once(':')).map(|(_, m)| m.trim().to_string()))
            .unwrap_or_else(|| std::env::consts::ARCH.to_string());
        DeviceIdentity::Cpu { model, threads }
    }
}

/// The shape a config was tuned for.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShapeKey {
    /// Element type of the weights.
    pub dtype: DType,
    /// Vocabulary size V.
    pub vocab: usize,
    /// Hidden size D.
    pub dim: usize,
    /// Batch size B.
    pub batch: usize,
}

impl ShapeKey {
    /// Distance between shapes in log space; batch matters most, then vocab and hidden size.
    fn distance(&self, other: &ShapeKey) -> f64 {
        let l = |a: usize, b: usize| ((a.max(1) as f64) / (b.max(1) as f64)).ln().abs();
        l(self.batch, other.batch) + 0.5 * l(self.vocab, other.vocab) + 0.5 * l(self.dim, other.dim)
    }
}

/// One measured config.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    /// A backend config (`CpuConfig` or `GpuConfig`) as JSON.
    pub config: serde_json::Value,
    /// Median launch time in microseconds.
    pub median_us: f64,
}

/// The result of tuning one shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TuningEntry {
    /// The shape measured.
    pub shape: ShapeKey,
    /// The fastest config, never slower than `heuristic` (see [`TuningFile::upsert`]).
    pub best: Measured,
    /// The best few, fastest first.
    pub top: Vec<Measured>,
    /// The fallback heuristic's config and time at this shape, for comparison.
    pub heuristic: Measured,
}

/// All entries of one device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceTuning {
    /// The device measured.
    pub device: DeviceIdentity,
    /// One entry per shape.
    pub entries: Vec<TuningEntry>,
}

/// A tuning file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TuningFile {
    /// [`TUNING_SCHEMA`].
    pub schema: u32,
    /// One section per device.
    pub devices: Vec<DeviceTuning>,
}

/// Why a tuning file could not be used.
/// A tuning file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TuningError {
    /// The file could not be read or written.
    #[error("cannot read tuning file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not a tuning file.
    #[error("tuning file {path} is corrupt: {source}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The parse error.
        source: serde_json::Error,
    },
    /// The file has another layout version.
    #[error("tuning file {path} has schema {found}; this flashsample reads schema {TUNING_SCHEMA}")]
    Schema {
        /// The file.
        path: PathBuf,
        /// Its schema version.
        found: u32,
    },
}

impl Default for TuningFile {
    fn default() -> Self {
        TuningFile { schema: TUNING_SCHEMA, devices: Vec::new() }
    }
}

impl TuningFile {
    /// Parses a tuning file's text (`path` names it in errors).
    pub fn parse(text: &str, path: &Path) -> Result<TuningFile, TuningError> {
        let file: TuningFile =
            serde_json::from_str(text).map_err(|source| TuningError::Corrupt { path: path.to_path_buf(), source })?;
        if file.schema != TUNING_SCHEMA {
            return Err(TuningError::Schema { path: path.to_path_buf(), found: file.schema });
        }
        Ok(file)
    }

    /// Reads and parses the tuning file at `path`.
    pub fn load(path: &Path) -> Result<TuningFile, TuningError> {
        let text = std::fs::read_to_string(path).map_err(|source| TuningError::Io { path: path.to_path_buf(), source })?;
        Self::parse(&text, path)
    }

    /// Writes atomically (temp file + rename), so an interrupted run never leaves a torn file.
    pub fn save(&self, path: &Path) -> Result<(), TuningError> {
        let io = |source| TuningError::Io { path: path.to_path_buf(), source };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let tmp = path.with_extension("json.tmp");
        let text = serde_json::to_string_pretty(self).map_err(|source| TuningError::Corrupt { path: path.to_path_buf(), source })?;
        std::fs::write(&tmp, text + "\n").map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// The section of `device`, if the file has one.
    pub fn device(&self, device: &DeviceIdentity) -> Option<&DeviceTuning> {
        self.devices.iter().find(|d| &d.device == device)
    }

    /// Inserts or replaces the entry for `entry.shape` of `device`. Where the heuristic was
    /// measured faster than `entry.best` (a quick pass can rank configs wrongly), the
    /// heuristic's config becomes the best: a saved entry never slows a launch down.
    pub fn upsert(&mut self, device: &DeviceIdentity, mut entry: TuningEntry) {
        if entry.heuristic.median_us < entry.best.median_us {
            entry.best = entry.heuristic.clone();
            entry.top.retain(|m| m.config != entry.heuristic.config);
            entry.top.insert(0, entry.heuristic.clone());
        }
        let section = match self.devices.iter().position(|d| &d.device == device) {
            Some(i) => &mut self.devices[i],
            None => {
                self.devices.push(DeviceTuning { device: device.clone(), entries: Vec::new() });
                self.devices.last_mut().expect("just pushed")
            }
        };
        section.entries.retain(|e| e.shape != entry.shape);
        section.entries.push(entry);
    }
}

impl DeviceTuning {
    /// The best config of the nearest tuned shape bucket with the same dtype.
    pub fn nearest<C: DeserializeOwned>(&self, shape: &ShapeKey) -> Option<C> {
        self.nearest_entry(shape).and_then(|e| serde_json::from_value(e.best.config.clone()).ok())
    }

    /// The nearest tuned shape bucket with the same dtype.
    pub fn nearest_entry(&self, shape: &ShapeKey) -> Option<&TuningEntry> {
        self.entries
            .iter()
            .filter(|e| e.shape.dtype == shape.dtype)
            .min_by(|a, b| a.shape.distance(shape).total_cmp(&b.shape.distance(shape)))
    }
}

fn standard_path() -> Option<PathBuf> {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(cache.join("flashsample").join("tuning.json"))
}

/// Result of looking up a config: the config if any file had one, and the warnings met.
#[derive(Debug, Default)]
pub struct Lookup<C> {
    /// The usable config found, if any.
    pub config: Option<C>,
    /// The file it came from.
    pub source: Option<String>,
    /// Sources skipped and why, for the caller to print once.
    pub warnings: Vec<String>,
}

/// Looks `shape` up for `device` in the tuning files, in the documented order.
pub fn lookup<C: TunedConfig>(device: &DeviceIdentity, shape: &ShapeKey) -> Lookup<C> {
    lookup_from(std::env::var_os(TUNING_ENV).map(PathBuf::from), standard_path(), device, shape)
}

/// [`lookup`] with the user-named and standard paths given (the user-named one must exist).
fn lookup_from<C: TunedConfig>(env: Option<PathBuf>, standard: Option<PathBuf>, device: &DeviceIdentity, shape: &ShapeKey) -> Lookup<C> {
    let mut out = Lookup { config: None, source: None, warnings: Vec::new() };
    let mut candidates: Vec<(String, Result<TuningFile, TuningError>)> = Vec::new();
    for path in env.iter().chain(standard.iter()) {
        match TuningFile::load(path) {
            Err(TuningError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound && Some(path) != env.as_ref() => {}
            r => candidates.push((path.display().to_string(), r)),
        }
    }
    for (name, text) in SHIPPED {
        candidates.push((name.to_string(), TuningFile::parse(text, Path::new(name))));
    }
    for (name, file) in candidates {
        match file {
            Err(e) => out.warnings.push(format!("{e}; using the next tuning source")),
            Ok(file) => match file.device(device) {
                Some(section) => {
                    let Some(entry) = section.nearest_entry(shape) else { continue };
                    let at = &entry.shape;
                    let skip = format!("tuning file {name}: the entry for B = {}, D = {}, V = {}", at.batch, at.dim, at.vocab);
                    match serde_json::from_value::<C>(entry.best.config.clone()) {
                        Err(e) => out.warnings.push(format!("{skip} is not a {}: {e}; using the next tuning source", C::WHAT)),
                        Ok(c) => match c.unusable(shape) {
                            Some(why) => out.warnings.push(format!("{skip} is unusable: {why}; using the next tuning source")),
                            None => {
                                out.config = Some(c);
                                out.source = Some(name);
                                return out;
                            }
                        },
                    }
                }
                None if !name.starts_with("runtime/tuning/") => {
                    out.warnings.push(format!("tuning file {name} has no section for {device}; ignoring it"))
                }
                None => {}
            },
        }
    }
    out
}

/// Prints each distinct warning once per process.
pub(crate) fn warn_once(warnings: &[String]) {
    use std::collections::HashSet;
    use std::sync::Mutex;
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    let seen = seen.get_or_insert_with(HashSet::new);
    for w in warnings {
        if seen.insert(w.clone()) {
            eprintln!("flashsample: warning: {w}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(batch: usize, tile: u32) -> TuningEntry {
        let m = Measured { config: serde_json::json!({ "tile": tile }), median_us: 1.0 };
        TuningEntry { shape: ShapeKey { dtype: DType::BF16, vocab: 151_936, dim: 4096, batch }, best: m.clone(), top: vec![m.clone()], heuristic: m }
    }

    #[derive(Deserialize, Debug, PartialEq)]
    struct Cfg {
        tile: u32,
    }

    impl TunedConfig for Cfg {
        const WHAT: &'static str = "test config";
        fn unusable(&self, _shape: &ShapeKey) -> Option<String> {
            None
        }
    }

    fn cpu() -> DeviceIdentity {
        DeviceIdentity::Cpu { model: "test".into(), threads: 2 }
    }

    #[test]
    fn round_trip_and_nearest_bucket() {
        let dir = std::env::temp_dir().join(format!("fs-tuning-{}", std::process::id()));
        let path = dir.join("t.json");
        let mut f = TuningFile::default();
        for (b, t) in [(1, 10), (16, 20), (256, 30)] {
            f.upsert(&cpu(), entry(b, t));
        }
        f.upsert(&cpu(), entry(16, 21));
        f.save(&path).unwrap();
        let g = TuningFile::load(&path).unwrap();
        assert_eq!(f, g);
        let s = g.device(&cpu()).unwrap();
        assert_eq!(s.entries.len(), 3);
        let at = |batch| s.nearest::<Cfg>(&ShapeKey { dtype: DType::BF16, vocab: 150_000, dim: 4096, batch });
        assert_eq!(at(1), Some(Cfg { tile: 10 }));
        assert_eq!(at(12), Some(Cfg { tile: 21 }));
        assert_eq!(at(100), Some(Cfg { tile: 30 }));
        assert_eq!(s.nearest::<Cfg>(&ShapeKey { dtype: DType::F16, vocab: 1, dim: 1, batch: 1 }), None);
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn corrupt_and_foreign_files_are_errors_not_panics() {
        let p = Path::new("x.json");
        assert!(matches!(TuningFile::parse("{ not json", p), Err(TuningError::Corrupt { .. })));
        assert!(matches!(TuningFile::parse(r#"{"schema": 99, "devices": []}"#, p), Err(TuningError::Schema { found: 99, .. })));
        assert!(matches!(TuningFile::parse(r#"{"schema": 1, "devices": [{"device": {"kind": "tpu"}}]}"#, p), Err(TuningError::Corrupt { .. })));
    }

    #[test]
    fn lookup_falls_back_with_warnings() {
        let dir = std::env::temp_dir().join(format!("fs-lookup-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let shape = ShapeKey { dtype: DType::BF16, vocab: 1000, dim: 64, batch: 4 };
        let corrupt = dir.join("corrupt.json");
        std::fs::write(&corrupt, "{ \"schema\": 1, \"devices\": [ truncated").unwrap();
        let other = dir.join("other.json");
        let mut f = TuningFile::default();
        f.upsert(&DeviceIdentity::Cpu { model: "another cpu".into(), threads: 64 }, entry(4, 7));
        f.save(&other).unwrap();
        let missing = dir.join("missing.json");

        let l: Lookup<Cfg> = lookup_from(Some(corrupt), Some(other.clone()), &cpu(), &shape);
        assert_eq!(l.config, None);
        assert!(l.warnings[0].contains("corrupt"), "{:?}", l.warnings);
        assert!(l.warnings[1].contains("no section for test (2 threads)"), "{:?}", l.warnings);
        let l: Lookup<Cfg> = lookup_from(Some(missing), None, &cpu(), &shape);
        assert!(l.warnings[0].contains("cannot read"), "{:?}", l.warnings);
        f.upsert(&cpu(), entry(8, 9));
        f.save(&other).unwrap();
        let l: Lookup<Cfg> = lookup_from(None, Some(other), &cpu(), &shape);
        assert_eq!(l.config, Some(Cfg { tile: 9 }));
        assert!(l.warnings.is_empty());
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn unusable_configs_are_dropped_with_a_warning() {
        let dir = std::env::temp_dir().join(format!("fs-unusable-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let me = DeviceIdentity::this_cpu(2);
        let shape = ShapeKey { dtype: DType::BF16, vocab: 151_936, dim: 4096, batch: 16 };
        let with = |config: serde_json::Value| {
            let m = Measured { config, median_us: 1.0 };
            let mut f = TuningFile::default();
            f.upsert(&me, TuningEntry { shape, best: m.clone(), top: vec![m.clone()], heuristic: m });
            let path = dir.join("t.json");
            f.save(&path).unwrap();
            lookup_from::<CpuConfig>(Some(path), None, &me, &shape)
        };
        let ok = with(serde_json::json!({ "vocab_tile": 1024, "row_block": 4, "threads": 2 }));
        assert_eq!(ok.config, Some(CpuConfig { vocab_tile: 1024, row_block: 4, threads: 2, engine: Default::default(), noise_skip: Default::default() }), "{:?}", ok.warnings);
        assert!(ok.warnings.is_empty(), "{:?}", ok.warnings);
        // Valid, but 37984 tiles x 16 rows of scratch (gigabytes with the largest lists).
        let extreme = with(serde_json::json!({ "vocab_tile": 4, "row_block": 4, "threads": 2 }));
        assert_eq!(extreme.config, None);
        assert!(extreme.warnings.iter().any(|w| w.contains("scratch") && w.contains("vocab_tile 4")), "{:?}", extreme.warnings);
        let invalid = with(serde_json::json!({ "vocab_tile": 6, "row_block": 4, "threads": 2 }));
        assert_eq!(invalid.config, None);
        assert!(invalid.warnings.iter().any(|w| w.contains("multiple of 4")), "{:?}", invalid.warnings);
        let garbage = with(serde_json::json!({ "tile": 3 }));
        assert_eq!(garbage.config, None);
        assert!(garbage.warnings.iter().any(|w| w.contains("not a CPU config")), "{:?}", garbage.warnings);
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn a_saved_entry_is_never_slower_than_the_heuristic() {
        let m = |tile: u32, us: f64| Measured { config: serde_json::json!({ "tile": tile }), median_us: us };
        let shape = ShapeKey { dtype: DType::BF16, vocab: 1000, dim: 64, batch: 4 };
        let mut f = TuningFile::default();
        // A quick pass's "best", re-timed fully, came out slower than the heuristic.
        f.upsert(&cpu(), TuningEntry { shape, best: m(2, 10.0), top: vec![m(2, 10.0), m(3, 12.0)], heuristic: m(1, 9.4) });
        let e = &f.device(&cpu()).unwrap().entries[0];
        assert_eq!(e.best, m(1, 9.4));
        assert_eq!(e.top, vec![m(1, 9.4), m(2, 10.0), m(3, 12.0)]);
        // A heuristic that failed (NaN) changes nothing.
        f.upsert(&cpu(), TuningEntry { shape, best: m(2, 10.0), top: vec![m(2, 10.0)], heuristic: m(1, f64::NAN) });
        assert_eq!(f.device(&cpu()).unwrap().entries[0].best, m(2, 10.0));
    }

    #[test]
    fn shipped_defaults_parse() {
        for (name, text) in SHIPPED {
            TuningFile::parse(text, Path::new(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    #[test]
    #[cfg(feature = "cuda")]
    fn shipped_h200_file_tunes_both_lm_heads_at_every_batch() {
        let (name, text) = SHIPPED[0];
        let file = TuningFile::parse(text, Path::new(name)).unwrap();
        let h200 = DeviceIdentity::Cuda { name: "NVIDIA H200".into(), compute_capability: (9, 0), sm_count: 132 };
        let tuning = file.device(&h200).expect("an H200 section");
        for (dim, vocab) in [(4096, 151_936), (8192, 128_256)] {
            for batch in [1, 2, 4, 8, 16, 32, 64, 128, 256] {
                let shape = ShapeKey { dtype: flashsample_ir::DType::BF16, vocab, dim, batch };
                let config: flashsample_codegen_ptx::GpuConfig = tuning.nearest(&shape).expect("an entry");
                let pipeline = flashsample_ir::PipelineBuilder::new("P", flashsample_ir::DType::BF16, flashsample_ir::DType::BF16)
                    .temperature_per_row("t")
                    .build()
                    .unwrap();
                config
                    .validate(&pipeline, &flashsample_codegen_ptx::GpuLimits::H200)
                    .unwrap_or_else(|e| panic!("D={dim} B={batch}: {e}"));
                assert!(config.batch_tile as usize <= batch.max(8), "D={dim} B={batch}: {config:?}");
            }
        }
    }
}
