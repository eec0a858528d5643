//! One function per PTX instruction family the kernels write as inline assembly (the rest
//! are LLVM intrinsics in `ir`). Each takes typed operands (`ir::{I32, I64, F32,
//! SharedAddr, Ptr}`), so an operand of the wrong width or address space does not compile.
//! Every asm statement is `sideeffect` and clobbers memory (attribute group `#1`: convergent),
//! so LLVM neither drops nor reorders it against loads and stores.

use crate::ir::{i32c, Agg, Func, Global, Icmp, Operand, Ptr, SharedAddr, F32, I1, I32, I64};

/// An inline-asm statement whose f32 results are `tied` (read and written in place, PTX
/// `+f`) after the plain `inputs` (constraint, value): how wgmma reads and writes its
/// accumulators, and how a fence pins every accumulator in place.
fn asm_floats(f: &mut Func, insn: &str, inputs: &[(&str, &dyn Operand)], tied: &[F32]) -> Vec<F32> {
    let n = tied.len();
    let ty = Agg::of::<F32>(n);
    let mut cons: Vec<String> = (0..n).map(|_| "=f".to_string()).collect();
    cons.extend(inputs.iter().map(|(c, _)| c.to_string()));
    cons.extend((0..n).map(|i| i.to_string()));
    let mut args: Vec<String> = inputs.iter().map(|(_, v)| v.operand()).collect();
    args.extend(tied.iter().map(|v| v.operand()));
    let call = format!("call {ty} asm sideeffect \"{insn}\", \"{},~{{memory}}\"({}) #1", cons.join(","), args.join(", "));
    let r = f.agg(ty, call);
    (0..n).map(|i| f.extract(&r, i)).collect()
}

// ---- cp.async ----

/// `cp.async.cg.shared.global`: 16 bytes from `src` to `dst`; `src_size` 0 zero-fills them.
pub(crate) fn cp_async_16(f: &mut Func, dst: &SharedAddr, src: &Ptr<Global>, src_size: &I32) {
    f.s(format!(
        "call void asm sideeffect \"cp.async.cg.shared.global [$0], [$1], 16, $2;\", \
         \"r,l,r,~{{memory}}\"(i32 {dst}, ptr addrspace(1) {src}, i32 {src_size}) #1"
    ));
}

/// `cp.async.commit_group`: this thread's cp.asyncs since the last commit form one group.
pub(crate) fn cp_async_commit(f: &mut Func) {
    f.s("call void asm sideeffect \"cp.async.commit_group;\", \"~{memory}\"() #1");
}

/// `cp.async.wait_group`: until at most `pending` of this thread's groups are in flight.
pub(crate) fn cp_async_wait(f: &mut Func, pending: u32) {
    f.s(format!("call void asm sideeffect \"cp.async.wait_group {pending};\", \"~{{memory}}\"() #1"));
}

/// `fence.proxy.async.shared::cta`: this thread's generic-proxy writes (cp.async) become
/// visible to async-proxy reads (wgmma).
pub(crate) fn fence_proxy_async(f: &mut Func) {
    f.s("call void asm sideeffect \"fence.proxy.async.shared::cta;\", \"~{memory}\"() #1");
}

// ---- mbarrier ----

/// `mbarrier.init`: the barrier at `bar` expects `count` arrivals per phase.
pub(crate) fn mbarrier_init(f: &mut Func, bar: &SharedAddr, count: u32) {
    f.s(format!(
        "call void asm sideeffect \"mbarrier.init.shared::cta.b64 [$0], $1;\", \"r,r,~{{memory}}\"(i32 {bar}, i32 {count}) #1"
    ));
}

/// `fence.mbarrier_init`: the initialised barriers are visible to the async proxy (TMA).
pub(crate) fn fence_mbarrier_init(f: &mut Func) {
    f.s("call void asm sideeffect \"fence.mbarrier_init.release.cluster;\", \"~{memory}\"() #1");
}

/// Blocks until the mbarrier at `bar` has completed the phase of `parity` (`try_wait` may
/// time out and is retried; it acquires what the phase released).
pub(crate) fn mbarrier_wait(f: &mut Func, bar: &SharedAddr, parity: &I32) {
    let done = f.var(&i32c(0));
    f.while_loop(
        |f| {
            let d = f.get(&done);
            f.icmp(Icmp::Eq, &d, &i32c(0))
        },
        |f| {
            let r = f.typed(format!(
                "call i32 asm sideeffect \"{{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; selp.u32 $0, 1, 0, p; }}\", \
                 \"=r,r,r,~{{memory}}\"(i32 {bar}, i32 {parity}) #1"
            ));
            f.set(&done, &r);
        },
    );
}

