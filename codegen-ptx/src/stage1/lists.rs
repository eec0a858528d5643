//! DESIGN.md step 6b: each (row, vocab tile)'s `list_per_tile` best tokens by transformed
//! logit, selected in registers by warp-wide rounds, written as `abi::Scored` lists.

use super::{Gen, Item, Thread, SMEM};
use crate::entries::{Scored, SCORED_BYTES, SCORED_INDEX};
use crate::ir::{i32c, Atomic, Func, Global, Icmp, Int, Ptr, Shared, Var, F32, I1, I32, I64, X4};
use crate::params::arg;
use flashsample_abi::INDEX_NONE;

impl Gen<'_> {
    /// DESIGN.md step 6b: the tile's transformed logits go to shared memory (column-major:
    /// `vocab_tile` floats per batch column, after the scratch), then one warp per row selects
    /// the row's `list_per_tile` best in registers: lane `l` holds the `E = vocab_tile / 32`
    /// consecutive tokens `l·E ..`, as order keys ([`Func::order_key`]: 0 for tokens that are
    /// not eligible) sorted into a [`LaneQueue`]. A round is one `redux.sync.max` over the
    /// lanes' queue heads; the lowest lane holding that key (ballot) owns the lowest such index
    /// (lanes hold ascending index ranges, a queue orders equal keys by position), pops its
    /// head, reads the token's `x` back from the tile and writes list entry `k` itself. A round
    /// whose max is 0 (nothing eligible left) writes `Scored::EMPTY` from lane 0. So the list
    /// is sorted by x descending, ties to the lower index, with no shared-memory traffic or
    /// shuffle chains per round; a warp runs `rows` rows side by side so their rounds'
    /// latencies overlap (they were latency-bound one row at a time).
    ///
    /// `kind` says which lists `x` fills ([`ListKind`]).
    pub(super) fn list_epilogue(&self, f: &mut Func, th: &Thread, it: &Item, x: &[F32], kind: ListKind) {
        let c = self.c;
        let (dest, capture, bound_groups) = match kind {
            ListKind::Processed => (&arg::LISTS, crate::nucleus::captures_logits(self.p), crate::list_bound_groups(self.p, c)),
            ListKind::Raw => (&arg::RAW_LISTS, false, None),
        };
        let base = self.write_list_tile(f, th, x);
        if let Some(groups) = bound_groups {
            self.stage_list_bounds(f, th, it, groups);
        }
        f.barrier();
        let lists_ok = f.non_null(dest);
        let lane_first = f.mul(&th.lane, &i32c(c.vocab_tile / 32));
        let bounds = bound_groups.map(|groups| StagedBounds { at: f.add(&th.scratch, &i32c(c.smem_layout().list_bounds)), groups });
        let sel = ListSelection { it, th, base: &base, dest, lists_ok: &lists_ok, lane_first: &lane_first, bounds };
        // Warp `w` holds columns `w + k · warps` and selects each live one's list (a row with
        // nothing at or above its bound ends after one round).
        // The warp's columns inside the tile and the batch: `w + k · warps < lim` (none in a
        // cooperative pair's padding tile, whose rows start past the batch).
        let in_batch = f.sub(&arg::BATCH, &it.b0);
        let has_rows = f.icmp(Icmp::Ult, &it.b0, &arg::BATCH);
        let in_batch = f.sel(&has_rows, &in_batch, &i32c(0));
        let lim = f.umin(&in_batch, &i32c(c.batch_tile));
        let past = f.add(&lim, &i32c(c.warps - 1));
        let past = f.sub(&past, &th.warp);
        let live = f.udiv(&past, &i32c(c.warps));
        self.select_live_rows(f, &sel, &live, capture);
    }

    /// This warp's column `k` (`warp + k · warps`).
    fn warp_column(&self, f: &mut Func, th: &Thread, k: &I32) -> I32 {
        let k = f.mul(k, &i32c(self.c.warps));
        f.add(&th.warp, &k)
    }

    /// Lane `l` stores `Scored::EMPTY` at list slots `slot0 + k` for `k = from + l, from + l +
    /// 32, ..` below `list_per_tile`.
    fn store_empty_entries(&self, f: &mut Func, th: &Thread, dest: &Ptr<Global>, slot0: &I32, from: &I32) {
        let none = i32c(INDEX_NONE as i32);
        let k0 = f.add(from, &th.lane);
        f.for_loop(&k0, &i32c(self.c.list_per_tile), &i32c(32), |f, k| {
            let slot = f.add(slot0, k);
            let s64 = f.zext(&slot);
            let a = f.gaddr(dest, &s64, SCORED_BYTES);
            Scored { logit: F32::NEG_INF, index: none.clone() }.store(f, &a);
        });
    }

    /// The lists of this warp's first `live` columns (`k < live`: column `warp + k · warps`),
    /// `rows` at a time, and their nucleus capture (`capture`). Each row's lane `l` holds the keys of
    /// its tokens `l·E ..` ([`Func::order_key`], 0 for a token that is not eligible or is
    /// below the row's list bound) sorted into a [`LaneQueue`]; a round is one
    /// `redux.sync.max` over the lanes' heads, whose lowest holder pops it, reads the token's
    /// `x` back from the tile and writes list entry `k`. Rounds stop once every row of the group has found its queue empty (the
    /// first empty round writes its entry empty, the entries after it are written empty after
    /// the rounds) or the lists are full. Each row then publishes its list's best key to its
    /// list bound group (`vtile mod G`).
    fn select_live_rows(&self, f: &mut Func, sel: &ListSelection<'_>, live: &I32, capture: bool) {
        let (c, th, it) = (self.c, sel.th, sel.it);
        let none = i32c(INDEX_NONE as i32);
        let rows = self.group_rows(4);
        let next_k = f.var(&i32c(0));
        f.while_loop(
            |f| {
                let k = f.get(&next_k);
                f.icmp(Icmp::Ult, &k, live)
            },
            |f| {
                // Per row of the group: its queue, where its tokens' x sit in the tile, the
                // list slot, whether it is a row (the mask may run out first), the row.
                let mut queues: Vec<LaneQueue> = Vec::new();
                let mut lane_offs = Vec::new();
                let mut slot0s = Vec::new();
                let mut oks = Vec::new();
                let mut group_rows = Vec::new();
                let k0 = f.get(&next_k);
                let after = f.add(&k0, &i32c(rows));
                f.set(&next_k, &after);
                for r in 0..rows {
                    let k = f.add(&k0, &i32c(r));
                    let ok = f.icmp(Icmp::Ult, &k, live);
                    // Past the live columns the group reads column 0 again, as a row with no keys.
                    let k = f.sel(&ok, &k, &i32c(0));
                    let col = self.warp_column(f, th, &k);
                    let TileColumn { inside, lane_off, vals, .. } = self.tile_column_at(f, sel.base, &col, sel.lane_first);
                    let row = f.add(&it.b0, &col);
                    if capture {
                        self.capture_column(f, it, &th.lane, &row, &ok, sel.lane_first, &vals);
                    }
                    // Without the lists parameter a row is captured and lists nothing.
                    let ok = f.and(&ok, sel.lists_ok);
                    let floor = sel.floor(f, &col, &inside);
                    // Tokens below the row's list bound cannot be among the tokens stage
                    // three merges: they leave the queue (key 0, as an ineligible token's).
                    let keys: Vec<I32> = vals
                        .iter()
                        .map(|v| {
                            let key = f.order_key(v);
                            let keep = f.icmp(Icmp::Uge, &key, &floor);
                            let keep = f.and(&keep, &ok);
                            f.sel(&keep, &key, &i32c(0))
                        })
                        .collect();
                    queues.push(LaneQueue::sorted(f, &keys));
                    lane_offs.push(lane_off);
                    slot0s.push(it.first_slot(f, &row, c.list_per_tile));
                    oks.push(ok);
                    group_rows.push(row);
                }
                let k = f.var(&i32c(0));
                let going = f.var(&I1::TRUE);
                let firsts: Vec<Var<I32>> = (0..rows).map(|_| f.var(&i32c(0))).collect();
                f.while_loop(
                    |f| {
                        let kv = f.get(&k);
                        let more = f.icmp(Icmp::Ult, &kv, &i32c(c.list_per_tile));
                        let g = f.get(&going);
                        f.and(&more, &g)
                    },
                    |f| {
                        let kv = f.get(&k);
                        let first_round = f.icmp(Icmp::Eq, &kv, &i32c(0));
                        // All rows' reductions first (straight-line, so they interleave), then
                        // the stores (each a branch).
                        let mut writes = Vec::new();
                        let mut any = I1::FALSE;
                        for (r, queue) in queues.iter().enumerate() {
                            let Popped { real, me, pos, key } = queue.pop(f, &th.lane);
                            let idx = f.add(sel.lane_first, &pos);
                            let idx = f.add(&it.v0, &idx);
                            let index = f.sel(&real, &idx, &none);
                            let w = f.and(&me, &oks[r]);
                            // An empty round's position is not a token: read position 0 instead.
                            let at = f.sel(&real, &pos, &i32c(0));
                            any = f.or(&any, &real);
                            let best = f.get(&firsts[r]);
                            let best = f.sel(&first_round, &key, &best);
                            f.set(&firsts[r], &best);
                            writes.push((w, real, at, index));
                        }
                        for (r, (w, real, at, index)) in writes.into_iter().enumerate() {
                            f.if_then(&w, |f| {
                                // The token's x as stored in the tile, bit for bit (its key
                                // cannot tell -0 from +0).
                                let o = f.shl(&at, &i32c(2));
                                let o = f.add(&lane_offs[r], &o);
                                let sa = f.saddr(&SMEM, &o);
                                let x: F32 = f.load(&sa, 4);
                                let logit = f.sel(&real, &x, &F32::NEG_INF);
                                let slot = f.add(&slot0s[r], &kv);
                                let s64 = f.zext(&slot);
                                let a = f.gaddr(sel.dest, &s64, SCORED_BYTES);
                                Scored { logit, index }.store(f, &a);
                            });
                        }
                        f.set(&going, &any);
                        let next = f.add(&kv, &i32c(1));
                        f.set(&k, &next);
                    },
                );
                let done = f.get(&k);
                for r in 0..rows as usize {
                    f.if_then(&oks[r], |f| self.store_empty_entries(f, th, sel.dest, &slot0s[r], &done));
                    if let Some(g) = sel.bounds.as_ref().map(|b| b.groups) {
                        let best = f.get(&firsts[r]);
                        let real = f.icmp(Icmp::Ne, &best, &i32c(0));
                        let lane0 = f.icmp(Icmp::Eq, &th.lane, &i32c(0));
                        let publish = f.and(&real, &lane0);
                        let publish = f.and(&publish, &oks[r]);
                        let has = f.non_null(&arg::LIST_BOUNDS);
                        let publish = f.and(&publish, &has);
                        f.if_then(&publish, |f| {
                            let group = f.urem(&it.vtile, &i32c(g));
                            let at = f.mul(&group_rows[r], &i32c(g));
                            let at = f.add(&at, &group);
                            let at64 = f.zext(&at);
                            let a = f.gaddr(&arg::LIST_BOUNDS, &at64, 4);
                            f.atomic_update(Atomic::Umax, &a, &best, Some(4));
                        });
                    }
                }
            },
        );
    }

    /// The list bound of each of the item's rows (DESIGN.md step 6b: the minimum over the
    /// row's `groups` words of `list_bounds`, 0 while any group is empty or without the
    /// parameter) into the epilogue area's `list_bounds` words. `parts` neighbouring lanes
    /// share a row (the most, up to 32 and half the groups, that leave every row a thread):
    /// each loads every `parts`-th group's word, all before any is combined, and a butterfly
    /// takes the minimum. Called between the list tile's stores and their barrier, which also
    /// orders these.
    fn stage_list_bounds(&self, f: &mut Func, th: &Thread, it: &Item, groups: u32) {
        let c = self.c;
        let threads = c.warps * 32;
        let mut parts = 1;
        while parts < 32 && 2 * parts <= groups && 2 * parts * c.batch_tile <= threads {
            parts *= 2;
        }
        let rows_per_pass = threads / parts;
        let has = f.non_null(&arg::LIST_BOUNDS);
        let at = f.add(&th.scratch, &i32c(c.smem_layout().list_bounds));
        let part = f.and(&th.tid, &i32c(parts - 1));
        let lead = f.icmp(Icmp::Eq, &part, &i32c(0));
        let first_col = f.lshr(&th.tid, &i32c(parts.trailing_zeros()));
        for pass in 0..c.batch_tile.div_ceil(rows_per_pass) {
            let col = f.add(&first_col, &i32c(pass * rows_per_pass));
            let inside = f.icmp(Icmp::Ult, &col, &i32c(c.batch_tile));
            let row = f.add(&it.b0, &col);
            let row_ok = f.icmp(Icmp::Ult, &row, &arg::BATCH);
            let read = f.and(&has, &row_ok);
            let read = f.and(&read, &inside);
            let least = f.var(&i32c(u32::MAX));
            f.if_then(&read, |f| {
                let row_first = f.mul(&row, &i32c(groups));
                let first = f.add(&row_first, &part);
                // Every word is loaded before any is combined: one latency a row.
                let words: Vec<I32> = (0..groups.div_ceil(parts))
                    .map(|j| {
                        let g = f.add(&part, &i32c(j * parts));
                        let real = f.icmp(Icmp::Ult, &g, &i32c(groups));
                        // A lane past the last group reads its row's first word again.
                        let e = f.add(&first, &i32c(j * parts));
                        let e = f.sel(&real, &e, &row_first);
                        let e64: I64 = f.zext(&e);
                        let a = f.gaddr(&arg::LIST_BOUNDS, &e64, 4);
                        crate::ptx::ld_relaxed_gpu(f, &a)
                    })
                    .collect();
                let m = words.iter().fold(i32c(u32::MAX), |m, w| f.umin(&m, w));
                f.set(&least, &m);
            });
            let mut m = f.get(&least);
            let mut x = 1;
            while x < parts {
                let other = f.shfl_xor(&m, x);
                m = f.umin(&m, &other);
                x *= 2;
            }
            let bound = f.sel(&read, &m, &i32c(0));
            let store = f.and(&lead, &inside);
            f.if_then(&store, |f| {
                let o = f.shl(&col, &i32c(2));
                let o = f.add(&at, &o);
                let sa = f.saddr(&SMEM, &o);
                f.store(&bound, &sa, 4);
            });
        }
    }

    /// The nucleus capture (DESIGN.md "Exact nucleus on the device", step 0): where `row` has a
    /// capture slot (`nucleus::capture_slot`), the warp holding its column stores the column's
    /// `x` at `capture[slot · V + v]`, lane by lane `vals` from token `lane_first`: the bits the
    /// nucleus logits kernel would compute, so the row needs no second read of W. The warp's
    /// stores are consecutive (coalesced); a row whose filter cannot outgrow the lists costs
    /// one filter load.
    #[allow(clippy::too_many_arguments)]
    fn capture_column(&self, f: &mut Func, it: &Item, lane: &I32, row: &I32, live: &I1, lane_first: &I32, vals: &[F32]) {
        f.if_then(live, |f| {
            let (kept, slot) = crate::nucleus::capture_slot(f, lane, row);
            f.if_then(&kept, |f| {
                let s64: I64 = f.zext(&slot);
                let v64: I64 = f.zext(&arg::VOCAB);
                let base = f.mul(&s64, &v64);
                let first = f.add(&it.v0, lane_first);
                for (i, x) in vals.iter().enumerate() {
                    let v = f.add(&first, &i32c(i as u32));
                    let v_ok = f.icmp(Icmp::Ult, &v, &arg::VOCAB);
                    f.if_then(&v_ok, |f| {
                        let vv: I64 = f.zext(&v);
                        let e = f.add(&base, &vv);
                        let a = f.gaddr(&arg::CAPTURE, &e, 4);
                        f.store(x, &a, 4);
                    });
                }
            });
        });
    }

    /// Calls `quad` with the shared address of each of the thread's quads in the list tile
    /// (column-major, `vocab_tile` floats per batch column, after the scratch: a quad is 4
    /// consecutive tokens of one column, one 16-byte access) and its `(q, n, j)`; returns the
    /// tile's offset in `@fs_smem`. The one layout ([`Gen::list_tile_addr`]) that
    /// [`Gen::store_list_tile`] writes and [`Gen::list_tile_quad`] reads back.
    fn list_tile_quads(&self, f: &mut Func, th: &Thread, mut quad: impl FnMut(&mut Func, (u32, u32, u32), &Ptr<Shared>)) -> I32 {
        let base = f.add(&th.scratch, &i32c(self.c.smem_layout().list_tile));
        for q in 0..self.quads {
            for n in 0..self.ntiles {
                for j in 0..2 {
                    let a = self.list_tile_addr(f, th, &base, (q, n, j));
                    quad(f, (q, n, j), &a);
                }
            }
        }
        base
    }

    /// Quad `(q, n, j)`'s address in the list tile at `base`: column `8n + 2t + j`, tokens
    /// `warp · warp_rows + 32q + 4g ..`, column-major with `vocab_tile` floats per column.
    /// Written as the thread's own offset plus a constant per `(q, n, j)`, so that every quad's
    /// access is one register and an immediate (a per-quad address computed from `8n + 2t + j`
    /// was hoisted out of the persistent item loop, every one of them held across the
    /// mainloop, and spilled).
    fn list_tile_addr(&self, f: &mut Func, th: &Thread, base: &I32, (q, n, j): (u32, u32, u32)) -> Ptr<Shared> {
        let vt = self.c.vocab_tile;
        let warp_base = f.mul(&th.warp, &i32c(self.warp_rows()));
        let g4 = f.shl(&th.g, &i32c(2));
        let t2 = f.shl(&th.t, &i32c(1));
        let own = f.mul(&t2, &i32c(vt));
        let own = f.add(&own, &warp_base);
        let own = f.add(&own, &g4);
        let own = f.shl(&own, &i32c(2));
        let own = f.add(&own, base);
        let own = crate::ptx::opaque(f, &own);
        let off = f.add(&own, &i32c(((n * 8 + j) * vt + q * 32) * 4));
        f.saddr(&SMEM, &off)
    }

    /// The tile's transformed logits into shared memory ([`Gen::list_tile_quads`]' layout),
    /// for the warps that select lists from it; returns the tile's offset in `@fs_smem`. Ends
    /// with a barrier.
    pub(super) fn store_list_tile(&self, f: &mut Func, th: &Thread, x: &[F32]) -> I32 {
        let base = self.write_list_tile(f, th, x);
        f.barrier();
        base
    }

    /// [`Gen::store_list_tile`] without its barrier.
    fn write_list_tile(&self, f: &mut Func, th: &Thread, x: &[F32]) -> I32 {
        self.list_tile_quads(f, th, |f, (q, n, j), a| {
            let mut vec = X4::UNDEF;
            for o in 0..4 {
                vec = f.insert_lane(&vec, &x[self.acc_index(q, o, n, j)], o);
            }
            f.store(&vec, a, 16);
        })
    }

    /// The shared address of the thread's quad `(q, n, j)` in the list tile
    /// [`Gen::store_list_tile`] wrote (the thread reads back only what it stored, so no
    /// barrier): [`Gen::list_tile_quads`]' layout.
    pub(super) fn list_tile_quad(&self, f: &mut Func, th: &Thread, (q, n, j): (u32, u32, u32)) -> Ptr<Shared> {
        let base = f.add(&th.scratch, &i32c(self.c.smem_layout().list_tile));
        self.list_tile_addr(f, th, &base, (q, n, j))
    }

    /// Step 10: beside each entry of this tile's processed lists (just written, read back
    /// after a barrier) its raw logit at `list_raws[slot]`, read from the tile of `raw` logits
    /// stored in the list area; empty entries are left alone (`abi::raw::raw_logit_of` skips
    /// them). Starts with a barrier: the selection may still read the tile this rewrites.
    pub(super) fn list_raws_epilogue(&self, f: &mut Func, th: &Thread, it: &Item, raw: &[F32]) {
        let c = self.c;
        let (vt, bt, per_tile) = (c.vocab_tile, c.batch_tile, c.list_per_tile);
        f.barrier();
        let base = self.store_list_tile(f, th, raw);
        let has = f.non_null(&arg::LIST_RAWS);
        let lists_ok = f.non_null(&arg::LISTS);
        let has = f.and(&has, &lists_ok);
        f.if_then(&has, |f| {
            let threads = i32c(c.warps * 32);
            f.for_loop(&th.tid, &i32c(bt * per_tile), &threads, |f, e| {
                let col = f.udiv(e, &i32c(per_tile));
                let k = f.urem(e, &i32c(per_tile));
                let row = f.add(&it.b0, &col);
                let row_ok = f.icmp(Icmp::Ult, &row, &arg::BATCH);
                f.if_then(&row_ok, |f| {
                    let slot = it.first_slot(f, &row, per_tile);
                    let slot = f.add(&slot, &k);
                    let s64 = f.zext(&slot);
                    let a = f.gaddr(&arg::LISTS, &s64, SCORED_BYTES);
                    let a1 = f.offset(&a, SCORED_INDEX);
                    // Volatile: other threads wrote the entry before the barrier, and `%lists` is
                    // `noalias`, so nothing else would keep the load after the barrier.
                    let idx: I32 = f.load_volatile(&a1, 4);
                    let real = f.icmp(Icmp::Ne, &idx, &i32c(INDEX_NONE as i32));
                    f.if_then(&real, |f| {
                        let local = f.sub(&idx, &it.v0);
                        let e = f.mul(&col, &i32c(vt));
                        let e = f.add(&e, &local);
                        let off = f.shl(&e, &i32c(2));
                        let off = f.add(&off, &base);
                        let sa = f.saddr(&SMEM, &off);
                        let r: F32 = f.load(&sa, 4);
                        let ra = f.gaddr(&arg::LIST_RAWS, &s64, 4);
                        f.store(&r, &ra, 4);
                    });
                });
            });
        });
    }
}

