//! The stage-one kernel `flashsample_stage1`: `logitsᵀ = W·Hᵀ` for one (vocab tile, batch
//! tile) work item per loop iteration, then the fused epilogue (DESIGN.md steps 2–7).
//!
//! [`emit`] is one `match` over the [`Schedule`]; each schedule's code is one file:
//!
//! | file | what |
//! |---|---|
//! | `simt.rs` | [`Schedule::Simt`]: FMA per thread from global memory |
//! | `ring.rs` | the shared-memory ring both feeds share: `cp.async` or TMA, wait-full / release / refill, phases |
//! | `mma_sync.rs` | [`Schedule::MmaSync`]: `ldmatrix` + `mma.sync` on the `cp.async` ring |
//! | `wgmma.rs` | [`Schedule::Wgmma`] and [`Schedule::WgmmaTma`]: `wgmma` from either ring |
//! | `specialized.rs` | the warp-specialized grids ([`GridKind::PingPong`], [`GridKind::Cooperative`], [`GridKind::CooperativePair`]): a producer warpgroup + two or one consumer sets on the TMA ring |
//! | `epilogue.rs` | steps 2–7 on the accumulators: columns, transform, reduce, select |
//! | `lists.rs` | step 6b: the per-tile top lists |
//!
//! Thread ownership (every schedule): lane = 4·g + t; warp `w` owns vocab rows
//! `[w·32P, (w+1)·32P)` of the tile in `P` blocks of 32; in block `p` the thread owns the quad
//! of tokens `p·32 + 4g + o` (o = 0..4) and the batch columns `8n + 2t + j` (j = 0, 1) of every
//! 8-column n tile. On the tensor path that is the m16n8k16 accumulator layout with the
//! 32 W rows of a block permuted across its two m tiles (ldmatrix takes per-lane row
//! addresses): MMA row `g` of m tile `2p + h` reads W row `4g + 2h`, row `g + 8` reads `4g + 2h + 1`.
//! So each thread needs one Philox call per (quad, column, sample).

mod epilogue;
mod lists;
mod mma_sync;
mod specialized;
mod residual;
mod ring;
mod simt;
mod wgmma;

use crate::config::{GpuConfig, GridKind, Schedule};
use crate::ir::{i32c, Func, Icmp, Ptr, Shared, I32};
use crate::params::arg;
use crate::params::STAGE1;
use crate::ptx;
use flashsample_ir::Pipeline;
use ring::{Feed, Ring};

pub(crate) use epilogue::{model_logit, token_x};
pub(crate) use residual::is_draft_row;
pub(crate) use simt::load_elem;

pub(crate) const NAME: &str = "flashsample_stage1";

/// The kernel's dynamic shared memory (`lib.rs` declares it): the ring, the mbarriers, the
/// epilogue areas.
const SMEM: Ptr<Shared> = Ptr::named("@fs_smem");

/// Per-thread values every part of the kernel uses.
struct Thread {
    /// Thread and warp index within the threads working on one item (the CTA, or with
    /// ping-pong this thread's consumer set).
    tid: I32,
    warp: I32,
    lane: I32,
    g: I32,
    t: I32,
    /// Byte offset in `@fs_smem` of this thread's epilogue area (scratch, then list tile).
    scratch: I32,
}

/// One work item: its vocab tile index, first vocab row and first batch row.
struct Item {
    vtile: I32,
    vtiles: I32,
    v0: I32,
    b0: I32,
    /// This CTA's count of items before this one (0, 1, ...): the TMA ring numbers slices
    /// across items, `seq · ktiles + kt`, for its mbarrier phases.
    seq: I32,
}

/// The kernel-wide values of the grid: work items, this CTA's first, and the stride.
struct Items {
    vtiles: I32,
    btiles: I32,
    count: I32,
    first: I32,
    stride: I32,
}

impl Item {
    /// The first of `row`'s `per_tile` slots for this item's vocab tile in a per-(row, tile)
    /// list (`lists`, `list_raws`, `residual_lists`): `(row · vtiles + vtile) · per_tile`.
    fn first_slot(&self, f: &mut Func, row: &I32, per_tile: u32) -> I32 {
        let s = f.mul(row, &self.vtiles);
        let s = f.add(&s, &self.vtile);
        f.mul(&s, &i32c(per_tile))
    }
}

