//! Kernel caches: loaded modules in process, PTX text on disk.
//!
//! In process, a module is keyed by (device ordinal, pipeline fingerprint, GpuConfig, arch,
//! compiler version, whether stage one skips the logsumexp); devices are opened once per ordinal, so the ordinal names the context
//! the module lives in. On disk, PTX is stored under `$FLASHSAMPLE_CACHE_DIR`, else
//! `$XDG_CACHE_HOME/flashsample`, else `~/.cache/flashsample`, in `ptx/`. The disk cache
//! only saves LLVM time: any failure to read or write it is a warning, never an error.
//!
//! Cached PTX runs on the GPU, so the cache trusts only what this user wrote: `ptx/` is
//! created `0700`; a directory or file owned by another user, or writable by group or others,
//! is refused with a warning (the cache is then not used); files are written to a fresh
//! `0600` temp file and renamed into place; each file's header carries the full key and a hash
//! of its body, so a torn, corrupt or foreign file is a miss (recompiled), never an error.

use super::{
    device::{drv, driver_error_text},
    ptx, CudaDevice,
};
use crate::{Error, Result};
use cudarc::driver::{sys, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;
use flashsample_codegen_ptx::{CodegenOptions, GpuConfig, ModuleKernels};
use flashsample_ir::Pipeline;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// Dynamic shared memory a block gets without opting in (CUDA's fixed default).
const DEFAULT_SMEM_LIMIT: u32 = 48 * 1024;

/// A pipeline's kernels, loaded into one device's context.
pub(crate) struct LoadedKernel {
    pub stage1: CudaFunction,
    /// The targets' logits before stage one (DESIGN.md step 7c), for pipelines that rank
    /// their targets.
    pub target_logits: Option<CudaFunction>,
    pub stage2: CudaFunction,
    /// Stage three, for pipelines with lists.
    pub filter: Option<CudaFunction>,
    /// The speculative decision and the drafts' spreading into targets, for verifying
    /// pipelines.
    pub decide: Option<DecideKernels>,
    /// The exact nucleus's kernels (`codegen_ptx::has_nucleus_kernels`).
    pub nucleus: Option<NucleusKernels>,
    /// Keeps the module (and so both functions) alive.
    _module: Arc<CudaModule>,
    /// Whether the PTX came from the disk cache (for tests and logs).
    pub from_disk: bool,
    /// Stage-one CTAs one SM holds at once (the driver's occupancy calculator, with the
    /// config's dynamic shared memory): sizes persistent grids.
    pub stage1_per_sm: u32,
}

/// A verifying pipeline's `flashsample_decide` and `flashsample_spec_targets`.
pub(crate) struct DecideKernels {
    pub decide: CudaFunction,
    pub targets: CudaFunction,
}

/// The exact nucleus's kernels of a module (DESIGN.md "Exact nucleus on the device").
pub(crate) struct NucleusKernels {
    pub pick: CudaFunction,
    pub logits: CudaFunction,
    pub hist: CudaFunction,
    pub scatter: CudaFunction,
    pub cut: CudaFunction,
    pub draw: CudaFunction,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    ordinal: usize,
    fingerprint: u64,
    /// The config as JSON: `GpuConfig` is `Serialize` but need not be `Hash`.
    config: String,
    arch: String,
    compiler: &'static str,
    /// Stage one without the logsumexp partials (`CodegenOptions::skip_logsumexp`).
    skip_lse: bool,
}

impl Key {
    fn file_name(&self) -> String {
        let h = xxhash_rust::xxh3::xxh3_64(self.config.as_bytes());
        let compiler: String = self.compiler.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '_' }).collect();
        let variant = if self.skip_lse { "-nolse" } else { "" };
        format!("{:016x}-{}-{h:016x}-{compiler}{variant}.ptx", self.fingerprint, self.arch)
    }
    /// First line of a cached file: the full key and the body's hash, checked on read so a
    /// hash collision, a hand-copied file or a torn write cannot load the wrong kernel.
    fn header(&self, body: &str) -> String {
        format!(
            "// flashsample-ptx-cache fingerprint={:016x} arch={} compiler={} skip_lse={} config={} body_xxh3={:016x}\n",
            self.fingerprint,
            self.arch,
            self.compiler,
            self.skip_lse,
            self.config,
            xxhash_rust::xxh3::xxh3_64(body.as_bytes())
        )
    }
}