/// Which lists a [`Gen::list_epilogue`] fills.
#[derive(Clone, Copy)]
pub(super) enum ListKind {
    /// `%lists`, by transformed logit: the nucleus capture rides along where the pipeline
    /// captures logits, and the list bounds where the config reads them
    /// ([`crate::list_bound_groups`]).
    Processed,
    /// `%raw_lists`, keyed by raw logit in the raw mode (DESIGN.md step 10): no capture, no
    /// bounds.
    Raw,
}

/// What [`Gen::list_epilogue`]'s selection reads: the item, the thread, the list tile at
/// `base`, the lists written, the lane's first token, and the staged list bounds (none
/// without list bounds).
struct ListSelection<'a> {
    it: &'a Item,
    th: &'a Thread,
    base: &'a I32,
    dest: &'a Ptr<Global>,
    lists_ok: &'a I1,
    lane_first: &'a I32,
    bounds: Option<StagedBounds>,
}

/// The item's list bounds as [`Gen::stage_list_bounds`] left them: the shared offset of their
/// words (one a batch column), and the groups `G` each tile publishes into.
struct StagedBounds {
    at: I32,
    groups: u32,
}

impl ListSelection<'_> {
    /// The least key a token of column `col` is listed with: its row's staged list bound,
    /// at least 1 (key 0 is a token that is not eligible).
    fn floor(&self, f: &mut Func, col: &I32, inside: &I1) -> I32 {
        match &self.bounds {
            Some(StagedBounds { at, .. }) => {
                let c = f.sel(inside, col, &i32c(0));
                let o = f.shl(&c, &i32c(2));
                let o = f.add(at, &o);
                let sa = f.saddr(&SMEM, &o);
                let b: I32 = f.load(&sa, 4);
                f.umax(&b, &i32c(1))
            }
            None => i32c(1),
        }
    }
}

