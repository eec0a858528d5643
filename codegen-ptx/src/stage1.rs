//! The stage-one kernel `flashsample_stage1`: `logitsᵀ = W·Hᵀ` for one (vocab tile, batch
//! tile) work item per loop iteration, then the fused epilogue (DESIGN.md steps 2–7).
//!
//! Thread ownership (both paths): lane = 4·g + t; warp `w` owns vocab rows
//! `[w·32P, (w+1)·32P)` of the tile in `P` blocks of 32; in block `p` the thread owns the quad
//! of tokens `p·32 + 4g + o` (o = 0..4) and the batch columns `8n + 2t + j` (j = 0, 1) of every
//! 8-column n tile. On the tensor path that is the m16n8k16 accumulator layout with the
//! 32 W rows of a block permuted across its two m tiles (ldmatrix takes per-lane row
//! addresses): MMA row `g` of m tile `2p + h` reads W row `4g + 2h`, row `g + 8` reads `4g + 2h + 1`.
//! So each thread needs one Philox call per (quad, column, sample).

use crate::config::{GpuConfig, Schedule};
use crate::ir::{f32c, Func, Var, NEG_INF};
use flashsample_abi::{INDEX_NONE, INDEX_NONFINITE};
use flashsample_ir::{DType, Pipeline, Transform};

pub(crate) const NAME: &str = "flashsample_stage1";


/// Per-thread values every part of the kernel uses.
struct Thread {
    /// Thread and warp index within the threads working on one item (the CTA, or with
    /// `pingpong` this thread's consumer set).
    tid: String,
    warp: String,
    lane: String,
    g: String,
    t: String,
    /// Byte offset in `@fs_smem` of this thread's epilogue area (scratch, then list tile).
    scratch: String,
}

/// Kernel-wide values of the tensor path's `cp.async` ring.
struct Ring {
    /// Shared-window address of `@fs_smem` (i32: shared addresses fit 32 bits, which saves
    /// the 64-bit adds and registers of every cp.async and ldmatrix address).
    smem: String,
    /// k slices of `k_step` per item.
    ktiles: String,
    /// Whether both operands allow 16-byte `cp.async` chunks.
    aligned: String,
}

/// An inline-asm statement whose f32 results are `tied` (read and written in place, PTX
/// `+f`) after the plain `inputs` (constraint, value).
fn asm_floats(f: &mut Func, insn: &str, inputs: &[(&str, &str)], tied: &[String]) -> Vec<String> {
    let n = tied.len();
    let ty = format!("{{ {} }}", vec!["float"; n].join(", "));
    let mut cons: Vec<String> = (0..n).map(|_| "=f".to_string()).collect();
    cons.extend(inputs.iter().map(|(c, _)| c.to_string()));
    cons.extend((0..n).map(|i| i.to_string()));
    let ty_of = |c: &str| match c {
        "l" => "i64",
        "r" => "i32",
        _ => "float",
    };
    let mut args: Vec<String> = inputs.iter().map(|(c, v)| format!("{} {v}", ty_of(c))).collect();
    args.extend(tied.iter().map(|v| format!("float {v}")));
    let r = f.v(format!(
        "call {ty} asm sideeffect \"{insn}\", \"{},~{{memory}}\"({}) #1",
        cons.join(","),
        args.join(", ")
    ));
    (0..n).map(|i| f.v(format!("extractvalue {ty} {r}, {i}"))).collect()
}

/// Waits until at most `pending` of this thread's cp.async groups are in flight.
fn cp_async_wait(f: &mut Func, pending: u32) {
    f.s(format!("call void asm sideeffect \"cp.async.wait_group {pending};\", \"~{{memory}}\"() #1"));
}

/// Blocks until the mbarrier at shared address `bar` has completed the phase of `parity`
/// (`try_wait` may time out and is retried; it acquires what the phase released).
fn mbarrier_wait(f: &mut Func, bar: &str, parity: &str) {
    let done = f.var("i32", "0");
    f.while_loop(
        |f| {
            let d = f.get(&done);
            f.v(format!("icmp eq i32 {d}, 0"))
        },
        |f| {
            let r = f.v(format!(
                "call i32 asm sideeffect \"{{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; selp.u32 $0, 1, 0, p; }}\", \
                 \"=r,r,r,~{{memory}}\"(i32 {bar}, i32 {parity}) #1"
            ));
            f.set(&done, &r);
        },
    );
}

/// One arrival on the mbarrier at shared address `bar` (release: this thread's prior reads
/// of the slot are done before the producer may overwrite it).
fn mbarrier_arrive(f: &mut Func, bar: &str) {
    f.s(format!(
        "call void asm sideeffect \"{{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [$0]; }}\", \"r,~{{memory}}\"(i32 {bar}) #1"
    ));
}

fn commit_group(f: &mut Func) {
    f.s("call void asm sideeffect \"cp.async.commit_group;\", \"~{memory}\"() #1");
}

/// One work item: its vocab tile index, first vocab row and first batch row.
struct Item {
    vtile: String,
    vtiles: String,
    v0: String,
    b0: String,
    /// This CTA's count of items before this one (0, 1, ...): the TMA ring numbers slices
    /// across items, `seq · ktiles + kt`, for its mbarrier phases.
    seq: String,
}

struct Gen<'a> {
    p: &'a Pipeline,
    c: &'a GpuConfig,
    /// 32-row blocks per warp (quads per thread).
    quads: u32,
    /// 8-column n tiles per CTA.
    ntiles: u32,
    /// Whether the epilogue computes and stores the logsumexp partials (DESIGN.md step 7).
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

/// Loads one element of a `dtype` matrix at element index `index64` and widens it to f32.
fn load_elem(f: &mut Func, base: &str, index64: &str, dtype: DType) -> String {
    match dtype {
        DType::F32 => {
            let a = f.gaddr(base, index64, 4);
            f.v(format!("load float, ptr addrspace(1) {a}, align 4"))
        }
        DType::BF16 => {
            let a = f.gaddr(base, index64, 2);
            let h = f.v(format!("load i16, ptr addrspace(1) {a}, align 2"));
            let w = f.v(format!("zext i16 {h} to i32"));
            let s = f.v(format!("shl i32 {w}, 16"));
            f.v(format!("bitcast i32 {s} to float"))
        }
        DType::F16 => {
            let a = f.gaddr(base, index64, 2);
            let h = f.v(format!("load half, ptr addrspace(1) {a}, align 2"));
            f.v(format!("fpext half {h} to float"))
        }
    }
}

/// Stage one; `lse`: with the logsumexp partials (the pipeline needs them and the caller
/// did not ask to skip them).
pub(crate) fn emit(p: &Pipeline, c: &GpuConfig, lse: bool) -> String {
    let g = Gen {
        p,
        c,
        quads: c.quads_per_thread(),
        ntiles: c.batch_tile / 8,
        lse,
    };
    let mut f = Func::new();
    let tid = f.sreg("tid.x");
    let warp = f.v(format!("lshr i32 {tid}, 5"));
    let lane = f.v(format!("and i32 {tid}, 31"));
    let lg = f.v(format!("lshr i32 {lane}, 2"));
    let lt = f.v(format!("and i32 {lane}, 3"));
    let th = Thread {
        tid,
        warp,
        lane,
        g: lg,
        t: lt,
        scratch: c.smem_layout().epilogue.to_string(),
    };

    let vt = c.vocab_tile;
    let bt = c.batch_tile;
    let vt_up = f.add("%vocab", &(vt - 1).to_string());
    let vtiles = f.v(format!("udiv i32 {vt_up}, {vt}"));
    let bt_up = f.add("%batch", &(bt - 1).to_string());
    let btiles = f.v(format!("udiv i32 {bt_up}, {bt}"));
    let items = f.mul(&vtiles, &btiles);
    // Non-persistent grids are (tiles, batch tiles): one item per CTA, numbered linearly.
    // Persistent grids are (n, 1): CTA i takes items i, i + n, ...
    let cx = f.sreg("ctaid.x");
    let cy = f.sreg("ctaid.y");
    let nx = f.sreg("nctaid.x");
    let ny = f.sreg("nctaid.y");
    let cyx = f.mul(&cy, &nx);
    let item0 = f.add(&cx, &cyx);
    let stride = f.mul(&nx, &ny);
    if c.stagger_us > 0 {
        g.stagger(&mut f, &item0);
    }

    // Batch tiles vary fastest, so the CTAs sharing a W tile run together and W is read
    // from HBM about once (the others hit L2).
    let item_of = |f: &mut Func, item: &str| {
        let btile = f.v(format!("urem i32 {item}, {btiles}"));
        let vtile = f.v(format!("udiv i32 {item}, {btiles}"));
        let v0 = f.mul(&vtile, &vt.to_string());
        let b0 = f.mul(&btile, &bt.to_string());
        let done = f.v(format!("sub i32 {item}, {item0}"));
        let seq = f.v(format!("udiv i32 {done}, {stride}"));
        Item {
            vtile,
            vtiles: vtiles.clone(),
            v0,
            b0,
            seq,
        }
    };
    let ring = c.is_tensor().then(|| g.ring(&mut f));
    if let (Some(ring), true) = (&ring, c.uses_tma()) {
        g.init_mbarriers(&mut f, &th, ring);
    }
    if let (Some(ring), true) = (&ring, c.is_pingpong()) {
        g.pingpong(&mut f, &th, ring, &item0, &items, &stride, &item_of);
        f.s("ret void");
        return g.finish(f);
    }
    let overlap = c.overlaps_epilogue();
    if let (Some(ring), true) = (&ring, overlap) {
        let valid = f.ult(&item0, &items);
        let first = item_of(&mut f, &item0);
        g.prologue(&mut f, &th, &first, ring, Some(&valid));
    }
    f.for_loop(&item0, &items, &stride, |f, item| {
        let it = item_of(f, item);
        let acc = match &ring {
            Some(ring) if c.uses_wgmma() => g.wgmma_mainloop(f, &th, &it, ring, !overlap),
            Some(ring) => g.tensor_mainloop(f, &th, &it, ring, !overlap),
            None => g.simt_mainloop(f, &th, &it),
        };
        if let (Some(ring), true) = (&ring, overlap) {
            // The next item's first slices stream in while this item's epilogue computes.
            let next = f.add(item, &stride);
            let valid = f.ult(&next, &items);
            let next_it = item_of(f, &next);
            g.prologue(f, &th, &next_it, ring, Some(&valid));
        }
        g.epilogue(f, &th, &it, &acc);
        // The next item's loads overwrite the scratch this item's epilogue read.
        f.barrier();
    });
    f.s("ret void");
    g.finish(f)
}