fn loaded() -> &'static Mutex<HashMap<Key, Arc<LoadedKernel>>> {
    static LOADED: OnceLock<Mutex<HashMap<Key, Arc<LoadedKernel>>>> = OnceLock::new();
    LOADED.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The directory PTX is cached in, if any can be named.
pub fn cache_dir() -> Option<PathBuf> {
    let nonempty = |v: &str| std::env::var_os(v).filter(|s| !s.is_empty()).map(PathBuf::from);
    if let Some(d) = nonempty("FLASHSAMPLE_CACHE_DIR") {
        return Some(d);
    }
    if let Some(d) = nonempty("XDG_CACHE_HOME") {
        return Some(d.join("flashsample"));
    }
    nonempty("HOME").map(|h| h.join(".cache").join("flashsample"))
}

fn warn(msg: String) {
    crate::tuning::warn_once(&[msg]);
}

/// Why the disk cache refuses a directory or file.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
enum Distrust {
    #[error("it is owned by uid {owner}, not by this user (uid {me})")]
    Owner { owner: u32, me: u32 },
    #[error("it is writable by group or others (mode {mode:o})")]
    Writable { mode: u32 },
    #[error("it is not a {0}")]
    Kind(&'static str),
}

/// Whether the disk cache may use a directory or file with these attributes: of the expected
/// kind, owned by `me`, not writable by group or others.
#[cfg(unix)]
fn check_trust(meta: &std::fs::Metadata, dir: bool, me: u32) -> Result<(), Distrust> {
    use std::os::unix::fs::MetadataExt;
    if dir && !meta.is_dir() {
        return Err(Distrust::Kind("directory"));
    }
    if !dir && !meta.is_file() {
        return Err(Distrust::Kind("regular file"));
    }
    if meta.uid() != me {
        return Err(Distrust::Owner { owner: meta.uid(), me });
    }
    if meta.mode() & 0o022 != 0 {
        return Err(Distrust::Writable { mode: meta.mode() & 0o7777 });
    }
    Ok(())
}

#[cfg(not(unix))]
fn check_trust(meta: &std::fs::Metadata, dir: bool, _me: u32) -> Result<(), Distrust> {
    match (dir, meta.is_dir(), meta.is_file()) {
        (true, true, _) | (false, _, true) => Ok(()),
        (true, ..) => Err(Distrust::Kind("directory")),
        (false, ..) => Err(Distrust::Kind("regular file")),
    }
}

/// This process's effective user id (0 where there are none).
fn my_uid() -> u32 {
    #[cfg(unix)]
    return rustix::process::geteuid().as_raw();
    #[cfg(not(unix))]
    0
}

/// The PTX directory, created `0700` if missing, if the cache may use it; a warning if not.
fn trusted_dir(dir: &Path) -> Option<&Path> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    if let Err(e) = builder.create(dir) {
        warn(format!("cannot create the PTX cache {}: {e}; not caching PTX on disk", dir.display()));
        return None;
    }
    let verdict = std::fs::metadata(dir).map_err(|e| e.to_string()).and_then(|m| check_trust(&m, true, my_uid()).map_err(|d| d.to_string()));
    match verdict {
        Ok(()) => Some(dir),
        Err(why) => {
            warn(format!("not using the PTX cache {}: {why}", dir.display()));
            None
        }
    }
}