impl Items {
    /// Item `item`'s tiles. Batch tiles vary fastest, so the CTAs sharing a W tile run
    /// together and W is read from HBM about once (the others hit L2).
    fn item(&self, g: &Gen<'_>, f: &mut Func, item: &I32) -> Item {
        let (vt, bt) = (g.c.vocab_tile, g.c.batch_tile);
        let btile = f.urem(item, &self.btiles);
        let vtile = f.udiv(item, &self.btiles);
        let v0 = f.mul(&vtile, &i32c(vt));
        let b0 = f.mul(&btile, &i32c(bt));
        let done = f.sub(item, &self.first);
        let seq = f.udiv(&done, &self.stride);
        Item { vtile, vtiles: self.vtiles.clone(), v0, b0, seq }
    }
}

/// The kernel being generated: pipeline, config and the tile's shape per thread.
struct Gen<'a> {
    p: &'a Pipeline,
    c: &'a GpuConfig,
    /// 32-row blocks per warp (quads per thread).
    quads: u32,
    /// 8-column n tiles per CTA.
    ntiles: u32,
    /// Whether the epilogue computes and stores the logsumexp partials (DESIGN.md step 7):
    /// the pipeline needs them and the caller did not ask to skip them.
    lse: bool,
}

impl Gen<'_> {
    /// Index of the accumulator for (quad p, token o, n tile n, column j).
    fn acc_index(&self, p: u32, o: u32, n: u32, j: u32) -> usize {
        (((p * 4 + o) * self.ntiles + n) * 2 + j) as usize
    }

    fn acc_count(&self) -> usize {
        (self.quads * 4 * self.ntiles * 2) as usize
    }

    fn warp_rows(&self) -> u32 {
        self.c.vocab_tile / self.c.warps
    }
}

/// Which multiply a ring schedule runs on its slices.
#[derive(Clone, Copy)]
enum Mma {
    MmaSync,
    Wgmma,
}

/// The stage-one kernel; `lse`: with the logsumexp partials.
pub(crate) fn emit(p: &Pipeline, c: &GpuConfig, lse: bool) -> String {
    let g = Gen { p, c, quads: c.quads_per_thread(), ntiles: c.batch_tile / 8, lse };
    let mut f = Func::new();
    let tid = f.sreg("tid.x");
    let ptx::MmaLane { warp, lane, g: lg, t: lt } = ptx::MmaLane::of(&mut f, &tid);
    let th = Thread { tid, warp, lane, g: lg, t: lt, scratch: i32c(c.smem_layout().epilogue) };

    let vt = c.vocab_tile;
    let bt = c.batch_tile;
    let vt_up = f.add(&arg::VOCAB, &i32c(vt - 1));
    let vtiles = f.udiv(&vt_up, &i32c(vt));
    let bt_up = f.add(&arg::BATCH, &i32c(bt - 1));
    let btiles = f.udiv(&bt_up, &i32c(bt));
    // A cluster's CTAs take consecutive items of one vocab tile: the batch tiles are padded to
    // a multiple of the cluster (`GpuConfig::grid_batch_tiles`; a padding tile writes nothing).
    let btiles = match c.cluster_ctas() {
        1 => btiles,
        n => {
            let up = f.add(&btiles, &i32c(n - 1));
            f.and(&up, &i32c(!(n - 1)))
        }
    };
    let count = f.mul(&vtiles, &btiles);
    // Non-persistent grids are (tiles, batch tiles): one item per CTA, numbered linearly.
    // Persistent grids are (n, 1): CTA i takes items i, i + n, ...
    let cx = f.sreg("ctaid.x");
    let cy = f.sreg("ctaid.y");
    let nx = f.sreg("nctaid.x");
    let ny = f.sreg("nctaid.y");
    let cyx = f.mul(&cy, &nx);
    let first = f.add(&cx, &cyx);
    let stride = f.mul(&nx, &ny);
    if c.stagger_us > 0 {
        g.stagger(&mut f, &first);
    }
    let items = Items { vtiles, btiles, count, first, stride };

    match c.schedule {
        Schedule::Simt { .. } => g.item_loop(&mut f, &th, &items, None),
        Schedule::MmaSync { .. } => {
            let ring = g.ring(&mut f, Feed::CpAsync { wgmma: false });
            g.item_loop(&mut f, &th, &items, Some((&ring, Mma::MmaSync)));
        }
        Schedule::Wgmma { .. } => {
            let ring = g.ring(&mut f, Feed::CpAsync { wgmma: true });
            g.item_loop(&mut f, &th, &items, Some((&ring, Mma::Wgmma)));
        }
        Schedule::WgmmaTma { grid: GridKind::PingPong | GridKind::Cooperative | GridKind::CooperativePair, .. } => {
            let ring = g.ring(&mut f, Feed::Tma { producer_warp: true });
            g.init_mbarriers(&mut f, &th, &ring);
            let clustered = c.cluster_ctas() > 1;
            // The other CTA's barriers exist before its first remote arrival or multicast,
            // and neither CTA exits while the other may still write to its shared memory.
            if clustered {
                ptx::cluster_sync(&mut f);
            }
            g.warp_specialized(&mut f, &th, &ring, &items);
            if clustered {
                ptx::cluster_sync(&mut f);
            }
        }
        Schedule::WgmmaTma { .. } => {
            let ring = g.ring(&mut f, Feed::Tma { producer_warp: false });
            g.init_mbarriers(&mut f, &th, &ring);
            g.item_loop(&mut f, &th, &items, Some((&ring, Mma::Wgmma)));
        }
    }
    f.ret_void();
    g.finish(f)
}