/// A column of the list tile, as one lane reads it.
pub(super) struct TileColumn {
    /// Whether the column asked for lies in the tile.
    pub inside: I1,
    /// The column read: the one asked for, or the tile's last column past the tile (the reads
    /// stay inside the list tile).
    pub col_rd: I32,
    /// The shared-memory offset of the lane's first token `l·E` of the column read, and its
    /// `E = vocab_tile / 32` consecutive values from there.
    pub lane_off: I32,
    pub vals: Vec<F32>,
}

impl Gen<'_> {
    /// Rows of the list tile a warp selects side by side, at most `max`: at most 16 of a
    /// lane's values per row group in flight (`16 / E` rows), and no more rows than the
    /// batch tile gives each warp.
    pub(super) fn group_rows(&self, max: u32) -> u32 {
        let c = self.c;
        (16 / (c.vocab_tile / 32)).clamp(1, max).min(c.batch_tile.div_ceil(c.warps))
    }

    /// [`TileColumn`] `col0 + r` of the list tile at `base` (shared-memory offset), this lane
    /// reading from token `lane_first`.
    pub(super) fn tile_column(&self, f: &mut Func, base: &I32, col0: &I32, r: u32, lane_first: &I32) -> TileColumn {
        let col = f.add(col0, &i32c(r));
        self.tile_column_at(f, base, &col, lane_first)
    }

    /// [`TileColumn`] `col` of the list tile at `base`: 16-byte loads where `E` is a multiple
    /// of 4.
    pub(super) fn tile_column_at(&self, f: &mut Func, base: &I32, col: &I32, lane_first: &I32) -> TileColumn {
        let (vt, bt) = (self.c.vocab_tile, self.c.batch_tile);
        let per_lane = vt / 32;
        let inside = f.icmp(Icmp::Ult, col, &i32c(bt));
        let col_rd = f.sel(&inside, col, &i32c(bt - 1));
        let e = f.mul(&col_rd, &i32c(vt));
        let e = f.add(&e, lane_first);
        let off = f.shl(&e, &i32c(2));
        let lane_off = f.add(&off, base);
        let mut vals = Vec::new();
        if per_lane.is_multiple_of(4) {
            for v4 in 0..per_lane / 4 {
                let o = f.add(&lane_off, &i32c(v4 * 16));
                let a = f.saddr(&SMEM, &o);
                let vec: X4<F32> = f.load(&a, 16);
                for o in 0..4 {
                    vals.push(f.extract_lane(&vec, o));
                }
            }
        } else {
            for o in 0..per_lane {
                let oo = f.add(&lane_off, &i32c(o * 4));
                let a = f.saddr(&SMEM, &oo);
                vals.push(f.load(&a, 4));
            }
        }
        TileColumn { inside, col_rd, lane_off, vals }
    }
}