/// One arrival on the mbarrier at `bar` (release: this thread's prior reads of what it
/// guards are done).
pub(crate) fn mbarrier_arrive(f: &mut Func, bar: &SharedAddr) {
    f.s(format!(
        "call void asm sideeffect \"{{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [$0]; }}\", \"r,~{{memory}}\"(i32 {bar}) #1"
    ));
}

/// One arrival on `bar` that also expects `bytes` of transactions (the TMA's writes) in
/// this phase.
pub(crate) fn mbarrier_arrive_expect_tx(f: &mut Func, bar: &SharedAddr, bytes: u32) {
    f.s(format!(
        "call void asm sideeffect \"{{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [$0], $1; }}\", \
         \"r,r,~{{memory}}\"(i32 {bar}, i32 {bytes}) #1"
    ));
}

// ---- TMA ----

/// `cp.async.bulk.tensor.5d`: the box of tensor map `map` (a generic address) at coordinates
/// `(k0, 0, 0, block, 0)` into `dst`, completing `bar`'s transaction bytes.
pub(crate) fn tma_load_5d(f: &mut Func, dst: &SharedAddr, map: &I64, k0: &I32, block: &I32, bar: &SharedAddr) {
    f.s(format!(
        "call void asm sideeffect \"cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes \
         [$0], [$1, {{$2, 0, 0, $3, 0}}], [$4];\", \"r,l,r,r,r,~{{memory}}\"\
         (i32 {dst}, i64 {map}, i32 {k0}, i32 {block}, i32 {bar}) #1"
    ));
}

/// [`tma_load_5d`] multicast (`.multicast::cluster`): the box lands at `dst`'s offset in the
/// shared memory of every CTA of the cluster in `cta_mask` and completes the transaction
/// bytes of the mbarrier at `bar`'s offset in each of them.
pub(crate) fn tma_load_5d_multicast(f: &mut Func, dst: &SharedAddr, map: &I64, k0: &I32, block: &I32, bar: &SharedAddr, cta_mask: u16) {
    f.s(format!(
        "call void asm sideeffect \"cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster \
         [$0], [$1, {{$2, 0, 0, $3, 0}}], [$4], $5;\", \"r,l,r,r,r,h,~{{memory}}\"\
         (i32 {dst}, i64 {map}, i32 {k0}, i32 {block}, i32 {bar}, i16 {cta_mask}) #1"
    ));
}

/// `cp.async.bulk.tensor.2d`: the box of `map` at `(k0, row)` into `dst`, completing `bar`'s
/// transaction bytes.
pub(crate) fn tma_load_2d(f: &mut Func, dst: &SharedAddr, map: &I64, k0: &I32, row: &I32, bar: &SharedAddr) {
    f.s(format!(
        "call void asm sideeffect \"cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes \
         [$0], [$1, {{$2, $3}}], [$4];\", \"r,l,r,r,r,~{{memory}}\"\
         (i32 {dst}, i64 {map}, i32 {k0}, i32 {row}, i32 {bar}) #1"
    ));
}

// ---- mma.sync ----

/// `ldmatrix.sync.aligned.m8n8.x{count}.shared.b16` (`count` 2 or 4): the lane's fragment
/// registers of `count` 8×8 matrices whose rows the lanes address.
pub(crate) fn ldmatrix(f: &mut Func, count: u32, row: &SharedAddr) -> Vec<I32> {
    let (outs, regs) = if count == 4 {
        ("{ i32, i32, i32, i32 }", "{$0,$1,$2,$3}, [$4]")
    } else {
        ("{ i32, i32 }", "{$0,$1}, [$2]")
    };
    let cons = if count == 4 { "=r,=r,=r,=r,r,~{memory}" } else { "=r,=r,r,~{memory}" };
    let r = f.agg(
        outs,
        format!("call {outs} asm sideeffect \"ldmatrix.sync.aligned.m8n8.x{count}.shared.b16 {regs};\", \"{cons}\"(i32 {row}) #1"),
    );
    (0..count as usize).map(|i| f.extract(&r, i)).collect()
}

