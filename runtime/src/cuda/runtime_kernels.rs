//! The runtime's own small kernels, written as PTX text here because they are glue, not
//! sampling: they let a launch stay on the device (no host copy, so it can be captured into a
//! CUDA graph) where it would otherwise need a host round trip.
//!
//! - `flashsample_store_words`: copies 32 words passed by value into a device buffer. The TMA
//!   tensor maps are encoded on the host per launch (they hold the operands' addresses); passing
//!   them as kernel parameters captures them into a graph node, with no pageable host memory
//!   that a later launch could overwrite before the copy ran.
//! - `flashsample_greedy_flags`: `greedy[r] = all_greedy | (temperatures[r] == 0)`, what stage
//!   three reads, from the caller's device temperatures.
//! - `flashsample_finalize`: the samples of a row whose status is not ok become
//!   `abi::INDEX_NONE` (a sample is never a token the kernels could not vouch for), and, when
//!   asked, `logprob = logit − logsumexp[row]` (NaN for such rows).

use super::device::drv;
use super::elementwise;
use super::CudaDevice;
use crate::Result;
use cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use flashsample_abi::INDEX_NONE;
use std::sync::Arc;

/// Words `flashsample_store_words` copies (two 128-byte tensor maps).
pub(crate) const STORE_WORDS: usize = 32;

fn store_words_ptx() -> String {
    let mut body = String::new();
    for i in 0..STORE_WORDS {
        let at = 8 * i;
        body.push_str(&format!("    ld.param.u64 %rd2, [words+{at}];\n    st.global.u64 [%rd1+{at}], %rd2;\n"));
    }
    format!(
        ".visible .entry flashsample_store_words(\n    .param .u64 dst,\n    .param .align 8 .b8 words[{}]\n)\n{{\n    \
         .reg .b64 %rd<3>;\n    ld.param.u64 %rd1, [dst];\n    cvta.to.global.u64 %rd1, %rd1;\n{body}    ret;\n}}\n",
        8 * STORE_WORDS
    )
}

fn greedy_flags_ptx() -> String {
    elementwise::entry(
        "flashsample_greedy_flags",
        &[".u64 temperatures", ".u64 out", ".u32 n", ".u32 all_greedy"],
        &[".pred %p<3>", ".b32 %r<8>", ".f32 %f1", ".b64 %rd<6>"],
        "GF_DONE",
        r#"
    ld.param.u64 %rd1, [temperatures];
    cvta.to.global.u64 %rd1, %rd1;
    ld.param.u64 %rd2, [out];
    cvta.to.global.u64 %rd2, %rd2;
    mul.wide.u32 %rd3, %r4, 4;
    add.s64 %rd4, %rd1, %rd3;
    ld.global.f32 %f1, [%rd4];
    setp.eq.f32 %p2, %f1, 0f00000000;
    selp.u32 %r6, 1, 0, %p2;
    ld.param.u32 %r7, [all_greedy];
    or.b32 %r6, %r6, %r7;
    add.s64 %rd5, %rd2, %rd3;
    st.global.u32 [%rd5], %r6;
"#,
    )
}

fn finalize_ptx() -> String {
    let body = format!(
        r#"
    ld.param.u32 %r6, [samples];
    div.u32 %r7, %r4, %r6;
    ld.param.u64 %rd1, [status];
    cvta.to.global.u64 %rd1, %rd1;
    mul.wide.u32 %rd2, %r7, 4;
    add.s64 %rd3, %rd1, %rd2;
    ld.global.u32 %r8, [%rd3];
    setp.ne.u32 %p2, %r8, 0;
    mul.wide.u32 %rd4, %r4, 4;
    ld.param.u64 %rd5, [logprobs];
    setp.ne.u64 %p3, %rd5, 0;
    @!%p2 bra FIN_OK;
    ld.param.u64 %rd6, [tokens];
    cvta.to.global.u64 %rd6, %rd6;
    add.s64 %rd7, %rd6, %rd4;
    mov.u32 %r9, {none};
    st.global.u32 [%rd7], %r9;
    @!%p3 bra FIN_DONE;
    cvta.to.global.u64 %rd8, %rd5;
    add.s64 %rd9, %rd8, %rd4;
    mov.f32 %f1, 0f7FC00000;
    st.global.f32 [%rd9], %f1;
    bra FIN_DONE;
FIN_OK:
    @!%p3 bra FIN_DONE;
    ld.param.u64 %rd10, [logits];
    cvta.to.global.u64 %rd10, %rd10;
    add.s64 %rd11, %rd10, %rd4;
    ld.global.f32 %f1, [%rd11];
    ld.param.u64 %rd12, [lse];
    cvta.to.global.u64 %rd12, %rd12;
    add.s64 %rd13, %rd12, %rd2;
    ld.global.f32 %f2, [%rd13];
    sub.rn.f32 %f3, %f1, %f2;
    cvta.to.global.u64 %rd14, %rd5;
    add.s64 %rd15, %rd14, %rd4;
    st.global.f32 [%rd15], %f3;
"#,
        none = INDEX_NONE
    );
    elementwise::entry(
        "flashsample_finalize",
        &[".u64 tokens", ".u64 status", ".u64 logits", ".u64 lse", ".u64 logprobs", ".u32 n", ".u32 samples"],
        &[".pred %p<4>", ".b32 %r<10>", ".f32 %f<4>", ".b64 %rd<16>"],
        "FIN_DONE",
        &body,
    )
}