/// A lane's selection keys as a queue, best first: entry `i` is the composite
/// `key << 32 | !position` (u64), so composites in descending order are keys in descending
/// order with equal keys by ascending position (the selection's tie rule), and no two are
/// equal. Sorted once by Batcher's odd-even merge sort (19 compare-exchanges for 8 keys), after
/// which a round reads each lane's head instead of scanning every key, and
/// only the popping lane's queue moves.
pub(super) struct LaneQueue {
    entries: Vec<Var<I64>>,
}

/// One [`LaneQueue::pop`] round of a warp.
pub(super) struct Popped {
    /// Whether a key was left (the max is not 0): otherwise the round writes an empty entry.
    pub real: I1,
    /// Whether this lane popped (exactly one lane; lane 0 when none is left).
    pub me: I1,
    /// The popped key's position among this lane's keys (meaningful where `me && real`).
    pub pos: I32,
    /// The popped key (the warp's largest head; 0 when none is left).
    pub key: I32,
}

impl LaneQueue {
    /// The queue of `keys` (position `o` = `keys[o]`), padded with empty entries to a power of
    /// two.
    pub(super) fn sorted(f: &mut Func, keys: &[I32]) -> LaneQueue {
        let n = keys.len().next_power_of_two();
        let mut e: Vec<I64> = (0..n)
            .map(|o| match keys.get(o) {
                Some(k) => {
                    let k64: I64 = f.zext(k);
                    let hi = f.shl(&k64, &I64::c(32));
                    f.or(&hi, &I64::c(!(o as u32)))
                }
                None => I64::c(0),
            })
            .collect();
        for (a, b) in merge_sort_network(n) {
            let swap = f.icmp(Icmp::Ugt, &e[b], &e[a]);
            let hi = f.sel(&swap, &e[b], &e[a]);
            let lo = f.sel(&swap, &e[a], &e[b]);
            e[a] = hi;
            e[b] = lo;
        }
        LaneQueue { entries: e.iter().map(|v| f.var(v)).collect() }
    }

