//! The scaffolding of the GPU fixtures' small hand-written PTX kernels (the toy decode model's
//! gather and step advance, `gpu.rs`): the module header, an entry whose threads past its `n`
//! parameter do nothing, and the grid that covers `n` elements. The library's own kernels are
//! all emitted by `flashsample-codegen-ptx`.

use cudarc::driver::LaunchConfig;

/// Threads per block of an elementwise launch.
pub const THREADS: u32 = 256;

/// The header of a module of sm_80 PTX, which the driver JIT-compiles for any supported GPU.
pub const MODULE_HEADER: &str = ".version 7.0\n.target sm_80\n.address_size 64\n";

/// The PTX of `.visible .entry name(params)`, one thread per element.
///
/// `params` are the parameters' types and names (`".u64 out"`); one must be `.u32 n`, the
/// element count. The prologue leaves the thread's global index in `%r4` (it writes `%r1` to
/// `%r5` and `%p1`, which `regs`, the register declarations, must cover) and branches to
/// `done` when the index is not below `n`; otherwise `body` (instructions, one a line) runs and
/// falls through, or branches, to `done`, where the entry returns.
pub fn entry(name: &str, params: &[&str], regs: &[&str], done: &str, body: &str) -> String {
    let params: Vec<String> = params.iter().map(|p| format!("    .param {p}")).collect();
    let regs: String = regs.iter().map(|r| format!("    .reg {r};\n")).collect();
    format!(
        ".visible .entry {name}(\n{params}\n)\n{{\n{regs}    \
         mov.u32 %r1, %ctaid.x;\n    mov.u32 %r2, %ntid.x;\n    mov.u32 %r3, %tid.x;\n    \
         mad.lo.s32 %r4, %r1, %r2, %r3;\n    ld.param.u32 %r5, [n];\n    setp.ge.u32 %p1, %r4, %r5;\n    \
         @%p1 bra {done};\n{body}{done}:\n    ret;\n}}\n",
        params = params.join(",\n"),
        body = body.trim_start_matches('\n'),
    )
}

/// The launch of an [`entry`] over `n` elements: [`THREADS`] a block, at least one block.
pub fn grid(n: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (n.div_ceil(THREADS).max(1), 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_guards_its_threads_and_declares_its_parameters() {
        let text = entry("k", &[".u64 out", ".u32 n"], &[".pred %p1", ".b32 %r<6>"], "K_DONE", "    add.u32 %r4, %r4, 1;\n");
        assert!(text.starts_with(".visible .entry k(\n    .param .u64 out,\n    .param .u32 n\n)\n{\n    .reg .pred %p1;\n"));
        assert!(text.contains("setp.ge.u32 %p1, %r4, %r5;\n    @%p1 bra K_DONE;\n    add.u32 %r4, %r4, 1;\nK_DONE:\n    ret;\n}\n"));
    }

    #[test]
    fn the_grid_covers_every_element() {
        assert_eq!(grid(0).grid_dim.0, 1);
        assert_eq!(grid(THREADS).grid_dim.0, 1);
        assert_eq!(grid(THREADS + 1).grid_dim.0, 2);
    }
}