/// The loaded kernels of `pipeline` with `config` on `device`: from this process's cache,
/// else from the disk cache, else compiled now (and written to the disk cache). `skip_lse`:
/// stage one without the logsumexp partials (only for pipelines that have them; the caller
/// then passes lse = 0 to every stage).
pub(crate) fn kernel(device: &CudaDevice, pipeline: &Pipeline, config: &GpuConfig, skip_lse: bool) -> Result<Arc<LoadedKernel>> {
    let skip_lse = skip_lse && pipeline.needs_logsumexp();
    let kernels = ModuleKernels::of(pipeline);
    let key = Key {
        ordinal: device.ordinal(),
        fingerprint: pipeline.fingerprint(),
        config: serde_json::to_string(config).map_err(|e| Error::Cuda(format!("cannot serialize the GPU config: {e}")))?,
        arch: format!("{:?}", device.arch()).to_lowercase(),
        compiler: ptx::compiler_version(),
        skip_lse,
    };
    // Held across compilation: two threads asking for one kernel compile it once.
    let mut map = loaded().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(k) = map.get(&key) {
        return Ok(k.clone());
    }
    let dir = cache_dir().map(|d| d.join("ptx"));
    let dir = dir.as_deref().and_then(trusted_dir);
    let mut kernel = None;
    if let Some(text) = dir.and_then(|d| read_cached(d, &key)) {
        match load(device, &text, true, kernels, config) {
            Ok(k) => kernel = Some(k),
            Err(e) => warn(format!("ignoring cached PTX {}: {e}", key.file_name())),
        }
    }
    let kernel = match kernel {
        Some(k) => k,
        None => {
            let options = CodegenOptions { skip_logsumexp: skip_lse, ..CodegenOptions::for_config(config) };
            let compiled = flashsample_codegen_ptx::compile_with(pipeline, config, device.arch(), options)?;
            let text = ptx::ptx_text(&compiled);
            let k = load(device, text, false, kernels, config)?;
            if let Some(d) = dir {
                write_cached(d, &key, text);
            }
            k
        }
    };
    let kernel = Arc::new(kernel);
    map.insert(key, kernel.clone());
    Ok(kernel)
}

/// The cached PTX of `key` in the trusted directory `dir`: `None` (a miss) if there is none,
/// or it is not this user's alone, or its header or body does not match.
fn read_cached(dir: &Path, key: &Key) -> Option<String> {
    let path = dir.join(key.file_name());
    let mut file = match std::fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            warn(format!("cannot read cached PTX {}: {e}", path.display()));
            return None;
        }
    };
    // Checked on the open file, so it cannot be swapped between the check and the read.
    let trust = file.metadata().map_err(|e| e.to_string()).and_then(|m| check_trust(&m, false, my_uid()).map_err(|d| d.to_string()));
    if let Err(why) = trust {
        warn(format!("not using cached PTX {}: {why}", path.display()));
        return None;
    }
    let mut text = String::new();
    if let Err(e) = file.read_to_string(&mut text) {
        warn(format!("cannot read cached PTX {}: {e}", path.display()));
        return None;
    }
    let body = text.split_once('\n').and_then(|(first, body)| (format!("{first}\n") == key.header(body)).then_some(body));
    if body.is_none() {
        warn(format!("cached PTX {} is for another kernel or corrupt; recompiling", path.display()));
    }
    body.map(str::to_string)
}

/// Writes `text` as the cached PTX of `key` in the trusted directory `dir`: a fresh `0600`
/// temp file renamed into place, so a concurrent reader sees the old file or the new one.
fn write_cached(dir: &Path, key: &Key, text: &str) {
    let path = dir.join(key.file_name());
    let result = (|| -> std::io::Result<()> {
        let mut tmp = tempfile::Builder::new().prefix(".ptx-").suffix(".tmp").tempfile_in(dir)?;
        tmp.write_all(key.header(text).as_bytes())?;
        tmp.write_all(text.as_bytes())?;
        tmp.persist(&path).map_err(|e| e.error)?;
        Ok(())
    })();
    if let Err(e) = result {
        warn(format!("cannot write PTX cache {}: {e}", path.display()));
    }
}

