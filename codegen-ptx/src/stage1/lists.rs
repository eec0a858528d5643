//! DESIGN.md step 6b: each (row, vocab tile)'s `list_per_tile` best tokens by transformed
//! logit, selected in registers by warp-wide rounds, written as `abi::Scored` lists.

use super::{Gen, Item, Thread};
use crate::ir::{Func, Value, Var, NEG_INF};
use flashsample_abi::INDEX_NONE;

impl Gen<'_> {
    /// DESIGN.md step 6b: the tile's transformed logits go to shared memory (column-major:
    /// `vocab_tile` floats per batch column, after the scratch), then one warp per row selects
    /// the row's `list_per_tile` best in registers: lane `l` holds the `E = vocab_tile / 32`
    /// consecutive tokens `l·E ..`, as order keys ([`Func::order_key`]: 0 for tokens that are
    /// not eligible). A round is one `redux.sync.max` over the lanes' best keys; the lowest
    /// lane holding that key (ballot) owns the lowest such index (lanes hold ascending index
    /// ranges), takes its lowest position with that key, zeroes it, and writes list entry
    /// `k` itself. A round whose max is 0 (nothing eligible left) writes `Scored::EMPTY` from
    /// lane 0. So the list is sorted by x descending, ties to the lower index, as before, with
    /// no shared-memory traffic or shuffle chains per round; a warp runs `rows` rows side by
    /// side so their rounds' latencies overlap (they were latency-bound one row at a time).
    ///
    /// `dest` names the lists parameter written (`%lists`, or `%raw_lists`, keyed by raw
    /// logit, in the raw mode: DESIGN.md step 10).
    pub(super) fn list_epilogue(&self, f: &mut Func, th: &Thread, it: &Item, x: &[String], dest: &str) {
        let c = self.c;
        let vt = c.vocab_tile;
        let base = self.store_list_tile(f, th, x);
        let none = INDEX_NONE as i32;
        let per_tile = c.list_per_tile;
        let bt = c.batch_tile;
        let per_lane = vt / 32;
        // Rows a warp selects together: enough to overlap the rounds' latencies, few enough
        // that `rows · per_lane` keys and logits stay in registers.
        let rows = (16 / per_lane).clamp(1, 4).min(bt.div_ceil(c.warps));
        let lists_ok = f.v(format!("icmp ne ptr addrspace(1) {dest}, null"));
        let lane_first = f.mul_u(&th.lane, &per_lane.to_string());
        let warp_first = f.mul_u(&th.warp, &rows.to_string());
        let group_step = (c.warps * rows).to_string();
        f.for_loop_u(&warp_first, &bt.to_string(), &group_step, |f, col0| {
            // Per row of the group: keys and logits (registers), the list slot, store guard.
            let mut keys: Vec<Vec<Var>> = Vec::new();
            let mut xs: Vec<Vec<String>> = Vec::new();
            let mut slot0s = Vec::new();
            let mut oks = Vec::new();
            for r in 0..rows {
                let col = f.add_u(col0, &r.to_string());
                let col_in = f.ult_u(&col, &bt.to_string());
                // A column past the tile reads the last column (stays inside the list area)
                // and stores nothing.
                let col_rd = f.sel_u("i32", &col_in, &col, &(bt - 1).to_string());
                let row = f.add_u(&it.b0, &col);
                let row_ok = f.ult_u(&row, "%batch");
                let ok = f.and1_u(&row_ok, &col_in);
                let ok = f.and1_u(&ok, &lists_ok);
                oks.push(ok);
                let e = f.mul_u(&col_rd, &vt.to_string());
                let e = f.add_u(&e, &lane_first);
                let off = f.v(format!("shl i32 {e}, 2"));
                let off = f.add_u(&off, &base.to_string());
                let mut vals = Vec::new();
                if per_lane.is_multiple_of(4) {
                    for v4 in 0..per_lane / 4 {
                        let o = f.add_u(&off, &(v4 * 16).to_string());
                        let a = f.saddr_u("@fs_smem", &o);
                        let vec = f.v(format!("load <4 x float>, ptr addrspace(3) {a}, align 16"));
                        for o in 0..4 {
                            vals.push(f.v(format!("extractelement <4 x float> {vec}, i32 {o}")));
                        }
                    }
                } else {
                    for o in 0..per_lane {
                        let oo = f.add_u(&off, &(o * 4).to_string());
                        let a = f.saddr_u("@fs_smem", &oo);
                        vals.push(f.v(format!("load float, ptr addrspace(3) {a}, align 4")));
                    }
                }
                let kv: Vec<Var> = vals
                    .iter()
                    .map(|v| {
                        let k = f.order_key_u(v);
                        f.var_u("i32", &k)
                    })
                    .collect();
                keys.push(kv);
                xs.push(vals);
                let slot0 = f.mul_u(&row, &it.vtiles);
                let slot0 = f.add_u(&slot0, &it.vtile);
                slot0s.push(f.mul_u(&slot0, &per_tile.to_string()));
            }
            f.for_loop_u("0", &per_tile.to_string(), "1", |f, k| {
                // All rows' reductions first (straight-line, so they interleave), then the
                // stores (each a branch).
                let mut writes = Vec::new();
                for r in 0..rows as usize {
                    let xr: Vec<&str> = xs[r].iter().map(String::as_str).collect();
                    let Taken { real, me, pos: wo, values } = take_max(f, &th.lane, &keys[r], &[&xr]);
                    let wx = &values[0];
                    let idx = f.add_u(&lane_first, &wo);
                    let idx = f.add_u(&it.v0, &idx);
                    let idx = f.sel_u("i32", &real, &idx, &none.to_string());
                    let lx = f.sel_u("float", &real, wx, NEG_INF);
                    let w = f.and1_u(&me, &oks[r]);
                    writes.push((w, lx, idx));
                }
                for (r, (w, lx, idx)) in writes.iter().enumerate() {
                    f.if_then_u(w, |f| {
                        let slot = f.add_u(&slot0s[r], k);
                        let s64 = f.zext64_u(&slot);
                        let a = f.gaddr_u(dest, &s64, 8);
                        f.s(format!("store float {lx}, ptr addrspace(1) {a}, align 4"));
                        let a1 = f.v(format!("getelementptr i8, ptr addrspace(1) {a}, i64 4"));
                        f.s(format!("store i32 {idx}, ptr addrspace(1) {a1}, align 4"));
                    });
                }
            });
        });
    }

    /// Calls `quad` with the shared address of each of the thread's quads in the list tile
    /// (column-major, `vocab_tile` floats per batch column, after the scratch: a quad is 4
    /// consecutive tokens of one column, one 16-byte access) and its `(q, n, j)`; returns the
    /// tile's offset in `@fs_smem`. The one layout [`Gen::store_list_tile`] and
    /// [`Gen::load_list_tile`] share.
    fn list_tile_quads(&self, f: &mut Func, th: &Thread, mut quad: impl FnMut(&mut Func, (u32, u32, u32), &str)) -> String {
        let vt = self.c.vocab_tile;
        let base = f.add_u(&th.scratch, &self.c.smem_layout().list_tile.to_string());
        let warp_base = f.mul_u(&th.warp, &self.warp_rows().to_string());
        let g4 = f.v(format!("shl i32 {}, 2", th.g));
        let t2 = f.v(format!("shl i32 {}, 1", th.t));
        for q in 0..self.quads {
            let local = f.add_u(&warp_base, &(q * 32).to_string());
            let local = f.add_u(&local, &g4);
            for n in 0..self.ntiles {
                for j in 0..2 {
                    let col = f.add_u(&t2, &(n * 8 + j).to_string());
                    let e = f.mul_u(&col, &vt.to_string());
                    let e = f.add_u(&e, &local);
                    let off = f.v(format!("shl i32 {e}, 2"));
                    let off = f.add_u(&off, &base);
                    let a = f.saddr_u("@fs_smem", &off);
                    quad(f, (q, n, j), a.text());
                }
            }
        }
        base
    }

    /// The tile's transformed logits into shared memory ([`Gen::list_tile_quads`]' layout),
    /// for the warps that select lists from it; returns the tile's offset in `@fs_smem`. Ends
    /// with a barrier.
    pub(super) fn store_list_tile(&self, f: &mut Func, th: &Thread, x: &[String]) -> String {
        let base = self.list_tile_quads(f, th, |f, (q, n, j), a| {
            let mut vec = "undef".to_string();
            for o in 0..4 {
                let xv = &x[self.acc_index(q, o, n, j)];
                vec = f.v(format!("insertelement <4 x float> {vec}, float {xv}, i32 {o}"));
            }
            f.s(format!("store <4 x float> {vec}, ptr addrspace(3) {a}, align 16"));
        });
        f.barrier();
        base
    }

    /// The thread's own logits back from the list tile [`Gen::store_list_tile`] wrote (same
    /// addresses, same indices as `x`; the thread reads only what it stored, so no barrier).
    pub(super) fn load_list_tile(&self, f: &mut Func, th: &Thread) -> Vec<String> {
        let mut x = vec![String::new(); self.acc_count()];
        self.list_tile_quads(f, th, |f, (q, n, j), a| {
            let vec = f.v(format!("load <4 x float>, ptr addrspace(3) {a}, align 16"));
            for o in 0..4 {
                x[self.acc_index(q, o, n, j)] = f.v(format!("extractelement <4 x float> {vec}, i32 {o}"));
            }
        });
        x
    }

    /// Step 10: beside each entry of this tile's processed lists (just written, read back
    /// after a barrier) its raw logit at `list_raws[slot]`, read from the tile of `raw` logits
    /// stored in the list area; empty entries are left alone (`abi::raw::raw_logit_of` skips
    /// them). Starts with a barrier: the selection may still read the tile this rewrites.
    pub(super) fn list_raws_epilogue(&self, f: &mut Func, th: &Thread, it: &Item, raw: &[String]) {
        let c = self.c;
        let (vt, bt, per_tile) = (c.vocab_tile, c.batch_tile, c.list_per_tile);
        f.barrier();
        let base = self.store_list_tile(f, th, raw);
        let has = f.v("icmp ne ptr addrspace(1) %list_raws, null");
        let lists_ok = f.v("icmp ne ptr addrspace(1) %lists, null");
        let has = f.and1_u(&has, &lists_ok);
        f.if_then_u(&has, |f| {
            let threads = (c.warps * 32).to_string();
            f.for_loop_u(&th.tid, &(bt * per_tile).to_string(), &threads, |f, e| {
                let col = f.v(format!("udiv i32 {e}, {per_tile}"));
                let k = f.v(format!("urem i32 {e}, {per_tile}"));
                let row = f.add_u(&it.b0, &col);
                let row_ok = f.ult_u(&row, "%batch");
                f.if_then_u(&row_ok, |f| {
                    let slot = f.mul_u(&row, &it.vtiles);
                    let slot = f.add_u(&slot, &it.vtile);
                    let slot = f.mul_u(&slot, &per_tile.to_string());
                    let slot = f.add_u(&slot, &k);
                    let s64 = f.zext64_u(&slot);
                    let a = f.gaddr_u("%lists", &s64, 8);
                    let a1 = f.v(format!("getelementptr i8, ptr addrspace(1) {a}, i64 4"));
                    // Volatile: other threads wrote the entry before the barrier, and `%lists` is
                    // `noalias`, so nothing else would keep the load after the barrier.
                    let idx = f.v(format!("load volatile i32, ptr addrspace(1) {a1}, align 4"));
                    let real = f.v(format!("icmp ne i32 {idx}, {}", INDEX_NONE as i32));
                    f.if_then_u(&real, |f| {
                        let local = f.v(format!("sub i32 {idx}, {}", it.v0));
                        let e = f.mul_u(&col, &vt.to_string());
                        let e = f.add_u(&e, &local);
                        let off = f.v(format!("shl i32 {e}, 2"));
                        let off = f.add_u(&off, &base);
                        let sa = f.saddr_u("@fs_smem", &off);
                        let r = f.v(format!("load float, ptr addrspace(3) {sa}, align 4"));
                        let ra = f.gaddr_u("%list_raws", &s64, 4);
                        f.s(format!("store float {r}, ptr addrspace(1) {ra}, align 4"));
                    });
                });
            });
        });
    }
}

