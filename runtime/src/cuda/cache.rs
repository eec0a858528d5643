//! Kernel caches: loaded modules in process, PTX text on disk.
//!
//! In process, a module is keyed by (device ordinal, pipeline fingerprint, GpuConfig, arch,
//! compiler version, whether stage one skips the logsumexp); devices are opened once per ordinal, so the ordinal names the context
//! the module lives in. On disk, PTX is stored under `$FLASHSAMPLE_CACHE_DIR`, else
//! `$XDG_CACHE_HOME/flashsample`, else `~/.cache/flashsample`, in `ptx/`. The disk cache
//! only saves LLVM time: any failure to read or write it is a warning, never an error.

use super::{
    device::{drv, driver_error_text},
    ptx, CudaDevice,
};
use crate::{Error, Result};
use cudarc::driver::{sys, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;
use flashsample_codegen_ptx::{CodegenOptions, GpuConfig};
use flashsample_ir::Pipeline;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

/// Dynamic shared memory a block gets without opting in (CUDA's fixed default).
const DEFAULT_SMEM_LIMIT: u32 = 48 * 1024;

/// A pipeline's kernels, loaded into one device's context.
pub(crate) struct LoadedKernel {
    pub stage1: CudaFunction,
    pub stage2: CudaFunction,
    /// Stage three, for pipelines with lists.
    pub filter: Option<CudaFunction>,
    /// Keeps the module (and so both functions) alive.
    _module: Arc<CudaModule>,
    /// Whether the PTX came from the disk cache (for tests and logs).
    pub from_disk: bool,
    /// Stage-one CTAs one SM holds at once (the driver's occupancy calculator, with the
    /// config's dynamic shared memory): sizes persistent grids.
    pub stage1_per_sm: u32,
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
    /// First line of a cached file: the full key, checked on read so a hash collision or a
    /// hand-copied file cannot load the wrong kernel.
    fn header(&self) -> String {
        format!(
            "// flashsample-ptx-cache fingerprint={:016x} arch={} compiler={} skip_lse={} config={}\n",
            self.fingerprint, self.arch, self.compiler, self.skip_lse, self.config
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
    eprintln!("flashsample: warning: {msg}");
}

/// The loaded kernels of `pipeline` with `config` on `device`: from this process's cache,
/// else from the disk cache, else compiled now (and written to the disk cache). `skip_lse`:
/// stage one without the logsumexp partials (only for pipelines that have them; the caller
/// then passes lse = 0 to every stage).
pub(crate) fn kernel(device: &CudaDevice, pipeline: &Pipeline, config: &GpuConfig, skip_lse: bool) -> Result<Arc<LoadedKernel>> {
    let skip_lse = skip_lse && pipeline.needs_logsumexp();
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
    let path = cache_dir().map(|d| d.join("ptx").join(key.file_name()));
    let mut kernel = None;
    if let Some(text) = path.as_ref().and_then(|p| read_cached(p, &key)) {
        match load(device, &text, true, pipeline.list_capacity() > 0, config) {
            Ok(k) => kernel = Some(k),
            Err(e) => warn(format!("ignoring cached PTX {}: {e}", path.as_ref().map_or(String::new(), |p| p.display().to_string()))),
        }
    }
    let kernel = match kernel {
        Some(k) => k,
        None => {
            let options = CodegenOptions { skip_logsumexp: skip_lse, ..CodegenOptions::for_config(config) };
            let compiled = flashsample_codegen_ptx::compile_with(pipeline, config, device.arch(), options)?;
            let text = ptx::ptx_text(&compiled);
            let k = load(device, text, false, compiled.filter.is_some(), config)?;
            if let Some(p) = &path {
                write_cached(p, &key, text);
            }
            k
        }
    };
    let kernel = Arc::new(kernel);
    map.insert(key, kernel.clone());
    Ok(kernel)
}

fn read_cached(path: &PathBuf, key: &Key) -> Option<String> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            warn(format!("cannot read cached PTX {}: {e}", path.display()));
            return None;
        }
    };
    let header = key.header();
    match text.strip_prefix(&header) {
        Some(body) => Some(body.to_string()),
        None => {
            warn(format!("cached PTX {} is for another kernel or corrupt; recompiling", path.display()));
            None
        }
    }
}

fn write_cached(path: &PathBuf, key: &Key, text: &str) {
    let result = (|| -> std::io::Result<()> {
        let dir = path.parent().ok_or_else(|| std::io::Error::other("no parent directory"))?;
        std::fs::create_dir_all(dir)?;
        // Write then rename, so a concurrent reader never sees half a file.
        let tmp = dir.join(format!(".{}.{}.tmp", key.file_name(), std::process::id()));
        std::fs::write(&tmp, format!("{}{text}", key.header()))?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        warn(format!("cannot write PTX cache {}: {e}", path.display()));
    }
}

/// Loads PTX into the device's context and looks up its kernels (stage three iff `filter`).
/// Stage one's dynamic shared memory is opted into here (above 48 KB a launch needs it), and
/// its occupancy read with it.
fn load(device: &CudaDevice, text: &str, from_disk: bool, filter: bool, config: &GpuConfig) -> Result<LoadedKernel> {
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
    let stage2 = module.load_function(ptx::STAGE2).map_err(drv("cuModuleGetFunction(flashsample_stage2)"))?;
    let filter = if filter {
        Some(module.load_function(ptx::FILTER).map_err(drv("cuModuleGetFunction(flashsample_filter)"))?)
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
    Ok(LoadedKernel { stage1, stage2, filter, _module: module, from_disk, stage1_per_sm })
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
        assert_ne!(nolse.header(), key().header());
    }

    #[test]
    fn round_trip_and_mismatched_header() {
        let dir = std::env::temp_dir().join(format!("flashsample-cache-test-{}", std::process::id()));
        let path = dir.join("ptx").join(key().file_name());
        write_cached(&path, &key(), ".version 8.0\n");
        assert_eq!(read_cached(&path, &key()).as_deref(), Some(".version 8.0\n"));
        // Same file name, different full key (as after a hash collision): not used.
        let other = Key { config: "{\"t\":3}".into(), ..key() };
        assert_eq!(read_cached(&path, &other), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn unwritable_or_missing_cache_is_not_an_error() {
        // A path under a regular file cannot be created: write_cached only warns.
        let file = std::env::temp_dir().join(format!("flashsample-cache-file-{}", std::process::id()));
        std::fs::write(&file, b"x").unwrap();
        let path = file.join("ptx").join("k.ptx");
        write_cached(&path, &key(), "ptx");
        assert_eq!(read_cached(&path, &key()), None);
        let _ = std::fs::remove_file(&file);
    }
}
