//! The worker pools kernels launch on: one per thread count in the process, shared by every
//! kernel (and so every sampler and vocabulary size) that asks for that many threads, and
//! freed when the last kernel holding it is dropped.

use crate::CpuCodegenError;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

static POOLS: Mutex<Option<HashMap<usize, Weak<rayon::ThreadPool>>>> = Mutex::new(None);

/// The process's pool of `threads` workers, started on first use. Its threads are named
/// `fs-cpu{threads}-{i}` (short enough for Linux's 15-byte thread names).
pub fn thread_pool(threads: usize) -> Result<Arc<rayon::ThreadPool>, CpuCodegenError> {
    // A poisoned lock only means a thread panicked while holding it; the map stays valid.
    let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
    let pools = pools.get_or_insert_with(HashMap::new);
    if let Some(pool) = pools.get(&threads).and_then(Weak::upgrade) {
        return Ok(pool);
    }
    pools.retain(|_, p| p.strong_count() > 0);
    let pool = Arc::new(
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("fs-cpu{threads}-{i}"))
            .build()
            .map_err(|e| CpuCodegenError::ThreadPool(e.to_string()))?,
    );
    pools.insert(threads, Arc::downgrade(&pool));
    Ok(pool)
}