/// Loads PTX into the device's context and looks up its kernels (stage three, the decision
/// kernels, the exact nucleus's and the targets' logits as `kernels` says the module holds them).
/// Stage one's dynamic shared memory is opted into here (above 48 KB a launch needs it), and
/// its occupancy read with it.
fn load(device: &CudaDevice, text: &str, from_disk: bool, kernels: ModuleKernels, config: &GpuConfig) -> Result<LoadedKernel> {
    let ModuleKernels { filter, decide, nucleus, rank } = kernels;
    if text.contains('\0') {
        return Err(Error::Cuda("PTX text contains a NUL byte".into()));
    }
    let module = match device.context().load_module(Ptx::from_src(text)) {
        Ok(m) => m,
        Err(e) => {
            let log = jit_error_log(device, text).map(|l| format!("; ptxas says:\n{l}")).unwrap_or_default();
            return Err(Error::Cuda(format!("cuModuleLoadData: {}{log}", driver_error_text(&e))));
        }
    };
    let stage1 = module.load_function(ptx::STAGE1).map_err(drv("cuModuleGetFunction(flashsample_stage1)"))?;
    let target_logits = if rank {
        Some(module.load_function(ptx::TARGET_LOGITS).map_err(drv("cuModuleGetFunction(flashsample_target_logits)"))?)
    } else {
        None
    };
    let stage2 = module.load_function(ptx::STAGE2).map_err(drv("cuModuleGetFunction(flashsample_stage2)"))?;
    let filter = if filter {
        Some(module.load_function(ptx::FILTER).map_err(drv("cuModuleGetFunction(flashsample_filter)"))?)
    } else {
        None
    };
    let decide = if decide {
        Some(DecideKernels {
            decide: module.load_function(ptx::DECIDE).map_err(drv("cuModuleGetFunction(flashsample_decide)"))?,
            targets: module.load_function(ptx::SPEC_TARGETS).map_err(drv("cuModuleGetFunction(flashsample_spec_targets)"))?,
        })
    } else {
        None
    };
    let nucleus = if nucleus {
        use flashsample_codegen_ptx::{NUCLEUS_CUT, NUCLEUS_DRAW, NUCLEUS_HIST, NUCLEUS_LOGITS, NUCLEUS_PICK, NUCLEUS_SCATTER};
        let get = |name: &str| module.load_function(name).map_err(|e| Error::Cuda(format!("cuModuleGetFunction({name}): {}", driver_error_text(&e))));
        Some(NucleusKernels {
            pick: get(NUCLEUS_PICK.kernel)?,
            logits: get(NUCLEUS_LOGITS.kernel)?,
            hist: get(NUCLEUS_HIST.kernel)?,
            scatter: get(NUCLEUS_SCATTER.kernel)?,
            cut: get(NUCLEUS_CUT.kernel)?,
            draw: get(NUCLEUS_DRAW.kernel)?,
        })
    } else {
        None
    };
    let smem = config.smem_bytes();
    if smem > DEFAULT_SMEM_LIMIT {
        stage1
            .set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
            .map_err(drv("cuFuncSetAttribute(flashsample_stage1, MAX_DYNAMIC_SHARED_SIZE_BYTES)"))?;
    }
    let stage1_per_sm = stage1
        .occupancy_max_active_blocks_per_multiprocessor(config.block_threads(), smem as usize, None)
        .map_err(drv("cuOccupancyMaxActiveBlocksPerMultiprocessor(flashsample_stage1)"))?;
    if stage1_per_sm == 0 {
        return Err(Error::Unsupported(format!(
            "stage one with {config:?} ({} threads, {smem} B shared memory) fits no SM of this GPU",
            config.block_threads()
        )));
    }
    Ok(LoadedKernel { stage1, target_logits, stage2, filter, decide, nucleus, _module: module, from_disk, stage1_per_sm })
}

