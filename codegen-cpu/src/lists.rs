//! The CPU kernel's top lists while a launch runs (DESIGN.md step 6b): each (row, tile) list
//! is a binary heap whose root, entry 0, is the entry that ranks last, so the JIT'd gate
//! reads the list's bar at entry 0 and an insertion costs O(log K) swaps instead of shifting
//! the list. [`finish_tile`] sorts a tile's lists into `Scored::ranks_before` order once its
//! epilogue is done, so callers only ever see sorted lists, the same entries that inserting
//! into sorted lists gives (the best `K` of a tile under a total order are unique).

use crate::kernel::KernelArgs;
use flashsample_abi::Scored;

/// Puts `s` in place of the root of `heap` if it ranks before it, then restores the heap
/// (every entry ranks after neither child); `raws` (the paired raw logits, same length) move
/// in lockstep.
fn push_pop(heap: &mut [Scored], mut raws: Option<&mut [f32]>, s: Scored, raw: f32) {
    if heap.is_empty() || !s.ranks_before(&heap[0]) {
        return;
    }
    heap[0] = s;
    if let Some(r) = raws.as_deref_mut() {
        r[0] = raw;
    }
    let n = heap.len();
    let mut i = 0;
    loop {
        let l = 2 * i + 1;
        if l >= n {
            break;
        }
        // The child that ranks last goes up, if it ranks after the entry here.
        let w = if l + 1 < n && heap[l].ranks_before(&heap[l + 1]) { l + 1 } else { l };
        if !heap[i].ranks_before(&heap[w]) {
            break;
        }
        heap.swap(i, w);
        if let Some(r) = raws.as_deref_mut() {
            r.swap(i, w);
        }
        i = w;
    }
}

/// Sorts one list (and its paired raw logits) from heap order into list order.
fn sort_list(list: &mut [Scored], raws: Option<&mut [f32]>) {
    match raws {
        None => list.sort_unstable_by(Scored::rank_order),
        Some(raws) => {
            let mut pairs: Vec<(Scored, f32)> = list.iter().copied().zip(raws.iter().copied()).collect();
            pairs.sort_unstable_by(|a, b| a.0.rank_order(&b.0));
            for (j, (s, r)) in pairs.into_iter().enumerate() {
                list[j] = s;
                raws[j] = r;
            }
        }
    }
}

/// SAFETY (caller): `list` points to a heap of `per_tile` entries, `x` to 4 floats (`-inf` for
/// lanes that are masked or past the vocabulary).
pub(crate) unsafe extern "C" fn insert_quad(list: *mut Scored, per_tile: u64, v: u64, x: *const f32) {
    let (list, x) = unsafe { (std::slice::from_raw_parts_mut(list, per_tile as usize), std::slice::from_raw_parts(x, 4)) };
    for (j, &xj) in x.iter().enumerate() {
        if xj > f32::NEG_INFINITY {
            push_pop(list, None, Scored { logit: xj, index: v as u32 + j as u32 }, 0.0);
        }
    }
}

/// SAFETY (caller): as [`insert_quad`], and `raws` points to `per_tile` floats, `x` to 8 (the
/// quad's logits, then their raw logits).
pub(crate) unsafe extern "C" fn insert_quad_paired(list: *mut Scored, raws: *mut f32, per_tile: u64, v: u64, x: *const f32) {
    let n = per_tile as usize;
    let (list, raws, x) =
        unsafe { (std::slice::from_raw_parts_mut(list, n), std::slice::from_raw_parts_mut(raws, n), std::slice::from_raw_parts(x, 8)) };
    for j in 0..4 {
        if x[j] > f32::NEG_INFINITY {
            push_pop(list, Some(&mut *raws), Scored { logit: x[j], index: v as u32 + j as u32 }, x[4 + j]);
        }
    }
}

/// Sorts every list of `tile` (processed lists with their paired raw logits, raw lists).
///
/// SAFETY (caller): `args` describes the launch whose epilogue of `tile` has returned, and no
/// other thread touches that tile's lists (tasks cover disjoint tiles).
pub(crate) unsafe fn finish_tile(args: &KernelArgs, tile: usize) {
    let tiles = args.tiles as usize;
    for r in 0..args.batch as usize {
        let slot = r * tiles + tile;
        if !args.lists.is_null() && args.per_tile > 0 {
            let n = args.per_tile as usize;
            // SAFETY: the launch checked `lists` (and `list_raws`) hold `[B, tiles, per_tile]`.
            let list = unsafe { std::slice::from_raw_parts_mut(args.lists.add(slot * n), n) };
            let raws = (!args.list_raws.is_null()).then(|| unsafe { std::slice::from_raw_parts_mut(args.list_raws.add(slot * n), n) });
            sort_list(list, raws);
        }
        if !args.raw_lists.is_null() && args.raw_per_tile > 0 {
            let n = args.raw_per_tile as usize;
            // SAFETY: as above, `[B, tiles, raw_per_tile]`.
            let list = unsafe { std::slice::from_raw_parts_mut(args.raw_lists.add(slot * n), n) };
            sort_list(list, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_insertion_then_sort_is_sorted_insertion() {
        // Random tokens with tied logits into lists of 1..=70 entries, with paired raws: the
        // heap, sorted, equals inserting into a sorted list, raw logits beside their entries.
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x2545_f491_4f6c_dd1d);
        for len in 1..=70usize {
            let (mut heap, mut heap_raws) = (vec![Scored::EMPTY; len], vec![f32::NAN; len]);
            let (mut sorted, mut sorted_raws) = (vec![Scored::EMPTY; len], vec![f32::NAN; len]);
            for index in 0..300u32 {
                let s = Scored { logit: rng.random_range(0..6) as f32, index };
                let raw = index as f32 * 0.5;
                push_pop(&mut heap, Some(&mut heap_raws), s, raw);
                flashsample_abi::raw::insert_paired(&mut sorted, &mut sorted_raws, s, raw);
            }
            sort_list(&mut heap, Some(&mut heap_raws));
            assert_eq!(heap, sorted, "len {len}");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&heap_raws), bits(&sorted_raws), "len {len}");
        }
    }
}
