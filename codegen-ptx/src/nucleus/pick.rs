//! `flashsample_nucleus_pick` (one warp): the first `rows` rows of the chunk whose lists could
//! not serve them (status `ListOverflow` or `NucleusTooLarge`), in row order, and their count;
//! zeroes the draw's counters. The chain's cut applies the row's whole filter (top-k, min-p,
//! top-p) to its sorted row, so it serves a row whose top-k overflowed its tile lists exactly
//! as longer lists would. Later such rows keep their status (DESIGN.md: the host API serves
//! them, the device API reports them), and so do a verifying launch's draft rows (the decision
//! reads their lists, not a sample).

use super::popc;
use crate::ir::{i32c, Func, Icmp, Int, Var, I1, I32, I64};
use crate::params::{arg, NUCLEUS_PICK};
use flashsample_abi::RowStatus;

pub(crate) const NAME: &str = "flashsample_nucleus_pick";

/// `verify`: the pipeline verifies drafts (its draft rows are skipped).
pub(super) fn emit(verify: bool) -> String {
    let mut f = Func::new();
    let lane = f.sreg("tid.x");
    let lt = f.shl(&i32c(1), &lane);
    let lt = f.sub(&lt, &i32c(1));
    let count = f.var(&i32c(0));
    f.for_loop(&i32c(0), &arg::BATCH, &i32c(32), |f, base| {
        let r = f.add(base, &lane);
        let inside = f.icmp(Icmp::Ult, &r, &arg::BATCH);
        let rs = f.sel(&inside, &r, &i32c(0));
        let r64 = f.zext(&rs);
        let a = f.gaddr(&arg::STATUS, &r64, 4);
        let st: I32 = f.load(&a, 4);
        let too_large = f.icmp(Icmp::Eq, &st, &I32::c(RowStatus::NucleusTooLarge.code()));
        let overflow = f.icmp(Icmp::Eq, &st, &I32::c(RowStatus::ListOverflow.code()));
        let unserved = f.or(&too_large, &overflow);
        let hit = f.and(&inside, &unserved);
        let hit = if verify {
            let draft = crate::stage1::is_draft_row(f, &r);
            let bonus = f.not(&draft);
            f.and(&hit, &bonus)
        } else {
            hit
        };
        let slot = next_slot(f, &lt, &count, &hit);
        let fits = f.icmp(Icmp::Ult, &slot, &arg::ROWS);
        let store = f.and(&hit, &fits);
        f.if_then(&store, |f| {
            let s64 = f.zext(&slot);
            let a = f.gaddr(&arg::PICKS, &s64, 4);
            f.store(&r, &a, 4);
        });
    });
    let c = f.get(&count);
    let over = f.icmp(Icmp::Ugt, &c, &arg::ROWS);
    let picked = f.sel(&over, &arg::ROWS, &c);
    let lane0 = f.icmp(Icmp::Eq, &lane, &i32c(0));
    f.if_then(&lane0, |f| {
        let r64 = f.zext(&arg::ROWS);
        let a = f.gaddr(&arg::PICKS, &r64, 4);
        f.store(&picked, &a, 4);
    });
    let slots = f.mul(&arg::ROWS, &arg::SAMPLES);
    f.for_loop(&lane, &slots, &i32c(32), |f, i| {
        let i64 = f.zext(i);
        let a = f.gaddr(&arg::BEST, &i64, 8);
        f.store(&I64::c(0), &a, 8);
    });
    f.for_loop(&lane, &arg::ROWS, &i32c(32), |f, i| {
        let i64 = f.zext(i);
        let a = f.gaddr(&arg::DONE, &i64, 4);
        f.store(&i32c(0), &a, 4);
    });
    f.ret_void();
    f.finish(&NUCLEUS_PICK.llvm_header(NAME, "\"nvvm.maxntid\"=\"32\""))
}

/// Ballot compaction over one warp's rows: this lane's slot among the rows hit so far
/// (`count` plus the hits of the lanes below it, `lt` their mask); advances `count` past the
/// warp's hits.
pub(super) fn next_slot(f: &mut Func, lt: &I32, count: &Var<I32>, hit: &I1) -> I32 {
    let ballot = f.ballot(hit);
    let before = f.and(&ballot, lt);
    let before = popc(f, &before);
    let c = f.get(count);
    let slot = f.add(&c, &before);
    let all = popc(f, &ballot);
    let c1 = f.add(&c, &all);
    f.set(count, &c1);
    slot
}