impl Gen<'_> {
    /// The kernel's text: `f` as `flashsample_stage1`, after the helpers it calls.
    fn finish(&self, f: Func) -> String {
        let (p, c) = (self.p, self.c);
        let header = format!(
            "define ptx_kernel void @{NAME}(ptr addrspace(1) noalias readonly %hidden, \
             ptr addrspace(1) noalias readonly %weights, ptr addrspace(1) noalias readonly %temperatures, \
             ptr addrspace(1) noalias readonly %bias, ptr addrspace(1) noalias readonly %allowed, \
             ptr addrspace(1) noalias %candidates, ptr addrspace(1) noalias %lse, i64 %seed, \
             i32 %batch, i32 %dim, i32 %vocab, i32 %vocab_offset, \
             ptr addrspace(1) noalias readonly %row_seeds, ptr addrspace(1) noalias readonly %pen_bits, \
             ptr addrspace(1) noalias readonly %pen_offsets, ptr addrspace(1) noalias readonly %pen_tokens, \
             ptr addrspace(1) noalias readonly %pen_subtract, ptr addrspace(1) noalias readonly %pen_repetition, \
             ptr addrspace(1) noalias %lists, ptr addrspace(1) noalias readonly %tmaps) \"nvvm.maxntid\"=\"{}\"{}",
            c.block_threads(),
            // setmaxnreg needs the kernel's register budget fixed up front.
            if c.is_pingpong() { format!(" \"nvvm.maxnreg\"=\"{}\"", c.pingpong_registers().0) } else { String::new() }
        );
        let mut out = String::new();
        if p.has_penalties() {
            out.push_str(&penalize_token());
            out.push('\n');
        }
        out.push_str(&f.finish(&header));
        out
    }

    /// [`GpuConfig::pingpong`]: warps `2·warps ..` are the producer warpgroup (lane 0 of its first
    /// warp streams every slice of the CTA's items through [`Gen::tma_issue`], gated by the empty
    /// mbarriers; the group gives its registers to the consumers, `setmaxnreg`); consumer set
    /// `s` (warps `s·warps ..`) takes the CTA's items `s, s + 2, ...`, each through the TMA
    /// mainloop and the epilogue, with its own scratch and named barrier `1 + s`. Mainloops
    /// take turns (a mainloop-done mbarrier per set, as CUTLASS orders its math warpgroups), so
    /// one set's epilogue runs while the other multiplies the next item, and the producer keeps
    /// the ring full throughout.
    #[allow(clippy::too_many_arguments)]
    fn pingpong(
        &self,
        f: &mut Func,
        th: &Thread,
        ring: &Ring,
        item0: &str,
        items: &str,
        stride: &str,
        item_of: &dyn Fn(&mut Func, &str) -> Item,
    ) {
        let c = self.c;
        let (_, producer_regs, consumer_regs) = c.pingpong_registers();
        let setmaxnreg = |f: &mut Func, op: &str, regs: u32| {
            f.s(format!("call void asm sideeffect \"setmaxnreg.{op}.sync.aligned.u32 {regs};\", \"~{{memory}}\"() #1"));
        };
        let set = f.v(format!("udiv i32 {}, {}", th.warp, c.warps));
        let producer = f.v(format!("icmp eq i32 {set}, 2"));
        f.if_else(
            &producer,
            |f| {
                setmaxnreg(f, "dec", producer_regs);
                let first_warp = f.v(format!("icmp eq i32 {}, {}", th.warp, 2 * c.warps));
                let lane0 = f.v(format!("icmp eq i32 {}, 0", th.lane));
                let issuer = f.and1(&first_warp, &lane0);
                f.if_then(&issuer, |f| {
                    f.for_loop(item0, items, stride, |f, item| {
                        let it = item_of(f, item);
                        f.for_loop("0", &ring.ktiles, "1", |f, kt| self.tma_issue(f, &it, ring, kt));
                    });
                });
            },
            |f| {
                setmaxnreg(f, "inc", consumer_regs);
                let threads = c.consumer_threads();
                let tid0 = f.mul(&set, &threads.to_string());
                let warp0 = f.mul(&set, &c.warps.to_string());
                let area = f.mul(&set, &c.smem_layout().epilogue_bytes.to_string());
                let local = Thread {
                    tid: f.v(format!("sub i32 {}, {tid0}", th.tid)),
                    warp: f.v(format!("sub i32 {}, {warp0}", th.warp)),
                    lane: th.lane.clone(),
                    g: th.g.clone(),
                    t: th.t.clone(),
                    scratch: f.add(&th.scratch, &area),
                };
                let id = f.add(&set, "1");
                let first = f.mul(&set, stride);
                let first = f.add(item0, &first);
                let step = f.v(format!("shl i32 {stride}, 1"));
                let other = f.v(format!("xor i32 {set}, 1"));
                let other_done = self.mainloop_done(f, ring, &other);
                let my_done = self.mainloop_done(f, ring, &set);
                let lane0 = f.v(format!("icmp eq i32 {}, 0", th.lane));
                f.with_barrier_scope(&id, threads, |f| {
                    f.for_loop(&first, items, &step, |f, item| {
                        let it = item_of(f, item);
                        // Mainloops run in item order: item q waits for the end of item
                        // q − 1's (the other set's mainloop number (q − 1) / 2). A slot's full
                        // barrier then has completed every earlier round, so its parity names
                        // this item's round and not one `stages` slices back.
                        let started = f.v(format!("icmp ugt i32 {}, 0", it.seq));
                        f.if_then(&started, |f| {
                            let prev = f.v(format!("add i32 {}, -1", it.seq));
                            let m = f.v(format!("lshr i32 {prev}, 1"));
                            let parity = f.v(format!("and i32 {m}, 1"));
                            mbarrier_wait(f, &other_done, &parity);
                        });
                        let acc = self.wgmma_mainloop(f, &local, &it, ring, false);
                        f.if_then(&lane0, |f| mbarrier_arrive(f, &my_done));
                        self.epilogue(f, &local, &it, &acc);
                        // The set's next epilogue rewrites the scratch this one read.
                        f.barrier();
                    });
                });
            },
        );
    }
}

/// DESIGN.md step 3, penalties, for a token whose bit is set: binary search of `v` in the
/// row's sorted `tokens[lo..hi]`, then `abi::penalize_f32` with that entry's subtraction.
/// Out of line (rarely taken, and it holds a loop), so the unrolled epilogue stays small.
fn penalize_token() -> String {
    let mut f = Func::new();
    let lo = f.var("i32", "%lo");
    let hi = f.var("i32", "%hi");
    f.while_loop(
        |f| {
            let (l, h) = (f.get(&lo), f.get(&hi));
            f.ult(&l, &h)
        },
        |f| {
            let (l, h) = (f.get(&lo), f.get(&hi));
            let sum = f.add(&l, &h);
            let mid = f.v(format!("lshr i32 {sum}, 1"));
            let m64 = f.zext64(&mid);
            let a = f.gaddr("%tokens", &m64, 4);
            let t = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
            let less = f.ult(&t, "%v");
            let up = f.add(&mid, "1");
            let nl = f.sel("i32", &less, &up, &l);
            let nh = f.sel("i32", &less, &h, &mid);
            f.set(&lo, &nl);
            f.set(&hi, &nh);
        },
    );
    let at = f.get(&lo);
    let inside = f.ult(&at, "%hi");
    // Never read past the row's entries (the bitset says `v` is listed, but stay safe).
    let safe = f.sel("i32", &inside, &at, "%lo");
    let s64 = f.zext64(&safe);
    let a = f.gaddr("%tokens", &s64, 4);
    let t = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
    let hit = f.v(format!("icmp eq i32 {t}, %v"));
    let found = f.and1(&inside, &hit);
    let a = f.gaddr("%subtract", &s64, 4);
    let sub = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
    let pos = f.v("fcmp ogt float %x, 0.0");
    let q = f.fdiv("%x", "%rep");
    let m = f.fmul("%x", "%rep");
    let y = f.sel("float", &pos, &q, &m);
    let y = f.fsub(&y, &sub);
    let r = f.sel("float", &found, &y, "%x");
    f.s(format!("ret float {r}"));
    f.finish(
        "define internal float @fs_penalize_token(float %x, i32 %v, i32 %lo, i32 %hi, \
         ptr addrspace(1) %tokens, ptr addrspace(1) %subtract, float %rep) #2",
    )
}