/// Thread `tid`'s place in the MMA fragment layouts: its warp, its lane `4g + t`, the
/// fragment row group `g` (rows `g`, `g + 8`) and the column pair `t` (columns `2t`, `2t + 1`).
pub(crate) struct MmaLane {
    pub warp: I32,
    pub lane: I32,
    pub g: I32,
    pub t: I32,
}

impl MmaLane {
    pub(crate) fn of(f: &mut Func, tid: &I32) -> MmaLane {
        let warp = f.lshr(tid, &i32c(5));
        let lane = f.and(tid, &i32c(31));
        let g = f.lshr(&lane, &i32c(2));
        let t = f.and(&lane, &i32c(3));
        MmaLane { warp, lane, g, t }
    }
}

/// `mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32`: `c + a·b` on one m16n8k16
/// tile (`dtype` `bf16` or `f16`).
pub(crate) fn mma_m16n8k16(f: &mut Func, dtype: &str, a: &[I32], b: &[I32], c: &[F32]) -> [F32; 4] {
    let r = f.agg(
        "{ float, float, float, float }",
        format!(
        "call {{ float, float, float, float }} asm \"mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32 \
         {{$0,$1,$2,$3}}, {{$4,$5,$6,$7}}, {{$8,$9}}, {{$10,$11,$12,$13}};\", \
         \"=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f\"(i32 {}, i32 {}, i32 {}, i32 {}, i32 {}, i32 {}, \
         float {}, float {}, float {}, float {}) #1",
        a[0], a[1], a[2], a[3], b[0], b[1], c[0], c[1], c[2], c[3]
        ),
    );
    std::array::from_fn(|i| f.extract(&r, i))
}

// ---- wgmma ----

/// `wgmma.fence.sync.aligned`, threaded through every accumulator so that LLVM cannot move
/// their uses across it.
pub(crate) fn wgmma_fence(f: &mut Func, acc: &[F32]) -> Vec<F32> {
    asm_floats(f, "wgmma.fence.sync.aligned;", &[], acc)
}

/// `wgmma.commit_group.sync.aligned`: the warpgroup's wgmmas since the last commit form a group.
pub(crate) fn wgmma_commit(f: &mut Func) {
    f.s("call void asm sideeffect \"wgmma.commit_group.sync.aligned;\", \"~{memory}\"() #1");
}

/// `wgmma.wait_group.sync.aligned {pending}`, threaded through every accumulator.
pub(crate) fn wgmma_wait(f: &mut Func, pending: u32, acc: &[F32]) -> Vec<F32> {
    asm_floats(f, &format!("wgmma.wait_group.sync.aligned {pending};"), &[], acc)
}

/// `wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{dtype}.{dtype}`: `acc += A·B` for one m64
/// operand, both from shared-memory descriptors (`a`, `b`); `acc` holds `n / 2` floats.
pub(crate) fn wgmma_m64k16(f: &mut Func, n: u32, dtype: &str, a: &I64, b: &I64, acc: &[F32]) -> Vec<F32> {
    let per = n / 2;
    let regs: Vec<String> = (0..per).map(|i| format!("${i}")).collect();
    let insn = format!(
        "{{ .reg .pred p; setp.ne.b32 p, ${}, 0; \
         wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{dtype}.{dtype} {{{}}}, ${}, ${}, p, 1, 1, 0, 0; }}",
        per + 2,
        regs.join(","),
        per,
        per + 1
    );
    asm_floats(f, &insn, &[("l", a), ("l", b), ("r", &i32c(1))], acc)
}

// ---- loads ----

/// `ld.relaxed.gpu.global.b32`: a word other CTAs of the grid update by atomics, read where it
/// is issued (an `asm sideeffect`, which LLVM neither sinks to its use nor merges), so its
/// latency can run under the work placed between it and the use.
pub(crate) fn ld_relaxed_gpu(f: &mut Func, addr: &Ptr<Global>) -> I32 {
    f.typed(format!("call i32 asm sideeffect \"ld.relaxed.gpu.global.b32 $0, [$1];\", \"=r,l,~{{memory}}\"(ptr addrspace(1) {addr}) #1"))
}

// ---- clusters ----