/// The module's text: sm_80 PTX the driver JIT-compiles for any supported GPU.
fn module_text() -> String {
    format!("{}\n{}{}{}", elementwise::MODULE_HEADER, store_words_ptx(), greedy_flags_ptx(), finalize_ptx())
}

/// The runtime's small kernels, loaded once per device.
pub(crate) struct AuxKernels {
    store_words: CudaFunction,
    greedy_flags: CudaFunction,
    finalize: CudaFunction,
    _module: Arc<CudaModule>,
}

impl AuxKernels {
    pub(crate) fn load(device: &CudaDevice) -> Result<AuxKernels> {
        let module = device.context().load_module(Ptx::from_src(module_text())).map_err(drv("cuModuleLoadData(runtime kernels)"))?;
        let get = |name: &'static str| module.load_function(name).map_err(drv("cuModuleGetFunction(runtime kernel)"));
        Ok(AuxKernels {
            store_words: get("flashsample_store_words")?,
            greedy_flags: get("flashsample_greedy_flags")?,
            finalize: get("flashsample_finalize")?,
            _module: module.clone(),
        })
    }

    /// Queues a copy of `words` to `dst` (at least `8 * STORE_WORDS` bytes, 8-byte aligned).
    pub(crate) fn store_words(&self, stream: &CudaStream, dst: u64, words: &[u64; STORE_WORDS]) -> Result<()> {
        let mut b = stream.launch_builder(&self.store_words);
        b.arg(&dst).arg(words);
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the signature above; `dst` holds 256 bytes (the caller's contract).
        unsafe { b.launch(cfg) }.map_err(drv("cuLaunchKernel(flashsample_store_words)"))?;
        Ok(())
    }

    /// Queues `out[r] = all_greedy | (temperatures[r] == 0)` for `n` rows.
    pub(crate) fn greedy_flags(&self, stream: &CudaStream, temperatures: u64, out: u64, n: u32, all_greedy: bool) -> Result<()> {
        let all = u32::from(all_greedy);
        let mut b = stream.launch_builder(&self.greedy_flags);
        b.arg(&temperatures).arg(&out).arg(&n).arg(&all);
        // SAFETY: the signature above; both buffers hold `n` elements (the caller's contract).
        unsafe { b.launch(elementwise::grid(n)) }.map_err(drv("cuLaunchKernel(flashsample_greedy_flags)"))?;
        Ok(())
    }

    /// Queues the finalization of `n = batch * samples` samples (see the module docs);
    /// `logprobs = 0` skips the logprobs (then `logits` and `lse` are not read).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn finalize(
        &self,
        stream: &CudaStream,
        tokens: u64,
        status: u64,
        logits: u64,
        lse: u64,
        logprobs: u64,
        n: u32,
        samples: u32,
    ) -> Result<()> {
        let mut b = stream.launch_builder(&self.finalize);
        b.arg(&tokens).arg(&status).arg(&logits).arg(&lse).arg(&logprobs).arg(&n).arg(&samples);
        // SAFETY: the signature above; `tokens`, `logits`, `logprobs` hold `n` elements and
        // `status`, `lse` `n / samples` (the caller's contract).
        unsafe { b.launch(elementwise::grid(n)) }.map_err(drv("cuLaunchKernel(flashsample_finalize)"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_module_names_every_kernel_once() {
        let text = module_text();
        for name in ["flashsample_store_words", "flashsample_greedy_flags", "flashsample_finalize"] {
            assert_eq!(text.matches(&format!(".entry {name}(")).count(), 1, "{name}");
        }
        assert_eq!(text.matches("st.global.u64").count(), STORE_WORDS);
        assert!(text.contains(&format!("mov.u32 %r9, {INDEX_NONE};")));
    }
}