impl Gen<'_> {
    /// SIMT: each thread accumulates its own (token, column) pairs straight from global
    /// memory (L1-cached), any dtypes, any D.
    fn simt_mainloop(&self, f: &mut Func, th: &Thread, it: &Item) -> Vec<String> {
        let acc: Vec<Var> = (0..self.acc_count())
            .map(|_| f.var("float", "0.0"))
            .collect();
        let dim64 = f.zext64("%dim");
        let warp_base = f.mul(&th.warp, &self.warp_rows().to_string());
        let g4 = f.v(format!("shl i32 {}, 2", th.g));
        let mut w_rows = Vec::new();
        for p in 0..self.quads {
            for o in 0..4 {
                let v = f.add(&it.v0, &warp_base);
                let v = f.add(&v, &(p * 32 + o).to_string());
                let v = f.add(&v, &g4);
                let ok = f.ult(&v, "%vocab");
                // Out-of-range rows read row 0; their logits are excluded in the epilogue.
                let ve = f.sel("i32", &ok, &v, "0");
                let ve = f.zext64(&ve);
                w_rows.push(f.v(format!("mul i64 {ve}, {dim64}")));
            }
        }
        let t2 = f.v(format!("shl i32 {}, 1", th.t));
        let mut h_rows = Vec::new();
        for n in 0..self.ntiles {
            for j in 0..2 {
                let r = f.add(&it.b0, &(n * 8 + j).to_string());
                let r = f.add(&r, &t2);
                let ok = f.ult(&r, "%batch");
                let re = f.sel("i32", &ok, &r, "0");
                let re = f.zext64(&re);
                h_rows.push(f.v(format!("mul i64 {re}, {dim64}")));
            }
        }
        let (wd, hd) = (self.p.weights.dtype, self.p.hidden.dtype);
        f.for_loop("0", "%dim", "1", |f, k| {
            let k64 = f.zext64(k);
            let w: Vec<String> = w_rows
                .iter()
                .map(|row| {
                    let i = f.v(format!("add i64 {row}, {k64}"));
                    load_elem(f, "%weights", &i, wd)
                })
                .collect();
            let h: Vec<String> = h_rows
                .iter()
                .map(|row| {
                    let i = f.v(format!("add i64 {row}, {k64}"));
                    load_elem(f, "%hidden", &i, hd)
                })
                .collect();
            for p in 0..self.quads {
                for o in 0..4 {
                    for n in 0..self.ntiles {
                        for j in 0..2 {
                            let a = &acc[self.acc_index(p, o, n, j)];
                            let cur = f.get(a);
                            let wv = &w[(p * 4 + o) as usize];
                            let hv = &h[(n * 2 + j) as usize];
                            let nv = f.v(format!(
                                "call float @llvm.fma.f32(float {wv}, float {hv}, float {cur})"
                            ));
                            f.set(a, &nv);
                        }
                    }
                }
            }
        });
        acc.iter().map(|a| f.get(a)).collect()
    }

    /// Tensor cores: a `stages`-deep cp.async ring of (W tile, H tile) k slices in shared
    /// memory, ldmatrix fragments, mma.sync m16n8k16 with f32 accumulators.
    ///
    /// Kernel-wide values of the `cp.async` ring, computed once before the item loop.
    fn ring(&self, f: &mut Func) -> Ring {
        let ks = self.c.k_step();
        let smem = f.v("ptrtoint ptr addrspace(3) @fs_smem to i32");
        let ks_up = f.add("%dim", &(ks - 1).to_string());
        let ktiles = f.v(format!("udiv i32 {ks_up}, {ks}"));
        // cp.async needs 16-byte aligned global chunks: rows of D·2 bytes with D % 8 == 0 and
        // 16-byte aligned bases. Otherwise the same ring is filled by predicated 2-byte loads.
        let d7 = f.v("and i32 %dim, 7");
        let d_ok = f.v(format!("icmp eq i32 {d7}, 0"));
        let hi = f.v("ptrtoint ptr addrspace(1) %hidden to i64");
        let wi = f.v("ptrtoint ptr addrspace(1) %weights to i64");
        let hw = f.v(format!("or i64 {hi}, {wi}"));
        let hw = f.v(format!("and i64 {hw}, 15"));
        let p_ok = f.v(format!("icmp eq i64 {hw}, 0"));
        let aligned = f.and1(&d_ok, &p_ok);
        Ring { smem, ktiles, aligned }
    }

    /// Issues slice `kt` of item `it` into ring slot `slot` (no commit).
    ///
    /// Shared layout of a stage: W tile `vocab_tile` rows then H tile `batch_tile` rows, each
    /// row `k_step` elements (128 or 256 bytes) of 16-byte chunks. Chunk `c` of row `r` is
    /// stored at chunk `c ^ s(r)` with `s(r) = (r >> 2) & 7` for W and `r & 7` for H, so the 8
    /// row addresses of every ldmatrix phase (W rows 4g + const, H rows n..n+7) fall in 8
    /// distinct bank groups.
    fn load_stage(&self, f: &mut Func, th: &Thread, it: &Item, ring: &Ring, kt: &str, slot: &str) {
        let c = self.c;
        let ks = c.k_step();
        let cpr = ks / 8; // 16-byte chunks per row
        let row_bytes = ks * 2;
        let w_tile_bytes = c.vocab_tile * row_bytes;
        let stage_bytes = c.smem_layout().slot_bytes;
        let (smem, aligned) = (&ring.smem, &ring.aligned);
        let kbase = f.mul(kt, &ks.to_string());
        let slot_off = f.mul(slot, &stage_bytes.to_string());
        let chunks = |f: &mut Func, asynchronous: bool| {
            for (is_w, rows, tile_off, base_row, limit, ptr) in [
                (true, c.vocab_tile, 0, &it.v0, "%vocab", "%weights"),
                (
                    false,
                    c.batch_tile,
                    w_tile_bytes,
                    &it.b0,
                    "%batch",
                    "%hidden",
                ),
            ] {
                let n_chunks = rows * cpr;
                let nthr = c.block_threads();
                for u in 0..n_chunks.div_ceil(nthr) {
                    let i = f.add(&th.tid, &(u * nthr).to_string());
                    let body = |f: &mut Func| {
                        let row = f.v(format!("lshr i32 {i}, {}", cpr.trailing_zeros()));
                        let cc = f.v(format!("and i32 {i}, {}", cpr - 1));
                        // wgmma: W row `row` sits at shared row `at` of the warpgroup's
                        // m64 operands, swizzled by the 128-byte mode (`at & 7`).
                        let at = if is_w && c.uses_wgmma() { self.wgmma_smem_row(f, &row) } else { row.clone() };
                        let s = if is_w && !c.uses_wgmma() {
                            f.v(format!("lshr i32 {row}, 2"))
                        } else {
                            at.clone()
                        };
                        let s = f.v(format!("and i32 {s}, 7"));
                        let sw = f.v(format!("xor i32 {cc}, {s}"));
                        let ro = f.mul(&at, &row_bytes.to_string());
                        let so = f.v(format!("shl i32 {sw}, 4"));
                        let dst = f.add(&slot_off, &ro);
                        let dst = f.add(&dst, &so);
                        let dst = f.add(&dst, &tile_off.to_string());
                        let gr = f.add(base_row, &row);
                        let row_ok = f.ult(&gr, limit);
                        let c8 = f.v(format!("shl i32 {cc}, 3"));
                        let k = f.add(&kbase, &c8);
                        let gr64 = f.zext64(&gr);
                        let d64 = f.zext64("%dim");
                        let row_elem = f.v(format!("mul i64 {gr64}, {d64}"));
                        if asynchronous {
                            let k_ok = f.ult(&k, "%dim");
                            let ok = f.and1(&row_ok, &k_ok);
                            // The chunk's row pointer does not depend on the slice, so LLVM
                            // hoists it out of the k loop; a slice adds its byte offset (one
                            // 64-bit add per chunk) and only the final pointer is selected.
                            let c64 = f.zext64(&c8);
                            let e = f.v(format!("add i64 {row_elem}, {c64}"));
                            let row_ptr = f.gaddr(ptr, &e, 2);
                            let kb = f.zext64(&kbase);
                            let kb = f.v(format!("shl i64 {kb}, 1"));
                            let src = f.v(format!("getelementptr i8, ptr addrspace(1) {row_ptr}, i64 {kb}"));
                            let src = f.sel("ptr addrspace(1)", &ok, &src, ptr);
                            let d32 = f.add(smem, &dst);
                            // src-size 0 zero-fills the chunk: rows past V or B, k past D.
                            let size = f.sel("i32", &ok, "16", "0");
                            f.s(format!(
                                "call void asm sideeffect \"cp.async.cg.shared.global [$0], [$1], 16, $2;\", \
                                 \"r,l,r,~{{memory}}\"(i32 {d32}, ptr addrspace(1) {src}, i32 {size}) #1"
                            ));
                        } else {
                            let mut halves = Vec::new();
                            for e in 0..8 {
                                let ke = f.add(&k, &e.to_string());
                                let k_ok = f.ult(&ke, "%dim");
                                let ok = f.and1(&row_ok, &k_ok);
                                let k64 = f.zext64(&ke);
                                let ix = f.v(format!("add i64 {row_elem}, {k64}"));
                                let ix = f.sel("i64", &ok, &ix, "0");
                                let a = f.gaddr(ptr, &ix, 2);
                                let v = f.v(format!("load i16, ptr addrspace(1) {a}, align 2"));
                                let v = f.sel("i16", &ok, &v, "0");
                                halves.push(f.v(format!("zext i16 {v} to i32")));
                            }
                            let mut vec = "undef".to_string();
                            for w in 0..4 {
                                let hi = f.v(format!("shl i32 {}, 16", halves[2 * w + 1]));
                                let word = f.v(format!("or i32 {}, {hi}", halves[2 * w]));
                                vec = f.v(format!(
                                    "insertelement <4 x i32> {vec}, i32 {word}, i32 {w}"
                                ));
                            }
                            let sa = f.saddr("@fs_smem", &dst);
                            f.s(format!(
                                "store <4 x i32> {vec}, ptr addrspace(3) {sa}, align 16"
                            ));
                        }
                    };
                    if (u + 1) * nthr > n_chunks {
                        let inr = f.ult(&i, &n_chunks.to_string());
                        f.if_then(&inr, body);
                    } else {
                        body(f);
                    }
                }
            }
        };
        f.if_else(aligned, |f| chunks(f, true), |f| chunks(f, false));
    }

    /// The first [`GpuConfig::prefetch_depth`] slices of item `it` (only where `valid`, if
    /// given); always commits that many groups, so the group counting stays static.
    fn prologue(&self, f: &mut Func, th: &Thread, it: &Item, ring: &Ring, valid: Option<&str>) {
        if self.c.uses_tma() {
            let t0 = f.v(format!("icmp eq i32 {}, 0", th.tid));
            let go = match valid {
                Some(v) => f.and1(&t0, v),
                None => t0,
            };
            f.if_then(&go, |f| {
                for s in 0..self.c.prefetch_depth() {
                    let in_range = f.ult(&s.to_string(), &ring.ktiles);
                    f.if_then(&in_range, |f| self.tma_issue(f, it, ring, &s.to_string()));
                }
            });
            return;
        }
        for s in 0..self.c.prefetch_depth() {
            let in_range = f.ult(&s.to_string(), &ring.ktiles);
            let go = match valid {
                Some(v) => f.and1(&in_range, v),
                None => in_range,
            };
            f.if_then(&go, |f| self.load_stage(f, th, it, ring, &s.to_string(), &s.to_string()));
            commit_group(f);
        }
    }

    /// [`GpuConfig::stagger_us`]: CTAs `nsmid .. 2·nsmid` (the first wave's second CTA on
    /// each SM, as the block scheduler fills every SM once before doubling up) sleep that
    /// long before their first item. The delay persists: each later CTA takes the slot its
    /// predecessor frees, so co-resident CTAs stay out of phase.
    fn stagger(&self, f: &mut Func, item0: &str) {
        let nsm = f.sreg("nsmid");
        let second = f.v(format!("icmp uge i32 {item0}, {nsm}"));
        let nsm2 = f.v(format!("shl i32 {nsm}, 1"));
        let first_wave = f.ult(item0, &nsm2);
        let go = f.and1(&second, &first_wave);
        let ns = u64::from(self.c.stagger_us) * 1000;
        f.if_then(&go, |f| {
            f.s(format!(
                "call void asm sideeffect \"{{ .reg .u64 t0, t1, d; .reg .pred p; mov.u64 t0, %globaltimer; \
                 FS_STAGGER: nanosleep.u32 256; mov.u64 t1, %globaltimer; sub.u64 d, t1, t0; \
                 setp.lt.u64 p, d, {ns}; @p bra FS_STAGGER; }}\", \"~{{memory}}\"() #1"
            ));
        });
    }

    /// Shared addresses of ring slot `slot`'s full and empty mbarriers.
    fn mbarriers(&self, f: &mut Func, ring: &Ring, slot: &str) -> (String, String) {
        let base = f.add(&ring.smem, &self.c.smem_layout().mbarriers.to_string());
        let s8 = f.v(format!("shl i32 {slot}, 3"));
        let full = f.add(&base, &s8);
        let empty = f.add(&full, &(8 * self.c.stages()).to_string());
        (full, empty)
    }

    /// This warp is done reading (global) slice `j`'s slot: one arrival on its empty barrier.
    fn release_slot(&self, f: &mut Func, ring: &Ring, j: &str) {
        let slot = f.v(format!("urem i32 {j}, {}", self.c.stages()));
        let (_, empty) = self.mbarriers(f, ring, &slot);
        mbarrier_arrive(f, &empty);
    }

    /// With `pingpong`: the mainloop-done mbarrier of consumer set `set` (after the slots').
    fn mainloop_done(&self, f: &mut Func, ring: &Ring, set: &str) -> String {
        let base = f.add(&ring.smem, &(self.c.smem_layout().mbarriers + 16 * self.c.stages()).to_string());
        let s8 = f.v(format!("shl i32 {set}, 3"));
        f.add(&base, &s8)
    }

    /// Thread 0 initialises every slot's mbarriers: full expects the producer's one arrival
    /// (plus the stage's transaction bytes), empty one arrival per warp; with `pingpong` each
    /// set's mainloop-done barrier one arrival per warp of the set.
    fn init_mbarriers(&self, f: &mut Func, th: &Thread, ring: &Ring) {
        let t0 = f.v(format!("icmp eq i32 {}, 0", th.tid));
        f.if_then(&t0, |f| {
            let mut bars = Vec::new();
            for s in 0..self.c.stages() {
                let (full, empty) = self.mbarriers(f, ring, &s.to_string());
                bars.extend([(full, 1), (empty, self.c.warps)]);
            }
            if self.c.is_pingpong() {
                for set in ["0", "1"] {
                    bars.push((self.mainloop_done(f, ring, set), self.c.warps));
                }
            }
            for (bar, count) in bars {
                f.s(format!(
                    "call void asm sideeffect \"mbarrier.init.shared::cta.b64 [$0], $1;\", \"r,r,~{{memory}}\"(i32 {bar}, i32 {count}) #1"
                ));
            }
            f.s("call void asm sideeffect \"fence.mbarrier_init.release.cluster;\", \"~{memory}\"() #1");
        });
        f.barrier();
    }

    /// Producer (thread 0): slice `kt` of item `it` into its ring slot through the TMA, once
    /// the slot's previous slice is released. Slices are numbered across the CTA's items
    /// (`j = seq · ktiles + kt`, slot `j % stages`), so every slot's phases alternate.
    ///
    /// The W tensor map (`%tmaps`, 5-d) views row `r = 32K + 4g + 2h + e` as dims
    /// `(k, g, e, K, h)` (strides 4, 1, 32 and 2 rows: the order of the shared rows, not of
    /// memory). With `vocab_tile = 32 · warps` (one 32-row block per warp), one box
    /// `{64, 8, 2, 4, 2}` at `(k0, 0, 0, v0/32 + 4G, 0)` is warpgroup `G`'s 128 rows, landing
    /// at shared row `g + 8e + 16k + 64h` of its operands: where [`Gen::wgmma_smem_row`] puts
    /// W row `v0 + 32(4G + k) + 4g + 2h + e`. So a slice is one 16 KB box per warpgroup (gen
    /// 9 issued 32 one-atom boxes and was slower than `cp.async`). The H map (2-d, at
    /// `%tmaps + 128`) gives one `{64, batch_tile}` box. Rows past V or B and k past D are
    /// zero-filled by the TMA and still count towards the stage's bytes.
    fn tma_issue(&self, f: &mut Func, it: &Item, ring: &Ring, kt: &str) {
        let c = self.c;
        let j0 = f.mul(&it.seq, &ring.ktiles);
        let j = f.add(&j0, kt);
        let slot = f.v(format!("urem i32 {j}, {}", c.stages()));
        let (full, empty) = self.mbarriers(f, ring, &slot);
        let reuse = f.v(format!("icmp uge i32 {j}, {}", c.stages()));
        f.if_then(&reuse, |f| {
            let round = f.v(format!("udiv i32 {j}, {}", c.stages()));
            let parity = f.v(format!("add i32 {round}, 1"));
            let parity = f.v(format!("and i32 {parity}, 1"));
            mbarrier_wait(f, &empty, &parity);
        });
        f.s(format!(
            "call void asm sideeffect \"{{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [$0], $1; }}\", \
             \"r,r,~{{memory}}\"(i32 {full}, i32 {}) #1",
            c.smem_layout().slot_bytes
        ));
        let slot_off = f.mul(&slot, &c.smem_layout().slot_bytes.to_string());
        let dst0 = f.add(&ring.smem, &slot_off);
        let k0 = f.mul(kt, &c.k_step().to_string());
        let maps = f.v("addrspacecast ptr addrspace(1) %tmaps to ptr");
        let w_map = f.v(format!("ptrtoint ptr {maps} to i64"));
        let h_map = f.v(format!("add i64 {w_map}, 128"));
        let blk0 = f.v(format!("lshr i32 {}, 5", it.v0));
        for grp in 0..c.warps / 4 {
            let blk = f.add(&blk0, &(4 * grp).to_string());
            let dst = f.add(&dst0, &(grp * 128 * 128).to_string());
            f.s(format!(
                "call void asm sideeffect \"cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes \
                 [$0], [$1, {{$2, 0, 0, $3, 0}}], [$4];\", \"r,l,r,r,r,~{{memory}}\"\
                 (i32 {dst}, i64 {w_map}, i32 {k0}, i32 {blk}, i32 {full}) #1"
            ));
        }
        let dst = f.add(&dst0, &(c.vocab_tile * 128).to_string());
        f.s(format!(
            "call void asm sideeffect \"cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes \
             [$0], [$1, {{$2, $3}}], [$4];\", \"r,l,r,r,r,~{{memory}}\"\
             (i32 {dst}, i64 {h_map}, i32 {k0}, i32 {}, i32 {full}) #1",
            it.b0
        ));
    }

    /// The shared-memory row (of a stage's W tile) that holds W tile row `r` on the wgmma
    /// path, so that wgmma's accumulator layout is the mma.sync path's (module doc).
    ///
    /// Warpgroup `G` (warps `4G..4G+4`) multiplies `2·quads` m64 operands of 64 rows each,
    /// the `mt`-th at shared rows `(G·2·quads + mt)·64`; in one, warp `k` of the group gets
    /// accumulator rows `16k + g` and `16k + g + 8`, which must hold the W rows the mma.sync
    /// path gives m tile `mt` of warp `4G + k`: `4g + 2(mt & 1)` (+1) of 32-row block `mt >> 1`.
    fn wgmma_smem_row(&self, f: &mut Func, r: &str) -> String {
        let wr = self.warp_rows();
        let mtiles = self.quads * 2;
        let w = f.v(format!("udiv i32 {r}, {wr}"));
        let rem = f.v(format!("urem i32 {r}, {wr}"));
        let k = f.v(format!("and i32 {w}, 3"));
        let grp = f.v(format!("lshr i32 {w}, 2"));
        let blk = f.v(format!("lshr i32 {rem}, 5"));
        let q = f.v(format!("and i32 {rem}, 31"));
        let g = f.v(format!("lshr i32 {q}, 2"));
        let h = f.v(format!("lshr i32 {q}, 1"));
        let h = f.v(format!("and i32 {h}, 1"));
        let e = f.v(format!("and i32 {q}, 1"));
        let mt = f.v(format!("shl i32 {blk}, 1"));
        let mt = f.v(format!("or i32 {mt}, {h}"));
        let op = f.mul(&grp, &mtiles.to_string());
        let op = f.add(&op, &mt);
        let base = f.v(format!("shl i32 {op}, 6"));
        let k16 = f.v(format!("shl i32 {k}, 4"));
        let e8 = f.v(format!("shl i32 {e}, 3"));
        let at = f.add(&base, &k16);
        let at = f.add(&at, &g);
        f.add(&at, &e8)
    }

    /// Hopper: the same `cp.async` ring, but each warpgroup multiplies its `2·quads` m64 W
    /// operands by the H tile with `wgmma.mma_async` m64n{batch_tile}k16 straight from
    /// shared memory (both operands K-major, 128-byte swizzle), one commit group per slice.
    ///
    /// Slice kt's wgmmas are queued while slice kt − 1's still run (`wait_group 1` after the
    /// issue), so the tensor pipe does not drain at every CTA barrier. The prefetch then
    /// refills the slot of slice kt − 2, which every warpgroup finished before this
    /// iteration's barrier; hence the ring runs [`GpuConfig::prefetch_depth`] =
    /// `stages − 2` slices ahead.
    ///
    /// With `tma` the ring is fed by [`Gen::tma_issue`] instead: every thread waits on the
    /// slot's full mbarrier (no CTA barrier per slice), each warp releases slice kt − 1 after
    /// `wait_group 1`, and thread 0 then refills that slot with slice kt + stages − 1.
    fn wgmma_mainloop(&self, f: &mut Func, th: &Thread, it: &Item, ring: &Ring, own_prologue: bool) -> Vec<String> {
        let c = self.c;
        let n = c.batch_tile;
        let per = n / 2; // f32 accumulators of one m64nN operand per thread
        let mtiles = self.quads * 2;
        let w_tile_bytes = c.vocab_tile * 128;
        let (smem, ktiles) = (&ring.smem, &ring.ktiles);
        let dtype = match self.p.weights.dtype {
            DType::F16 => "f16",
            _ => "bf16",
        };
        let acc: Vec<Var> = (0..mtiles * per).map(|_| f.var("float", "0.0")).collect();
        if own_prologue {
            self.prologue(f, th, it, ring, None);
        }
        let grp = f.v(format!("lshr i32 {}, 2", th.warp));
        // The warpgroup's first m64 operand, in descriptor units (16 bytes).
        let a_grp = f.mul(&grp, &(mtiles * 64 * 128 / 16).to_string());
        let a_grp = f.zext64(&a_grp);
        let regs: Vec<String> = (0..per).map(|i| format!("${i}")).collect();
        let mma = format!(
            "{{ .reg .pred p; setp.ne.b32 p, ${}, 0; \
             wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{dtype}.{dtype} {{{}}}, ${}, ${}, p, 1, 1, 0, 0; }}",
            per + 2,
            regs.join(","),
            per,
            per + 1
        );
        // Descriptor: start address >> 4 (bits 0-13), leading byte offset 1 (unused by
        // swizzled K-major), stride byte offset 1024 >> 4 (8-row atoms, bits 32-45),
        // 128-byte swizzle (bits 62-63).
        const DESC: u64 = (1 << 16) | (64 << 32) | (1 << 62);
        // Every accumulator through one asm, so LLVM cannot move their uses across it.
        let fence_all = |f: &mut Func, insn: &str| {
            let vals: Vec<String> = acc.iter().map(|a| f.get(a)).collect();
            let out = asm_floats(f, insn, &[], &vals);
            for (a, v) in acc.iter().zip(out) {
                f.set(a, &v);
            }
        };
        // TMA ring: slice numbers across items (see `tma_issue`); lane 0 of each warp.
        let j0 = f.mul(&it.seq, ktiles);
        let lane0 = f.v(format!("icmp eq i32 {}, 0", th.lane));
        let t0 = f.v(format!("icmp eq i32 {}, 0", th.tid));
        f.for_loop("0", ktiles, "1", |f, kt| {
            let slot = if c.uses_tma() {
                let j = f.add(&j0, kt);
                let slot = f.v(format!("urem i32 {j}, {}", c.stages()));
                let round = f.v(format!("udiv i32 {j}, {}", c.stages()));
                let parity = f.v(format!("and i32 {round}, 1"));
                let (full, _) = self.mbarriers(f, ring, &slot);
                mbarrier_wait(f, &full, &parity);
                slot
            } else {
                cp_async_wait(f, c.prefetch_depth() - 1);
                // This thread's cp.async writes become visible to wgmma's (async-proxy) reads.
                f.s("call void asm sideeffect \"fence.proxy.async.shared::cta;\", \"~{memory}\"() #1");
                f.barrier();
                f.v(format!("urem i32 {kt}, {}", c.stages()))
            };
            let slot_off = f.mul(&slot, &c.smem_layout().slot_bytes.to_string());
            let slot_addr = f.add(smem, &slot_off);
            let s4 = f.v(format!("lshr i32 {slot_addr}, 4"));
            let s4 = f.zext64(&s4);
            let desc0 = f.v(format!("or i64 {s4}, {DESC}"));
            let a_desc0 = f.v(format!("add i64 {desc0}, {a_grp}"));
            fence_all(f, "wgmma.fence.sync.aligned;");
            for kk in 0..c.k_step() / 16 {
                let db = f.v(format!("add i64 {desc0}, {}", (w_tile_bytes + kk * 32) >> 4));
                for mt in 0..mtiles {
                    let da = f.v(format!("add i64 {a_desc0}, {}", (mt * 64 * 128 + kk * 32) >> 4));
                    let range = (mt * per) as usize..((mt + 1) * per) as usize;
                    let vals: Vec<String> = acc[range.clone()].iter().map(|a| f.get(a)).collect();
                    let out = asm_floats(f, &mma, &[("l", &da), ("l", &db), ("r", "1")], &vals);
                    for (a, v) in acc[range].iter().zip(out) {
                        f.set(a, &v);
                    }
                }
            }
            f.s("call void asm sideeffect \"wgmma.commit_group.sync.aligned;\", \"~{memory}\"() #1");
            // Slice kt − 1's group (with `wgmma_drain`, slice kt's) is done for this warpgroup
            // before the next barrier.
            fence_all(
                f,
                if matches!(c.schedule, Schedule::Wgmma { drain: true, .. }) { "wgmma.wait_group.sync.aligned 0;" } else { "wgmma.wait_group.sync.aligned 1;" },
            );
            if c.uses_tma() {
                // Each warp releases slot kt − 1; then the producer refills it with slice
                // kt + stages − 1 (waiting for the other warps' releases).
                let started = f.v(format!("icmp ugt i32 {kt}, 0"));
                let release = f.and1(&started, &lane0);
                f.if_then(&release, |f| {
                    let j = f.add(&j0, kt);
                    let prev = f.v(format!("add i32 {j}, -1"));
                    self.release_slot(f, ring, &prev);
                });
                // With `pingpong` the producer warp refills it instead.
                if !c.is_pingpong() {
                    let next = f.add(kt, &(c.stages() - 1).to_string());
                    let more = f.ult(&next, ktiles);
                    let go = f.and1(&more, &t0);
                    f.if_then(&go, |f| self.tma_issue(f, it, ring, &next));
                }
            } else {
                self.prefetch(f, th, it, ring, kt);
            }
        });
        fence_all(f, "wgmma.wait_group.sync.aligned 0;");
        if c.uses_tma() {
            f.if_then(&lane0, |f| {
                let j = f.add(&j0, ktiles);
                let last = f.v(format!("add i32 {j}, -1"));
                self.release_slot(f, ring, &last);
            });
        } else {
            cp_async_wait(f, 0);
        }
        f.barrier();
        self.fragments_to_accumulators(f, &acc)
    }

    /// Fragment (m tile mt, n tile n, element i) → (quad, token, n tile, column); the same
    /// for mma.sync's m16n8 tiles and wgmma's m64nN operands (warp slices of 16 rows).
    fn fragments_to_accumulators(&self, f: &mut Func, acc: &[Var]) -> Vec<String> {
        let mut out = vec![String::new(); self.acc_count()];
        for mt in 0..self.quads * 2 {
            for n in 0..self.ntiles {
                for i in 0..4u32 {
                    let v = f.get(&acc[((mt * self.ntiles + n) * 4 + i) as usize]);
                    out[self.acc_index(mt >> 1, 2 * (mt & 1) + (i >> 1), n, i & 1)] = v;
                }
            }
        }
        out
    }

    /// At iteration `kt`: issues slice `kt + prefetch_depth` (if it exists) into its ring slot
    /// and commits a group either way, so the group counting stays static.
    fn prefetch(&self, f: &mut Func, th: &Thread, it: &Item, ring: &Ring, kt: &str) {
        let c = self.c;
        let pf = f.add(kt, &c.prefetch_depth().to_string());
        let pf_ok = f.ult(&pf, &ring.ktiles);
        f.if_then(&pf_ok, |f| {
            let slot = f.v(format!("urem i32 {pf}, {}", c.stages()));
            self.load_stage(f, th, it, ring, &pf, &slot);
        });
        commit_group(f);
    }

    /// `own_prologue`: issue this item's prologue here (false when the previous item's
    /// epilogue already did, [`GpuConfig::overlaps_epilogue`]).
    fn tensor_mainloop(&self, f: &mut Func, th: &Thread, it: &Item, ring: &Ring, own_prologue: bool) -> Vec<String> {
        let c = self.c;
        let ks = c.k_step();
        let row_bytes = ks * 2;
        let w_tile_bytes = c.vocab_tile * row_bytes;
        let stage_bytes = c.smem_layout().slot_bytes;
        let mtiles = self.quads * 2;
        let (smem, ktiles) = (&ring.smem, &ring.ktiles);

        let acc: Vec<Var> = (0..mtiles * self.ntiles * 4)
            .map(|_| f.var("float", "0.0"))
            .collect();
        if own_prologue {
            self.prologue(f, th, it, ring, None);
        }
        let dtype = match self.p.weights.dtype {
            DType::F16 => "f16",
            _ => "bf16",
        };
        let m = f.v(format!("and i32 {}, 15", th.lane));
        let m7 = f.v(format!("and i32 {m}, 7"));
        let mhi = f.v(format!("lshr i32 {m}, 3"));
        let khalf_a = f.v(format!("lshr i32 {}, 4", th.lane));
        let l7 = f.v(format!("and i32 {}, 7", th.lane));
        let khalf_b = f.v(format!("lshr i32 {}, 3", th.lane));
        let khalf_b = f.v(format!("and i32 {khalf_b}, 1"));
        let nsel = f.v(format!("lshr i32 {}, 4", th.lane));
        let warp_row = f.mul(&th.warp, &self.warp_rows().to_string());
        let m7x4 = f.v(format!("shl i32 {m7}, 2"));
        let a_row_base = f.add(&warp_row, &m7x4);
        let a_row_base = f.add(&a_row_base, &mhi);

        f.for_loop("0", ktiles, "1", |f, kt| {
            cp_async_wait(f, c.prefetch_depth() - 1);
            // Slice kt has landed for every thread, and everyone is done reading the slot
            // the prefetch below overwrites (consumed at iteration kt − 1).
            f.barrier();
            self.prefetch(f, th, it, ring, kt);
            let slot = f.v(format!("urem i32 {kt}, {}", c.stages()));
            let slot_off = f.mul(&slot, &stage_bytes.to_string());
            let slot_addr = f.add(smem, &slot_off);
            let ldm = |f: &mut Func, x: u32, byte_off: &str| -> Vec<String> {
                let a = f.add(&slot_addr, byte_off);
                let (outs, regs) = if x == 4 {
                    ("{ i32, i32, i32, i32 }", "{$0,$1,$2,$3}, [$4]")
                } else {
                    ("{ i32, i32 }", "{$0,$1}, [$2]")
                };
                let cons = if x == 4 { "=r,=r,=r,=r,r,~{memory}" } else { "=r,=r,r,~{memory}" };
                let r = f.v(format!(
                    "call {outs} asm sideeffect \"ldmatrix.sync.aligned.m8n8.x{x}.shared.b16 {regs};\", \"{cons}\"(i32 {a}) #1"
                ));
                (0..x).map(|i| f.v(format!("extractvalue {outs} {r}, {i}"))).collect()
            };
            // Fragments of k16 step kk (A per m tile, B per n tile).
            let frags = |f: &mut Func, kk: u32| -> (Vec<Vec<String>>, Vec<Vec<String>>) {
                // A fragments: lane l gives MMA row l & 15 of k half l >> 4.
                let mut a_frag = Vec::new();
                let ca = f.add(&khalf_a, &(kk * 2).to_string());
                let swa = f.v(format!("xor i32 {ca}, {m7}"));
                let swa = f.v(format!("shl i32 {swa}, 4"));
                for mt in 0..mtiles {
                    let row = f.add(&a_row_base, &((mt >> 1) * 32 + 2 * (mt & 1)).to_string());
                    let ro = f.mul(&row, &row_bytes.to_string());
                    let off = f.add(&ro, &swa);
                    a_frag.push(ldm(f, 4, &off));
                }
                // B fragments: H rows n (batch), k contiguous = mma's col-major B.
                let cb = f.add(&khalf_b, &(kk * 2).to_string());
                let swb = f.v(format!("xor i32 {cb}, {l7}"));
                let swb = f.v(format!("shl i32 {swb}, 4"));
                let mut b_frag: Vec<Vec<String>> = Vec::new();
                let mut n = 0;
                while n < self.ntiles {
                    let pair = n + 1 < self.ntiles;
                    let nrow = if pair {
                        let sel = f.add(&nsel, &n.to_string());
                        let s8 = f.v(format!("shl i32 {sel}, 3"));
                        f.add(&s8, &l7)
                    } else {
                        f.add(&l7, &(n * 8).to_string())
                    };
                    let ro = f.mul(&nrow, &row_bytes.to_string());
                    let off = f.add(&ro, &swb);
                    let off = f.add(&off, &w_tile_bytes.to_string());
                    let r = ldm(f, if pair { 4 } else { 2 }, &off);
                    b_frag.push(r[0..2].to_vec());
                    if pair {
                        b_frag.push(r[2..4].to_vec());
                    }
                    n += if pair { 2 } else { 1 };
                }
                (a_frag, b_frag)
            };
            // Step kk + 1's ldmatrix are issued before step kk's MMAs, so their shared-memory
            // latency hides behind the tensor pipe instead of stalling it.
            let mut next = Some(frags(f, 0));
            for kk in 0..ks / 16 {
                let (a_frag, b_frag) = next.take().unwrap_or_default();
                if kk + 1 < ks / 16 {
                    next = Some(frags(f, kk + 1));
                }
                for mt in 0..mtiles {
                    for n in 0..self.ntiles {
                        let base = ((mt * self.ntiles + n) * 4) as usize;
                        let cur: Vec<String> = (0..4).map(|i| f.get(&acc[base + i])).collect();
                        let a = &a_frag[mt as usize];
                        let b = &b_frag[n as usize];
                        let r = f.v(format!(
                            "call {{ float, float, float, float }} asm \"mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32 \
                             {{$0,$1,$2,$3}}, {{$4,$5,$6,$7}}, {{$8,$9}}, {{$10,$11,$12,$13}};\", \
                             \"=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f\"(i32 {}, i32 {}, i32 {}, i32 {}, i32 {}, i32 {}, \
                             float {}, float {}, float {}, float {}) #1",
                            a[0], a[1], a[2], a[3], b[0], b[1], cur[0], cur[1], cur[2], cur[3]
                        ));
                        for i in 0..4 {
                            let v = f.v(format!("extractvalue {{ float, float, float, float }} {r}, {i}"));
                            f.set(&acc[base + i], &v);
                        }
                    }
                }
            }
        });
        cp_async_wait(f, 0);
        // Every warp is done reading the ring: the epilogue's scratch may alias it, or the
        // next item's prologue may refill it.
        f.barrier();

        self.fragments_to_accumulators(f, &acc)
    }

    /// DESIGN.md steps 2–7 on the thread's accumulators, then the cross-warp reduction.
    fn epilogue(&self, f: &mut Func, th: &Thread, it: &Item, acc: &[String]) {
        let c = self.c;
        let p = self.p;
        let bt = c.batch_tile;
        let e = c.warps * bt; // scratch entries
        let (sc_score, sc_index, sc_logit, sc_max, sc_sum, sc_flag) = (0, 4 * e, 8 * e, 12 * e, 16 * e, 20 * e);
        let has_temp = p.temperature().is_some();
        let has_bias = p.has_bias();
        let has_mask = p.has_mask();
        let lse = self.lse;
        let samples = p.samples_per_row();

        let warp_base = f.mul(&th.warp, &self.warp_rows().to_string());
        let g4 = f.v(format!("shl i32 {}, 2", th.g));
        let t2 = f.v(format!("shl i32 {}, 1", th.t));

        // Columns: (n, j) → batch row r.
        struct Col {
            col: String,
            row_safe: String,
            inv_t: String,
            t_zero: String,
            greedy: String,
            /// Philox key halves and counter row (`SamplingParams::row_stream`).
            key_lo: String,
            key_hi: String,
            ctr_row: String,
            /// Penalty CSR range and repetition of the row.
            pen: Option<(String, String, String)>,
        }
        let has_pen = p.has_penalties();
        let has_rs = f.v("icmp ne ptr addrspace(1) %row_seeds, null");
        let mut cols = Vec::new();
        for n in 0..self.ntiles {
            for j in 0..2 {
                let col = f.add(&t2, &(n * 8 + j).to_string());
                let row = f.add(&it.b0, &col);
                let ok = f.ult(&row, "%batch");
                let row_safe = f.sel("i32", &ok, &row, "0");
                let (inv_t, t_zero) = if has_temp {
                    let r64 = f.zext64(&row_safe);
                    let a = f.gaddr("%temperatures", &r64, 4);
                    let tv = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
                    let z = f.v(format!("fcmp oeq float {tv}, 0.0"));
                    (f.fdiv(&f32c(1.0), &tv), z)
                } else {
                    (String::new(), "false".to_string())
                };
                let greedy = if p.is_greedy() {
                    "true".to_string()
                } else {
                    t_zero.clone()
                };
                let (key_lo, key_hi, ctr_row) = if p.is_greedy() {
                    (String::new(), String::new(), String::new())
                } else {
                    let key = f.var("i64", "%seed");
                    f.if_then(&has_rs, |f| {
                        let r64 = f.zext64(&row_safe);
                        let a = f.gaddr("%row_seeds", &r64, 8);
                        let k = f.v(format!("load i64, ptr addrspace(1) {a}, align 8"));
                        f.set(&key, &k);
                    });
                    let k = f.get(&key);
                    let lo = f.v(format!("trunc i64 {k} to i32"));
                    let hi = f.v(format!("lshr i64 {k}, 32"));
                    let hi = f.v(format!("trunc i64 {hi} to i32"));
                    (lo, hi, f.sel("i32", &has_rs, "0", &row))
                };
                let pen = has_pen.then(|| {
                    let r64 = f.zext64(&row_safe);
                    let a = f.gaddr("%pen_offsets", &r64, 4);
                    let lo = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
                    let a1 = f.v(format!("getelementptr i8, ptr addrspace(1) {a}, i64 4"));
                    let hi = f.v(format!("load i32, ptr addrspace(1) {a1}, align 4"));
                    let a = f.gaddr("%pen_repetition", &r64, 4);
                    let rep = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
                    (lo, hi, rep)
                });
                cols.push(Col {
                    col,
                    row_safe,
                    inv_t,
                    t_zero,
                    greedy,
                    key_lo,
                    key_hi,
                    ctr_row,
                    pen,
                });
            }
        }
        let words = f.add("%vocab", "31");
        let words = f.v(format!("lshr i32 {words}, 5"));

        // Transformed logits x (−inf when excluded) and the non-finite flag per column.
        let mut x = vec![String::new(); self.acc_count()];
        let mut nonfinite = vec!["false".to_string(); cols.len()];
        let mut quad_base = Vec::new();
        for q in 0..self.quads {
            let qb = f.add(&it.v0, &warp_base);
            let qb = f.add(&qb, &(q * 32).to_string());
            let qb = f.add(&qb, &g4);
            // A quad never straddles a bitset word, so one word per column (row) serves it:
            // of the allowed-token bitset and of the penalized-token bitset.
            let quad_words = |f: &mut Func, table: &str| -> Vec<String> {
                let qok = f.ult(&qb, "%vocab");
                let qs = f.sel("i32", &qok, &qb, "0");
                let wcol = f.v(format!("lshr i32 {qs}, 5"));
                cols.iter()
                    .map(|cl| {
                        let wi = f.mul(&cl.row_safe, &words);
                        let wi = f.add(&wi, &wcol);
                        let wi = f.zext64(&wi);
                        let a = f.gaddr(table, &wi, 4);
                        f.v(format!("load i32, ptr addrspace(1) {a}, align 4"))
                    })
                    .collect()
            };
            let mask_words = if has_mask { quad_words(f, "%allowed") } else { Vec::new() };
            let pen_words = if has_pen { quad_words(f, "%pen_bits") } else { Vec::new() };
            for o in 0..4 {
                let v = f.add(&qb, &o.to_string());
                let v_ok = f.ult(&v, "%vocab");
                let bias = if has_bias {
                    let vs = f.sel("i32", &v_ok, &v, "0");
                    let v64 = f.zext64(&vs);
                    let a = f.gaddr("%bias", &v64, 4);
                    f.v(format!("load float, ptr addrspace(1) {a}, align 4"))
                } else {
                    String::new()
                };
                let bit = f.v(format!("and i32 {v}, 31"));
                for (ci, cl) in cols.iter().enumerate() {
                    let (n, j) = (ci as u32 / 2, ci as u32 % 2);
                    let idx = self.acc_index(q, o, n, j);
                    let raw = acc[idx].clone();
                    let abs = f.v(format!("call float @llvm.fabs.f32(float {raw})"));
                    let bad = f.v(format!("fcmp ueq float {abs}, 0x7FF0000000000000"));
                    let bad = f.and1(&bad, &v_ok);
                    nonfinite[ci] = f.v(format!("or i1 {}, {bad}", nonfinite[ci]));
                    let mut xv = raw;
                    for tr in &p.transforms {
                        match tr {
                            Transform::Temperature(_) => {
                                let scaled = f.fmul(&xv, &cl.inv_t);
                                xv = f.sel("float", &cl.t_zero, &xv, &scaled);
                            }
                            Transform::Bias { .. } => xv = f.fadd(&xv, &bias),
                            Transform::Softcap { cap } => {
                                xv = f.v(format!(
                                    "call float @fs_softcap_f32(float {xv}, float {})",
                                    f32c(cap.get())
                                ))
                            }
                            Transform::Penalties { .. } => {
                                let Some((lo, hi, rep)) = &cl.pen else { continue };
                                let sh = f.v(format!("lshr i32 {}, {bit}", pen_words[ci]));
                                let b = f.v(format!("trunc i32 {sh} to i1"));
                                let b = f.and1(&b, &v_ok);
                                let out = f.var("float", &xv);
                                let x_in = xv.clone();
                                f.if_then(&b, |f| {
                                    let r = f.v(format!(
                                        "call float @fs_penalize_token(float {x_in}, i32 {v}, i32 {lo}, i32 {hi}, \
                                         ptr addrspace(1) %pen_tokens, ptr addrspace(1) %pen_subtract, float {rep})"
                                    ));
                                    f.set(&out, &r);
                                });
                                xv = f.get(&out);
                            }
                            // Exclusion is the `ok` test below (step 4); the filter acts on
                            // the lists (step 6b) and in stage three.
                            Transform::Mask { .. } | Transform::Ban { .. } | Transform::Filter { .. } => {}
                        }
                    }
                    let mut ok = v_ok.clone();
                    if has_mask {
                        let sh = f.v(format!("lshr i32 {}, {bit}", mask_words[ci]));
                        let b = f.v(format!("trunc i32 {sh} to i1"));
                        ok = f.and1(&ok, &b);
                    }
                    x[idx] = f.sel("float", &ok, &xv, NEG_INF);
                }
            }
            quad_base.push(qb);
        }

        if c.list_per_tile > 0 {
            self.list_epilogue(f, th, it, &x);
        }

        let lane_lt4 = f.ult(&th.lane, "4");
        let scratch_slot = |f: &mut Func, warp: &str, col: &str| -> String {
            let s = f.mul(warp, &bt.to_string());
            let s = f.add(&s, col);
            f.v(format!("shl i32 {s}, 2"))
        };
        let st_shared = |f: &mut Func, ty: &str, region: u32, slot4: &str, v: &str| {
            let off = f.add(slot4, &region.to_string());
            let off = f.add(&off, &th.scratch);
            let a = f.saddr("@fs_smem", &off);
            f.s(format!("store {ty} {v}, ptr addrspace(3) {a}, align 4"));
        };
        let ld_shared = |f: &mut Func, ty: &str, region: u32, slot4: &str| -> String {
            let off = f.add(slot4, &region.to_string());
            let off = f.add(&off, &th.scratch);
            let a = f.saddr("@fs_smem", &off);
            f.v(format!("load {ty}, ptr addrspace(3) {a}, align 4"))
        };

        // Phase A: non-finite flags and logsumexp partials per column, reduced over the 8
        // lanes sharing t (xor 4, 8, 16), then written per warp.
        let mut lse_parts = Vec::new();
        for (ci, _) in cols.iter().enumerate() {
            let flag = f.v(format!("zext i1 {} to i32", nonfinite[ci]));
            let mut flag = flag;
            for sh in [4, 8, 16] {
                let o = f.shfl_xor_i32(&flag, sh);
                flag = f.v(format!("or i32 {flag}, {o}"));
            }
            let mut part = None;
            if lse {
                let (n, j) = (ci as u32 / 2, ci as u32 % 2);
                let xs: Vec<&String> = (0..self.quads)
                    .flat_map(|q| (0..4).map(move |o| (q, o)))
                    .map(|(q, o)| &x[self.acc_index(q, o, n, j)])
                    .collect();
                let mut m = NEG_INF.to_string();
                for xv in &xs {
                    m = f.v(format!(
                        "call float @llvm.maxnum.f32(float {m}, float {xv})"
                    ));
                }
                let nm = f.v(format!("fneg float {m}"));
                let mut s = "0.0".to_string();
                for xv in &xs {
                    let d = f.fadd(xv, &nm);
                    let ex = f.v(format!("call float @fs_exp_f32(float {d})"));
                    let live = f.v(format!("fcmp ogt float {xv}, {NEG_INF}"));
                    let ex = f.sel("float", &live, &ex, "0.0");
                    s = f.fadd(&s, &ex);
                }
                for sh in [4, 8, 16] {
                    let om = f.shfl_xor_f32(&m, sh);
                    let os = f.shfl_xor_f32(&s, sh);
                    (m, s) = f.lse_combine(&m, &s, &om, &os);
                }
                part = Some((m, s));
            }
            lse_parts.push((flag, part));
        }
        f.if_then(&lane_lt4, |f| {
            for (ci, cl) in cols.iter().enumerate() {
                let slot = scratch_slot(f, &th.warp, &cl.col);
                st_shared(f, "i32", sc_flag, &slot, &lse_parts[ci].0);
                if let Some((m, s)) = &lse_parts[ci].1 {
                    st_shared(f, "float", sc_max, &slot, m);
                    st_shared(f, "float", sc_sum, &slot, s);
                }
            }
        });
        f.barrier();
        let tid_lt_bt = f.ult(&th.tid, &bt.to_string());
        if lse {
            f.if_then(&tid_lt_bt, |f| {
                let (mut m, mut s) = (NEG_INF.to_string(), "0.0".to_string());
                for w in 0..c.warps {
                    let slot = scratch_slot(f, &w.to_string(), &th.tid);
                    let wm = ld_shared(f, "float", sc_max, &slot);
                    let ws = ld_shared(f, "float", sc_sum, &slot);
                    (m, s) = f.lse_combine(&m, &s, &wm, &ws);
                }
                let row = f.add(&it.b0, &th.tid);
                let row_ok = f.ult(&row, "%batch");
                let lse_ok = f.v("icmp ne ptr addrspace(1) %lse, null");
                let ok = f.and1(&row_ok, &lse_ok);
                f.if_then(&ok, |f| {
                    let i = f.mul(&row, &it.vtiles);
                    let i = f.add(&i, &it.vtile);
                    let i64v = f.zext64(&i);
                    let a = f.gaddr("%lse", &i64v, 8);
                    f.s(format!("store float {m}, ptr addrspace(1) {a}, align 4"));
                    let a2 = f.v(format!("getelementptr i8, ptr addrspace(1) {a}, i64 4"));
                    f.s(format!("store float {s}, ptr addrspace(1) {a2}, align 4"));
                });
            });
        }

        // Phase B, per sample: the thread's best token per column (ascending v, strict >, so
        // ties keep the lower index), then the 8 lanes of the column, then the warps.
        let none = INDEX_NONE as i32;
        f.for_loop("0", &samples.to_string(), "1", |f, s| {
            let mut best = Vec::new();
            // Columns come in pairs (j = 0, 1 of an n tile): one noise call serves both.
            for (n, pair) in cols.chunks(2).enumerate() {
                // An n tile past the batch (rows 8n.. of a partly filled batch tile) is skipped
                // whole: the test is uniform over the CTA, and the noise is most of the
                // epilogue's work. Its columns report NONE, which no live row reads.
                let outs: Vec<[Var; 3]> = pair
                    .iter()
                    .map(|_| [f.var("float", NEG_INF), f.var("i32", &none.to_string()), f.var("float", NEG_INF)])
                    .collect();
                let first_row = f.add(&it.b0, &(n as u32 * 8).to_string());
                let live = f.ult(&first_row, "%batch");
                f.if_then(&live, |f| {
                    let mut acc_best: Vec<(String, String, String)> =
                        vec![(NEG_INF.to_string(), none.to_string(), NEG_INF.to_string()); pair.len()];
                    for q in 0..self.quads {
                        let noise: Vec<String> = if p.is_greedy() {
                            Vec::new()
                        } else {
                            // Global index g = v + vocab_offset (a multiple of 4: same quads).
                            let g = f.add(&quad_base[q as usize], "%vocab_offset");
                            let ctr = f.v(format!("lshr i32 {g}, 2"));
                            let (a, b) = (&pair[0], &pair[pair.len() - 1]);
                            let ty = crate::math::NOISE_PAIR_TY;
                            let r = f.v(format!(
                                "call {ty} @fs_noise_pair(i32 {ctr}, i32 {s}, i32 {}, i32 {}, i32 {}, i32 {}, i32 {}, i32 {})",
                                a.ctr_row, a.key_lo, a.key_hi, b.ctr_row, b.key_lo, b.key_hi
                            ));
                            (0..8).map(|w| f.v(format!("extractvalue {ty} {r}, {w}"))).collect()
                        };
                        for (pj, cl) in pair.iter().enumerate() {
                            let (n, j) = (n as u32, pj as u32);
                            let (bs, bi, bl) = &mut acc_best[pj];
                            for o in 0..4 {
                                let xv = &x[self.acc_index(q, o, n, j)];
                                let score = if p.is_greedy() {
                                    xv.clone()
                                } else {
                                    let noisy = f.fadd(xv, &noise[pj * 4 + o as usize]);
                                    f.sel("float", &cl.greedy, xv, &noisy)
                                };
                                let v = f.add(&quad_base[q as usize], &o.to_string());
                                let better = f.v(format!("fcmp ogt float {score}, {bs}"));
                                *bs = f.sel("float", &better, &score, bs);
                                *bi = f.sel("i32", &better, &v, bi);
                                *bl = f.sel("float", &better, xv, bl);
                            }
                        }
                    }
                    for (best, out) in acc_best.into_iter().zip(&outs) {
                        let (bs, bi, bl) = f.shfl_best(best, &[4, 8, 16]);
                        for (slot, v) in out.iter().zip([bs, bi, bl]) {
                            f.set(slot, &v);
                        }
                    }
                });
                for [bs, bi, bl] in &outs {
                    best.push((f.get(bs), f.get(bi), f.get(bl)));
                }
            }
            f.if_then(&lane_lt4, |f| {
                for (ci, cl) in cols.iter().enumerate() {
                    let slot = scratch_slot(f, &th.warp, &cl.col);
                    st_shared(f, "float", sc_score, &slot, &best[ci].0);
                    st_shared(f, "i32", sc_index, &slot, &best[ci].1);
                    st_shared(f, "float", sc_logit, &slot, &best[ci].2);
                }
            });
            f.barrier();
            f.if_then(&tid_lt_bt, |f| {
                let mut best = (NEG_INF.to_string(), none.to_string(), NEG_INF.to_string());
                let mut flag = "0".to_string();
                for w in 0..c.warps {
                    let slot = scratch_slot(f, &w.to_string(), &th.tid);
                    let ws = ld_shared(f, "float", sc_score, &slot);
                    let wi = ld_shared(f, "i32", sc_index, &slot);
                    let wl = ld_shared(f, "float", sc_logit, &slot);
                    let wf = ld_shared(f, "i32", sc_flag, &slot);
                    flag = f.v(format!("or i32 {flag}, {wf}"));
                    best = f.keep_best(best, (&ws, &wi, &wl));
                }
                let (bs, bi, bl) = best;
                let nf = f.v(format!("icmp ne i32 {flag}, 0"));
                let index = f.sel("i32", &nf, &(INDEX_NONFINITE as i32).to_string(), &bi);
                let row = f.add(&it.b0, &th.tid);
                let row_ok = f.ult(&row, "%batch");
                f.if_then(&row_ok, |f| {
                    let slot = f.mul(&row, &samples.to_string());
                    let slot = f.add(&slot, s);
                    let slot = f.mul(&slot, &it.vtiles);
                    let slot = f.add(&slot, &it.vtile);
                    let s64 = f.zext64(&slot);
                    let a = f.gaddr("%candidates", &s64, 12);
                    f.s(format!("store float {bs}, ptr addrspace(1) {a}, align 4"));
                    let a1 = f.v(format!("getelementptr i8, ptr addrspace(1) {a}, i64 4"));
                    f.s(format!("store i32 {index}, ptr addrspace(1) {a1}, align 4"));
                    let a2 = f.v(format!("getelementptr i8, ptr addrspace(1) {a}, i64 8"));
                    f.s(format!("store float {bl}, ptr addrspace(1) {a2}, align 4"));
                });
            });
            // The next sample rewrites the scratch just read.
            f.barrier();
        });
    }

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
    fn list_epilogue(&self, f: &mut Func, th: &Thread, it: &Item, x: &[String]) {
        let c = self.c;
        let vt = c.vocab_tile;
        let base = f.add(&th.scratch, &c.smem_layout().scratch.bytes.to_string());
        let warp_base = f.mul(&th.warp, &self.warp_rows().to_string());
        let g4 = f.v(format!("shl i32 {}, 2", th.g));
        let t2 = f.v(format!("shl i32 {}, 1", th.t));
        // Each thread's quad is 4 consecutive tokens of one column: one 16-byte store.
        for q in 0..self.quads {
            let local = f.add(&warp_base, &(q * 32).to_string());
            let local = f.add(&local, &g4);
            for n in 0..self.ntiles {
                for j in 0..2 {
                    let col = f.add(&t2, &(n * 8 + j).to_string());
                    let e = f.mul(&col, &vt.to_string());
                    let e = f.add(&e, &local);
                    let off = f.v(format!("shl i32 {e}, 2"));
                    let off = f.add(&off, &base.to_string());
                    let mut vec = "undef".to_string();
                    for o in 0..4 {
                        let xv = &x[self.acc_index(q, o, n, j)];
                        vec = f.v(format!("insertelement <4 x float> {vec}, float {xv}, i32 {o}"));
                    }
                    let a = f.saddr("@fs_smem", &off);
                    f.s(format!("store <4 x float> {vec}, ptr addrspace(3) {a}, align 16"));
                }
            }
        }
        f.barrier();
        let none = INDEX_NONE as i32;
        let per_tile = c.list_per_tile;
        let bt = c.batch_tile;
        let per_lane = vt / 32;
        // Rows a warp selects together: enough to overlap the rounds' latencies, few enough
        // that `rows · per_lane` keys and logits stay in registers.
        let rows = (16 / per_lane).clamp(1, 4).min(bt.div_ceil(c.warps));
        let lists_ok = f.v("icmp ne ptr addrspace(1) %lists, null");
        let lane_first = f.mul(&th.lane, &per_lane.to_string());
        let warp_first = f.mul(&th.warp, &rows.to_string());
        let group_step = (c.warps * rows).to_string();
        f.for_loop(&warp_first, &bt.to_string(), &group_step, |f, col0| {
            // Per row of the group: keys and logits (registers), the list slot, store guard.
            let mut keys: Vec<Vec<Var>> = Vec::new();
            let mut xs: Vec<Vec<String>> = Vec::new();
            let mut slot0s = Vec::new();
            let mut oks = Vec::new();
            for r in 0..rows {
                let col = f.add(col0, &r.to_string());
                let col_in = f.ult(&col, &bt.to_string());
                // A column past the tile reads the last column (stays inside the list area)
                // and stores nothing.
                let col_rd = f.sel("i32", &col_in, &col, &(bt - 1).to_string());
                let row = f.add(&it.b0, &col);
                let row_ok = f.ult(&row, "%batch");
                let ok = f.and1(&row_ok, &col_in);
                let ok = f.and1(&ok, &lists_ok);
                oks.push(ok);
                let e = f.mul(&col_rd, &vt.to_string());
                let e = f.add(&e, &lane_first);
                let off = f.v(format!("shl i32 {e}, 2"));
                let off = f.add(&off, &base.to_string());
                let mut vals = Vec::new();
                if per_lane.is_multiple_of(4) {
                    for v4 in 0..per_lane / 4 {
                        let o = f.add(&off, &(v4 * 16).to_string());
                        let a = f.saddr("@fs_smem", &o);
                        let vec = f.v(format!("load <4 x float>, ptr addrspace(3) {a}, align 16"));
                        for o in 0..4 {
                            vals.push(f.v(format!("extractelement <4 x float> {vec}, i32 {o}")));
                        }
                    }
                } else {
                    for o in 0..per_lane {
                        let oo = f.add(&off, &(o * 4).to_string());
                        let a = f.saddr("@fs_smem", &oo);
                        vals.push(f.v(format!("load float, ptr addrspace(3) {a}, align 4")));
                    }
                }
                let kv: Vec<Var> = vals
                    .iter()
                    .map(|v| {
                        let k = f.order_key(v);
                        f.var("i32", &k)
                    })
                    .collect();
                keys.push(kv);
                xs.push(vals);
                let slot0 = f.mul(&row, &it.vtiles);
                let slot0 = f.add(&slot0, &it.vtile);
                slot0s.push(f.mul(&slot0, &per_tile.to_string()));
            }
            f.for_loop("0", &per_tile.to_string(), "1", |f, k| {
                // All rows' reductions first (straight-line, so they interleave), then the
                // stores (each a branch).
                let mut writes = Vec::new();
                for r in 0..rows as usize {
                    let cur: Vec<String> = keys[r].iter().map(|v| f.get(v)).collect();
                    let mut best = cur[0].clone();
                    for kk in &cur[1..] {
                        best = f.umax(&best, kk);
                    }
                    let m = f.redux_umax(&best);
                    let mine = f.v(format!("icmp eq i32 {best}, {m}"));
                    let ball = f.ballot(&mine);
                    // Never 0: the lane holding the max votes.
                    let low = f.v(format!("call i32 @llvm.cttz.i32(i32 {ball}, i1 true)"));
                    let me = f.v(format!("icmp eq i32 {}, {low}", th.lane));
                    let found = f.var("i1", "false");
                    let (mut wx, mut wo) = (NEG_INF.to_string(), "0".to_string());
                    for (o, kk) in cur.iter().enumerate() {
                        let fv = f.get(&found);
                        let nf = f.v(format!("xor i1 {fv}, true"));
                        let hit = f.v(format!("icmp eq i32 {kk}, {m}"));
                        let hit = f.and1(&hit, &nf);
                        let hit = f.and1(&hit, &me);
                        let nk = f.sel("i32", &hit, "0", kk);
                        f.set(&keys[r][o], &nk);
                        wx = f.sel("float", &hit, &xs[r][o], &wx);
                        wo = f.sel("i32", &hit, &o.to_string(), &wo);
                        let nfv = f.v(format!("or i1 {fv}, {hit}"));
                        f.set(&found, &nfv);
                    }
                    // m == 0: every lane's best is 0, the ballot is full and lane 0 writes EMPTY.
                    let real = f.v(format!("icmp ne i32 {m}, 0"));
                    let idx = f.add(&lane_first, &wo);
                    let idx = f.add(&it.v0, &idx);
                    let idx = f.sel("i32", &real, &idx, &none.to_string());
                    let lx = f.sel("float", &real, &wx, NEG_INF);
                    let w = f.and1(&me, &oks[r]);
                    writes.push((w, lx, idx));
                }
                for (r, (w, lx, idx)) in writes.iter().enumerate() {
                    f.if_then(w, |f| {
                        let slot = f.add(&slot0s[r], k);
                        let s64 = f.zext64(&slot);
                        let a = f.gaddr("%lists", &s64, 8);
                        f.s(format!("store float {lx}, ptr addrspace(1) {a}, align 4"));
                        let a1 = f.v(format!("getelementptr i8, ptr addrspace(1) {a}, i64 4"));
                        f.s(format!("store i32 {idx}, ptr addrspace(1) {a1}, align 4"));
                    });
                }
            });
        });
    }
}