    /// One round over the warp's queues (every lane takes part): the warp's largest head key
    /// (`redux.sync.max`), popped by the lowest lane holding it (ballot).
    pub(super) fn pop(&self, f: &mut Func, lane: &I32) -> Popped {
        let head = f.get(&self.entries[0]);
        let hi = f.lshr(&head, &I64::c(32));
        let key: I32 = f.trunc(&hi);
        let m = f.redux_umax(&key);
        let mine = f.icmp(Icmp::Eq, &key, &m);
        let ball = f.ballot(&mine);
        // Never 0: the lane holding the max votes.
        let low: I32 = f.call("@llvm.cttz.i32", &[&ball, &I1::TRUE]);
        let me = f.icmp(Icmp::Eq, lane, &low);
        let lo: I32 = f.trunc(&head);
        let pos = f.not(&lo);
        let cur: Vec<I64> = self.entries.iter().map(|v| f.get(v)).collect();
        for (i, v) in self.entries.iter().enumerate() {
            let next = cur.get(i + 1).cloned().unwrap_or(I64::c(0));
            let moved = f.sel(&me, &next, &cur[i]);
            f.set(v, &moved);
        }
        // m == 0: every lane's head is empty, the ballot is full and lane 0 pops.
        let real = f.icmp(Icmp::Ne, &m, &i32c(0));
        Popped { real, me, pos, key: m }
    }
}

