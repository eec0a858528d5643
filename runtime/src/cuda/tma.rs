//! Tensor maps for the TMA stage one (`Schedule::WgmmaTma`): the driver-encoded descriptors that
//! `cp.async.bulk.tensor` reads, one W map and one H map per launch, passed by value as stage
//! one's kernel-constant parameter `%tmaps` (W at +0, H at +128; `ParamKind::TensorMaps`).
use super::device::drv;
use crate::{Error, Result};
use cudarc::driver::sys;
use flashsample_codegen_ptx::TensorMapWords;

/// W and H maps for one launch, as the kernel reads them at `%tmaps`.
///
/// W (`vocab × dim`, row-major, 2-byte elements) is viewed as 5-d `(k, g, e, K, h)` with row
/// `32K + 4g + 2h + e` (strides of 4, 1, 32 and 2 rows: listed in the order the rows sit in
/// shared memory), so that one `{64, 8, 2, 4, 2}` box is a warpgroup's 128 rows in wgmma's
/// accumulator order (codegen-ptx `tma_issue`); H (`batch × dim`) is 2-d with
/// `{64, batch_tile}` boxes. Both use the 128-byte swizzle and zero fill outside the tensor.
pub(crate) fn encode_operands(weights: u64, hidden: u64, vocab: usize, dim: usize, batch: usize, batch_tile: u32) -> Result<TensorMapWords> {
    if !flashsample_codegen_ptx::GpuConfig::tma_fits(dim, vocab) || !weights.is_multiple_of(16) || !hidden.is_multiple_of(16) {
        return Err(Error::Unsupported(format!(
            "TMA stage one for dim {dim}, vocab {vocab} (needs dim % 8 == 0, vocab % 32 == 0 and 16-byte aligned operands)"
        )));
    }
    let row = 2 * dim as u64;
    let w = encode(weights, &[dim as u64, 8, 2, vocab as u64 / 32, 2], &[4 * row, row, 32 * row, 2 * row], &[64, 8, 2, 4, 2])?;
    let h = encode(hidden, &[dim as u64, batch as u64], &[row], &[64, batch_tile])?;
    let mut out = TensorMapWords::default();
    let (w_words, h_words) = out.split_at_mut(w.opaque.len());
    w_words.copy_from_slice(&w.opaque);
    h_words.copy_from_slice(&h.opaque);
    Ok(out)
}

/// One tiled map of 2-byte elements; `strides`: bytes of dimensions 1.. (dimension 0 is dense).
fn encode(address: u64, dims: &[u64], strides: &[u64], boxes: &[u32]) -> Result<sys::CUtensorMap> {
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    let ones = [1u32; 5];
    // SAFETY: every array holds `dims.len()` (strides: one fewer) entries, as the rank says;
    // the driver only reads them and writes the 128-byte map.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
            dims.len() as u32,
            address as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            ones.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()
    .map_err(drv("cuTensorMapEncodeTiled"))?;
    Ok(map)
}