/// One round of a warp's selection from keys in registers: the warp's largest key
/// ([`Func::order_key`]s, one `redux.sync.max`), found at the lowest lane holding it (ballot)
/// and that lane's lowest position with it, whose key becomes 0 (taken).
pub(super) struct Taken {
    /// Whether a key was left (the max is not 0): otherwise the round writes an empty entry.
    pub real: String,
    /// Whether this lane holds the taken position (exactly one lane; lane 0 when none is left).
    pub me: String,
    /// The taken position within this lane's keys.
    pub pos: String,
    /// Each payload's value at the taken position (`-inf` on the other lanes).
    pub values: Vec<String>,
}

/// Runs one [`Taken`] round over this lane's `keys`; `payloads` are per-position floats
/// (parallel to `keys`) to read at the taken position.
pub(super) fn take_max(f: &mut Func, lane: &str, keys: &[Var], payloads: &[&[&str]]) -> Taken {
    let cur: Vec<String> = keys.iter().map(|v| f.get_u(v)).collect();
    let mut best = cur[0].clone();
    for kk in &cur[1..] {
        best = f.umax_u(&best, kk);
    }
    let m = f.redux_umax_u(&best);
    let mine = f.v(format!("icmp eq i32 {best}, {m}"));
    let ball = f.ballot_u(&mine);
    // Never 0: the lane holding the max votes.
    let low = f.v(format!("call i32 @llvm.cttz.i32(i32 {ball}, i1 true)"));
    let me = f.v(format!("icmp eq i32 {lane}, {low}"));
    let found = f.var_u("i1", "false");
    let mut values = vec![NEG_INF.to_string(); payloads.len()];
    let mut pos = "0".to_string();
    for (o, kk) in cur.iter().enumerate() {
        let fv = f.get_u(&found);
        let nf = f.v(format!("xor i1 {fv}, true"));
        let hit = f.v(format!("icmp eq i32 {kk}, {m}"));
        let hit = f.and1_u(&hit, &nf);
        let hit = f.and1_u(&hit, &me);
        let nk = f.sel_u("i32", &hit, "0", kk);
        f.set_u(&keys[o], &nk);
        for (value, payload) in values.iter_mut().zip(payloads) {
            *value = f.sel_u("float", &hit, payload[o], value);
        }
        pos = f.sel_u("i32", &hit, &o.to_string(), &pos);
        let nfv = f.v(format!("or i1 {fv}, {hit}"));
        f.set_u(&found, &nfv);
    }
    // m == 0: every lane's best is 0, the ballot is full and lane 0 writes the empty entry.
    let real = f.v(format!("icmp ne i32 {m}, 0"));
    Taken { real, me, pos, values }
}