impl Gen<'_> {
    /// The CTA's loop over its work items: mainloop, then epilogue. On a persistent ring the
    /// next item's first slices are issued before this item's epilogue, so they stream in
    /// while it computes (its scratch then sits after the ring).
    fn item_loop(&self, f: &mut Func, th: &Thread, items: &Items, ring: Option<(&Ring, Mma)>) {
        let overlap = self.c.overlaps_epilogue();
        if let (Some((ring, _)), true) = (ring, overlap) {
            let valid = f.icmp(Icmp::Ult, &items.first, &items.count);
            let first = items.item(self, f, &items.first);
            self.prologue(f, th, &first, ring, Some(&valid));
        }
        f.for_loop(&items.first, &items.count, &items.stride, |f, item| {
            let it = items.item(self, f, item);
            let acc = match ring {
                None => self.simt_mainloop(f, th, &it),
                Some((ring, Mma::MmaSync)) => self.mma_sync_mainloop(f, th, &it, ring, !overlap),
                Some((ring, Mma::Wgmma)) => self.wgmma_mainloop(f, th, &it, ring, !overlap),
            };
            if let (Some((ring, _)), true) = (ring, overlap) {
                let next = f.add(item, &items.stride);
                let valid = f.icmp(Icmp::Ult, &next, &items.count);
                let next_it = items.item(self, f, &next);
                self.prologue(f, th, &next_it, ring, Some(&valid));
            }
            self.epilogue(f, th, &it, &acc);
            // The next item's loads overwrite the scratch this item's epilogue read.
            f.barrier();
        });
    }

    /// The kernel's text: `f` as `flashsample_stage1` after the helpers it calls.
    fn finish(&self, f: Func) -> String {
        let (p, c) = (self.p, self.c);
        let mut attrs = format!("\"nvvm.maxntid\"=\"{}\"", c.block_threads());
        if c.is_warp_specialized() {
            // setmaxnreg needs the kernel's register budget fixed up front.
            attrs.push_str(&format!(" \"nvvm.maxnreg\"=\"{}\"", c.specialized_registers().0));
        }
        if c.cluster_ctas() > 1 {
            // `.reqnctapercluster`: a plain launch of the kernel runs in clusters of this size.
            attrs.push_str(&format!(" \"nvvm.cluster_dim\"=\"{},1,1\"", c.cluster_ctas()));
        }
        let mut out = String::new();
        if p.has_penalties() {
            out.push_str(&epilogue::penalize_token());
            out.push('\n');
        }
        if p.has_logit_bias() {
            out.push_str(&epilogue::logit_bias_token());
            out.push('\n');
        }
        out.push_str(&f.finish(&STAGE1.llvm_header(NAME, &attrs)));
        out
    }

    /// [`GpuConfig::stagger_us`]: CTAs `nsmid .. 2·nsmid` (the first wave's second CTA on
    /// each SM, as the block scheduler fills every SM once before doubling up) sleep that
    /// long before their first item. The delay persists: each later CTA takes the slot its
    /// predecessor frees, so co-resident CTAs stay out of phase.
    fn stagger(&self, f: &mut Func, item0: &I32) {
        let nsm = f.sreg("nsmid");
        let second = f.icmp(Icmp::Uge, item0, &nsm);
        let nsm2 = f.shl(&nsm, &i32c(1));
        let first_wave = f.icmp(Icmp::Ult, item0, &nsm2);
        let go = f.and(&second, &first_wave);
        let ns = u64::from(self.c.stagger_us) * 1000;
        f.if_then(&go, |f| ptx::sleep_ns(f, ns));
    }
}
