//! The raw logprob mode's contract (DESIGN.md "Logprob modes"): which logits are raw, which
//! tokens count, and how the token a filter draws finds its raw logit.
//!
//! - Raw logit of token `v`: the matmul's logit with only the pipeline's model transforms
//!   applied, in pipeline order (`flashsample_ir::Transform::is_model`: the global bias and the
//!   softcap), in the same f32 ops as the processed path. Request transforms (per-request logit
//!   bias, penalties, temperature) and masks / bans do not touch it.
//! - Raw logsumexp: the exact `crate::lse` sum over every token with a finite raw logit — masked
//!   and banned tokens included (the model's distribution), a `-inf` global bias excluded (it is
//!   the model's). Partials `raw_lse[r * tiles + tile]`, merged like the processed ones.
//! - The sampled token's raw logprob: its raw logit minus the raw logsumexp. Stage one's
//!   candidate carries the raw logit as its `logit` (the winner is still chosen by the processed
//!   score); the token a filter draws takes the raw logit stored beside its list entry
//!   ([`insert_paired`], [`raw_logit_of`]).
//! - Raw `top_logprobs = n`: per (row, tile) a list of the `n` best tokens by raw logit (every
//!   token with raw logit `> -inf`), in `Scored` order, merged as the processed lists are.
//! - `target_logprob`: the target's raw logit minus the raw logsumexp (`-inf` only when a `-inf`
//!   global bias excludes it).

use crate::filter::Scored;

/// [`crate::filter::insert`] of `s` with its raw logit `raw` into a sorted list and its
/// companion `raws` (the same length), moving both in lockstep: `raws[j]` stays the raw logit
/// of `list[j]`. A no-op if `s` ranks after every entry.
pub fn insert_paired(list: &mut [Scored], raws: &mut [f32], s: Scored, raw: f32) {
    debug_assert_eq!(list.len(), raws.len());
    if let Some(pos) = crate::filter::insert(list, s) {
        crate::filter::shift_in(raws, pos, raw);
    }
}

/// The raw logit stored beside `token`'s entry in a row's lists (`row_lists` and its companion
/// `row_raws`, every tile of the row), or `None` if no list holds the token. A token a filter
/// drew came from these lists, so it is always found.
pub fn raw_logit_of(row_lists: &[Scored], row_raws: &[f32], token: u32) -> Option<f32> {
    row_lists.iter().zip(row_raws).find(|(s, _)| s.index == token && !s.is_empty()).map(|(_, &r)| r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paired_insertion_keeps_each_raw_logit_beside_its_entry() {
        let mut list = [Scored::EMPTY; 3];
        let mut raws = [f32::NAN; 3];
        for (v, x, raw) in [(4u32, 1.0f32, -1.0f32), (9, 3.0, -3.0), (2, 1.0, -2.0), (7, 0.5, -7.0), (1, 2.0, -0.5)] {
            insert_paired(&mut list, &mut raws, Scored { logit: x, index: v }, raw);
        }
        assert_eq!(list.map(|s| s.index), [9, 1, 2]);
        assert_eq!(raws, [-3.0, -0.5, -2.0]);
        assert_eq!(raw_logit_of(&list, &raws, 2), Some(-2.0));
        assert_eq!(raw_logit_of(&list, &raws, 4), None, "token 4 was pushed out");
    }
}