/// `%cluster_ctarank`: this CTA's rank in its cluster.
pub(crate) fn cluster_ctarank(f: &mut Func) -> I32 {
    f.typed("call i32 asm \"mov.u32 $0, %cluster_ctarank;\", \"=r\"() #1")
}

/// One arrival on the mbarrier at `bar`'s offset in the shared memory of cluster CTA `rank`
/// (`mapa` then a remote `mbarrier.arrive`), with the default CTA-scope release as CUTLASS's
/// `ClusterBarrier::arrive(cta_id)`: the arrival only says this warp's wgmmas finished
/// reading a slot. A cluster-scope release (`.release.cluster`) costs a `MEMBAR.ALL.GPU` per
/// arrival, which made every slice wait for the memory system (1.4x the pair's time).
pub(crate) fn mbarrier_arrive_remote(f: &mut Func, bar: &SharedAddr, rank: &I32) {
    f.s(format!(
        "call void asm sideeffect \"{{ .reg .b32 remote; mapa.shared::cluster.u32 remote, $0, $1; \
         mbarrier.arrive.shared::cluster.b64 _, [remote]; }}\", \"r,r,~{{memory}}\"(i32 {bar}, i32 {rank}) #1"
    ));
}

/// `barrier.cluster.arrive.release` + `wait.acquire` (every thread of the cluster, warps
/// converged): what each CTA wrote before it (mbarrier initialisation, the last remote
/// arrivals) is visible to the others after it.
pub(crate) fn cluster_sync(f: &mut Func) {
    f.s("call void asm sideeffect \"barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;\", \"~{memory}\"() #1");
}

// ---- warp votes ----

/// `match.any.sync.b32` over the full warp: the lanes whose `v` equals this lane's.
pub(crate) fn match_any(f: &mut Func, v: &I32) -> I32 {
    f.typed(format!("call i32 asm sideeffect \"match.any.sync.b32 $0, $1, -1;\", \"=r,r\"(i32 {v}) #1"))
}

// ---- registers, barriers, timers ----

/// `v` through a `mov.b32` LLVM cannot see into: a per-thread base address whose known zero
/// bits would otherwise let InstCombine turn `base + constant` into `or`, which the backend
/// cannot fold into a load's or store's immediate offset (every such sum then takes a register
/// of its own, and the loop-invariant ones were hoisted and spilled).
pub(crate) fn opaque(f: &mut Func, v: &I32) -> I32 {
    f.typed(format!("call i32 asm \"mov.b32 $0, $1;\", \"=r,r\"(i32 {v})"))
}

/// `s + t` where `p`, else `s`: a predicated 64-bit add (no side effect, so LLVM may move
/// or drop it). LLVM writes `s + (p ? t : 0)`, and folds a `p` that is an `and` of two
/// flags into two nested selects: four `SEL`s a term where this takes none (the logsumexp
/// terms' window sums, `lse::column_sums`).
pub(crate) fn add_if(f: &mut Func, p: &I1, s: &I64, t: &I64) -> I64 {
    f.typed(format!("call i64 asm \"{{ mov.b64 $0, $1; @$3 add.s64 $0, $1, $2; }}\", \"=l,l,l,b\"(i64 {s}, i64 {t}, i1 {p})"))
}

/// `setmaxnreg.{inc|dec}.sync.aligned.u32`: the warpgroup's registers per thread become `regs`.
pub(crate) fn setmaxnreg(f: &mut Func, increase: bool, regs: u32) {
    let op = if increase { "inc" } else { "dec" };
    f.s(format!("call void asm sideeffect \"setmaxnreg.{op}.sync.aligned.u32 {regs};\", \"~{{memory}}\"() #1"));
}

/// Sleeps (`nanosleep` in a loop on `%globaltimer`) until `ns` nanoseconds have passed.
pub(crate) fn sleep_ns(f: &mut Func, ns: u64) {
    f.s(format!(
        "call void asm sideeffect \"{{ .reg .u64 t0, t1, d; .reg .pred p; mov.u64 t0, %globaltimer; \
         FS_STAGGER: nanosleep.u32 256; mov.u64 t1, %globaltimer; sub.u64 d, t1, t0; \
         setp.lt.u64 p, d, {ns}; @p bra FS_STAGGER; }}\", \"~{{memory}}\"() #1"
    ));
}
