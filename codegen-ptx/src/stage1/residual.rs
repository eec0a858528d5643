//! Speculative verification's residual lists (DESIGN.md "Speculative verification"): per
//! (draft row, vocab tile) the `residual_per_tile` best tokens by the residual stream's
//! perturbed score `x + G_res`, selected from the list tile by warp-wide rounds and written as
//! `abi::Candidate`s sorted by score (ties to the lower index, as `abi::speculative::insert_residual`).

use super::lists::{take_max, Taken};
use super::{Gen, Item, Thread};
use crate::ir::{Func, Value, Var, F32, I32, NEG_INF};
use crate::math;
use flashsample_abi::rng::NoiseStream;
use flashsample_abi::INDEX_NONE;

/// Whether kernel row `row` (launch row `%row_base + row`) of a verifying launch is a draft
/// row, by the kernel's `%row_base` and `%spec_period` (see [`Gen::is_draft_row`]).
pub(crate) fn is_draft_row(f: &mut Func, row: &str) -> String {
    let launch_row = f.add_u(row, "%row_base");
    let every = f.v("icmp eq i32 %spec_period, 0");
    let period = f.sel_u("i32", &every, "1", "%spec_period");
    let pos = f.v(format!("urem i32 {launch_row}, {period}"));
    let last = f.v(format!("sub i32 {period}, 1"));
    let draft = f.v(format!("icmp ne i32 {pos}, {last}"));
    f.v(format!("or i1 {every}, {draft}"))
}

impl Gen<'_> {
    /// Whether launch row `b0 + col = row` is a draft row: `(row_base + row) mod spec_period ≠
    /// spec_period − 1` (each sequence's last row is its bonus); every row when
    /// `%spec_period` is 0.
    pub(super) fn is_draft_row(&self, f: &mut Func, row: &str) -> String {
        is_draft_row(f, row)
    }

    /// The residual lists of the item's draft rows. One warp per row (uniform branches, so the
    /// warp-wide rounds see every lane): lane `l` reads the `E = vocab_tile / 32` consecutive
    /// transformed logits `l·E ..` of the row's column from the list tile (stored here unless
    /// the list epilogue already did), draws their residual-stream Gumbel noise (the token
    /// noise's counter layout, `abi::speculative::residual_bits`, one Philox block per 4
    /// tokens) and keys `order_key(x + G)` (0 for an excluded token, which never enters a
    /// list); `residual_per_tile` [`take_max`] rounds then write the list. Every token of the
    /// tile draws its noise: the list is exact without any noise skip.
    pub(super) fn residual_epilogue(&self, f: &mut Func, th: &Thread, it: &Item, x: &[String]) {
        let c = self.c;
        let vt = c.vocab_tile;
        let base = if c.list_per_tile > 0 {
            f.add_u(&th.scratch, &c.smem_layout().list_tile.to_string())
        } else {
            self.store_list_tile(f, th, x)
        };
        let per_tile = c.residual_per_tile;
        let per_lane = vt / 32;
        let none = INDEX_NONE as i32;
        let has_out = f.v("icmp ne ptr addrspace(1) %residual_lists, null");
        let has_rs = f.v("icmp ne ptr addrspace(1) %row_seeds, null");
        let lane_first = f.mul_u(&th.lane, &per_lane.to_string());
        // Global index of the lane's first token (the noise counter's token).
        let first = f.add_u(&it.v0, &lane_first);
        let first_g = f.add_u(&first, "%vocab_offset");
        f.for_loop_u(&th.warp, &c.batch_tile.to_string(), &c.warps.to_string(), |f, col| {
            let row = f.add_u(&it.b0, col);
            let row_ok = f.ult_u(&row, "%batch");
            let draft = self.is_draft_row(f, &row);
            let ok = f.and1_u(&row_ok, &draft);
            let ok = f.and1_u(&ok, &has_out);
            f.if_then_u(&ok, |f| {
                let r64 = f.zext64_u(&row);
                let (key_lo, key_hi, ctr_row) = math::row_stream_u(f, &has_rs, &row, &r64);
                let word3 = math::stream_word3_u(f, &r64, NoiseStream::SpecResidual);
                let e = f.mul_u(col, &vt.to_string());
                let e = f.add_u(&e, &lane_first);
                let off = f.v(format!("shl i32 {e}, 2"));
                let off = f.add_u(&off, &base);
                let xs: Vec<String> = (0..per_lane)
                    .map(|o| {
                        let oo = f.add_u(&off, &(o * 4).to_string());
                        let a = f.saddr_u("@fs_smem", &oo);
                        f.v(format!("load float, ptr addrspace(3) {a}, align 4"))
                    })
                    .collect();
                let ty = "{ i32, i32, i32, i32 }";
                let philox = |f: &mut Func, g: &str| {
                    let ctr = f.v(format!("lshr i32 {g}, 2"));
                    f.v(format!("call {ty} @fs_philox(i32 {ctr}, i32 {ctr_row}, i32 0, i32 {word3}, i32 {key_lo}, i32 {key_hi})"))
                };
                let mut scores = Vec::new();
                let mut block = String::new();
                for (o, xv) in xs.iter().enumerate() {
                    let g = f.add_u(&first_g, &o.to_string());
                    let bits = if per_lane.is_multiple_of(4) {
                        // The lane's first token is a multiple of 4: token o is word o mod 4.
                        if o % 4 == 0 {
                            block = philox(f, &g);
                        }
                        f.v(format!("extractvalue {ty} {block}, {}", o % 4))
                    } else {
                        math::token_bits_u(f, &g, &ctr_row, "0", &word3, (&key_lo, &key_hi))
                    };
                    let noise = f.v(format!("call float @fs_gumbel_f32(i32 {bits})"));
                    scores.push(f.fadd_u(xv, &noise));
                }
                let keys: Vec<Var> = scores
                    .iter()
                    .map(|s| {
                        let k = f.order_key_u(s);
                        f.var_u("i32", &k)
                    })
                    .collect();
                let slot0 = f.mul_u(&row, &it.vtiles);
                let slot0 = f.add_u(&slot0, &it.vtile);
                let slot0 = f.mul_u(&slot0, &per_tile.to_string());
                let score_refs: Vec<&str> = scores.iter().map(String::as_str).collect();
                let x_refs: Vec<&str> = xs.iter().map(String::as_str).collect();
                f.for_loop_u("0", &per_tile.to_string(), "1", |f, k| {
                    let Taken { real, me, pos, values } = take_max(f, &th.lane, &keys, &[&score_refs, &x_refs]);
                    let idx = f.add_u(&first, &pos);
                    let idx = f.sel_u("i32", &real, &idx, &none.to_string());
                    let score = f.sel_u("float", &real, &values[0], NEG_INF);
                    let logit = f.sel_u("float", &real, &values[1], NEG_INF);
                    f.if_then_u(&me, |f| {
                        let slot = f.add_u(&slot0, k);
                        let s64 = f.zext64_u(&slot);
                        // abi::Candidate { score, index, logit }.
                        let a = f.gaddr_u("%residual_lists", &s64, 12);
                        f.store(&F32::raw(score.clone()), &a, 4);
                        let a1 = f.offset(&a, 4);
                        f.store(&I32::raw(idx.clone()), &a1, 4);
                        let a2 = f.offset(&a, 8);
                        f.store(&F32::raw(logit.clone()), &a2, 4);
                    });
                });
            });
        });
    }
}