/// Batcher's odd-even merge sort of `n` (a power of two) slots as compare-exchange pairs
/// `(a, b)`, `a < b`: after each, slot `a` holds the larger.
fn merge_sort_network(n: usize) -> Vec<(usize, usize)> {
    let mut pairs = Vec::new();
    let mut p = 1;
    while p < n {
        let mut k = p;
        while k >= 1 {
            let mut j = k % p;
            while j + k < n {
                for i in 0..k.min(n - j - k) {
                    if (i + j) / (2 * p) == (i + j + k) / (2 * p) {
                        pairs.push((i + j, i + j + k));
                    }
                }
                j += 2 * k;
            }
            k /= 2;
        }
        p *= 2;
    }
    pairs
}

/// `values[pos]` by a chain of selects (`values[0]` for a `pos` past them): a lane's
/// register payload at a position known only at run time.
pub(super) fn select_at(f: &mut Func, pos: &I32, values: &[F32]) -> F32 {
    let mut v = values[0].clone();
    for (o, value) in values.iter().enumerate().skip(1) {
        let hit = f.icmp(Icmp::Eq, pos, &i32c(o as u32));
        v = f.sel(&hit, value, &v);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::merge_sort_network;

    /// The network sorts every 0/1 input (so, by the 0-1 principle, every input), with 19
    /// compare-exchanges for 8 slots.
    #[test]
    fn merge_sort_network_sorts_every_zero_one_input() {
        for n in [1usize, 2, 4, 8, 16] {
            let net = merge_sort_network(n);
            for bits in 0u32..(1 << n) {
                let mut v: Vec<u32> = (0..n).map(|i| (bits >> i) & 1).collect();
                for &(a, b) in &net {
                    if v[b] > v[a] {
                        v.swap(a, b);
                    }
                }
                assert!(v.windows(2).all(|w| w[0] >= w[1]), "n {n}, input {bits:b}: {v:?}");
            }
        }
        assert_eq!(merge_sort_network(8).len(), 19);
    }
}