/// Loads `text` again with the JIT's error log attached, to say *why* it was rejected.
fn jit_error_log(device: &CudaDevice, text: &str) -> Option<String> {
    let src = std::ffi::CString::new(text).ok()?;
    let mut log = vec![0u8; 16 * 1024];
    let mut options = [sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER, sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
    let mut values: [*mut std::ffi::c_void; 2] = [log.as_mut_ptr().cast(), log.len() as *mut std::ffi::c_void];
    let mut module: sys::CUmodule = std::ptr::null_mut();
    device.context().bind_to_thread().ok()?;
    // SAFETY: options and values are two valid entries; the log buffer outlives the call.
    let r = unsafe {
        sys::cuModuleLoadDataEx(&mut module, src.as_ptr().cast(), 2, options.as_mut_ptr(), values.as_mut_ptr())
    };
    if r == sys::CUresult::CUDA_SUCCESS {
        // SAFETY: we just loaded it and hold no functions from it.
        unsafe { sys::cuModuleUnload(module) };
        return None;
    }
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    let s = String::from_utf8_lossy(&log[..end]).trim().to_string();
    (!s.is_empty()).then_some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> Key {
        Key { ordinal: 0, fingerprint: 0xabc, config: "{\"t\":1}".into(), arch: "sm90".into(), compiler: "0.1.0+x/y", skip_lse: false }
    }

    /// A fresh directory under the system temp dir, removed on drop.
    fn scratch(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new().prefix(&format!("flashsample-{name}-")).tempdir().unwrap()
    }

    #[cfg(unix)]
    fn mode(path: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[cfg(unix)]
    fn set_mode(path: &Path, mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn file_names_are_plain_and_key_specific() {
        let k = key();
        let name = k.file_name();
        assert!(name.starts_with("0000000000000abc-sm90-"), "{name}");
        assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || "-._".contains(c)), "{name}");
        let other = Key { config: "{\"t\":2}".into(), ..key() };
        assert_ne!(other.file_name(), name);
        let nolse = Key { skip_lse: true, ..key() };
        assert_ne!(nolse.file_name(), name);
        assert_ne!(nolse.header(""), key().header(""));
    }

    #[test]
    fn round_trip_and_mismatched_header() {
        let root = scratch("cache");
        let dir = root.path().join("ptx");
        let dir = trusted_dir(&dir).expect("a fresh directory is trusted");
        write_cached(dir, &key(), ".version 8.0\n");
        assert_eq!(read_cached(dir, &key()).as_deref(), Some(".version 8.0\n"));
        // Same file name, different full key (as after a hash collision): not used.
        let other = Key { config: "{\"t\":3}".into(), ..key() };
        std::fs::copy(dir.join(key().file_name()), dir.join(other.file_name())).unwrap();
        assert_eq!(read_cached(dir, &other), None);
    }

    #[test]
    fn corrupt_or_torn_entries_are_misses() {
        let root = scratch("corrupt");
        let dir = trusted_dir(&root.path().join("ptx")).unwrap().to_path_buf();
        let path = dir.join(key().file_name());
        write_cached(&dir, &key(), ".version 8.0\n.target sm_90a\n");
        let good = std::fs::read_to_string(&path).unwrap();
        // A torn write (header, half the body) and a flipped byte in the body.
        std::fs::write(&path, &good[..good.len() - 5]).unwrap();
        assert_eq!(read_cached(&dir, &key()), None);
        std::fs::write(&path, good.replace("sm_90a", "sm_90b")).unwrap();
        assert_eq!(read_cached(&dir, &key()), None);
        std::fs::write(&path, [0xff, 0xfe, 0x00]).unwrap();
        assert_eq!(read_cached(&dir, &key()), None, "not UTF-8: a miss, not an error");
        // A predictable header alone is not enough: the body must hash to it.
        std::fs::write(&path, format!("{}.entry evil\n", key().header(".version 8.0\n"))).unwrap();
        assert_eq!(read_cached(&dir, &key()), None);
        // Rewritten, it is used again.
        write_cached(&dir, &key(), ".version 8.0\n");
        assert_eq!(read_cached(&dir, &key()).as_deref(), Some(".version 8.0\n"));
    }

    #[cfg(unix)]
    #[test]
    fn the_cache_directory_is_private_and_writes_are_atomic() {
        let root = scratch("private");
        let dir = root.path().join("flashsample").join("ptx");
        let dir = trusted_dir(&dir).unwrap();
        assert_eq!(mode(dir), 0o700);
        assert_eq!(mode(dir.parent().unwrap()), 0o700, "created parents are private too");
        write_cached(dir, &key(), "ptx");
        assert_eq!(mode(&dir.join(key().file_name())), 0o600);
        let names: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert_eq!(names, vec![key().file_name()], "no temp file is left behind");
    }

    #[cfg(unix)]
    #[test]
    fn shared_directories_and_files_are_refused() {
        let root = scratch("shared");
        let dir = root.path().join("ptx");
        let trusted = trusted_dir(&dir).unwrap().to_path_buf();
        write_cached(&trusted, &key(), "ptx");
        // A file others may write could have been planted: a miss.
        let file = dir.join(key().file_name());
        set_mode(&file, 0o666);
        assert_eq!(read_cached(&dir, &key()), None);
        set_mode(&file, 0o600);
        assert_eq!(read_cached(&dir, &key()).as_deref(), Some("ptx"));
        // A directory others may write: not used at all.
        for shared in [0o777, 0o770, 0o1777] {
            set_mode(&dir, shared);
            assert_eq!(trusted_dir(&dir), None, "mode {shared:o}");
        }
        set_mode(&dir, 0o700);
        assert!(trusted_dir(&dir).is_some());
        // A regular file where the directory should be.
        let not_dir = root.path().join("file");
        std::fs::write(&not_dir, b"x").unwrap();
        assert_eq!(trusted_dir(&not_dir), None);
        assert_eq!(trusted_dir(&not_dir.join("ptx")), None);
    }

    #[cfg(unix)]
    #[test]
    fn another_users_directory_or_file_is_refused() {
        let root = scratch("owner");
        let dir = trusted_dir(&root.path().join("ptx")).unwrap().to_path_buf();
        write_cached(&dir, &key(), "ptx");
        let file = dir.join(key().file_name());
        let me = my_uid();
        let meta = std::fs::metadata(&file).unwrap();
        assert_eq!(check_trust(&meta, false, me), Ok(()));
        assert_eq!(check_trust(&meta, false, me + 1), Err(Distrust::Owner { owner: me, me: me + 1 }));
        assert_eq!(check_trust(&meta, true, me), Err(Distrust::Kind("directory")));
        if me == 0 {
            // As root, hand the file and then the directory to `nobody` for real.
            let nobody = 65_534;
            std::os::unix::fs::chown(&file, Some(nobody), None).unwrap();
            assert_eq!(read_cached(&dir, &key()), None);
            std::os::unix::fs::chown(&file, Some(me), None).unwrap();
            assert_eq!(read_cached(&dir, &key()).as_deref(), Some("ptx"));
            std::os::unix::fs::chown(&dir, Some(nobody), None).unwrap();
            assert_eq!(trusted_dir(&dir), None);
        }
    }

    #[test]
    fn unwritable_or_missing_cache_is_not_an_error() {
        // A path under a regular file cannot be created: nothing is cached, nothing fails.
        let root = scratch("unwritable");
        let file = root.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(trusted_dir(&file.join("ptx")), None);
        write_cached(&file, &key(), "ptx");
        assert_eq!(read_cached(&file, &key()), None);
        assert_eq!(read_cached(root.path(), &key()), None, "a missing entry is a miss");
    }
}
