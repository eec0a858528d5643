//! `flashsample_nucleus_pick` (one warp): the first `rows` rows of the chunk whose status is
//! `NucleusTooLarge`, in row order, and their count; zeroes the draw's counters. Later rows of
//! status 4 keep it (DESIGN.md: the host API serves them, the device API reports them), and so
//! do a verifying launch's draft rows (the decision reads their lists, not a sample).

use super::popc;
use crate::ir::Func;
use crate::params::NUCLEUS_PICK;
use flashsample_abi::RowStatus;

pub(crate) const NAME: &str = "flashsample_nucleus_pick";

/// `verify`: the pipeline verifies drafts (its draft rows are skipped).
pub(super) fn emit(verify: bool) -> String {
    let mut f = Func::new();
    let lane = f.sreg("tid.x");
    let lt = f.v(format!("shl i32 1, {lane}"));
    let lt = f.v(format!("sub i32 {lt}, 1"));
    let count = f.var("i32", "0");
    f.for_loop("0", "%batch", "32", |f, base| {
        let r = f.add(base, &lane);
        let inside = f.ult(&r, "%batch");
        let rs = f.sel("i32", &inside, &r, "0");
        let r64 = f.zext64(&rs);
        let a = f.gaddr("%status", &r64, 4);
        let st = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
        let too_large = f.v(format!("icmp eq i32 {st}, {}", RowStatus::NucleusTooLarge.code()));
        let hit = f.and1(&inside, &too_large);
        let hit = if verify {
            let draft = crate::stage1::is_draft_row(f, &r);
            let bonus = f.v(format!("xor i1 {draft}, true"));
            f.and1(&hit, &bonus)
        } else {
            hit
        };
        let ballot = f.ballot(&hit);
        let before = f.v(format!("and i32 {ballot}, {lt}"));
        let before = popc(f, &before);
        let c = f.get(&count);
        let slot = f.add(&c, &before);
        let fits = f.ult(&slot, "%rows");
        let store = f.and1(&hit, &fits);
        f.if_then(&store, |f| {
            let s64 = f.zext64(&slot);
            let a = f.gaddr("%picks", &s64, 4);
            f.s(format!("store i32 {r}, ptr addrspace(1) {a}, align 4"));
        });
        let all = popc(f, &ballot);
        let c1 = f.add(&c, &all);
        f.set(&count, &c1);
    });
    let c = f.get(&count);
    let over = f.v(format!("icmp ugt i32 {c}, %rows"));
    let picked = f.sel("i32", &over, "%rows", &c);
    let lane0 = f.v(format!("icmp eq i32 {lane}, 0"));
    f.if_then(&lane0, |f| {
        let r64 = f.zext64("%rows");
        let a = f.gaddr("%picks", &r64, 4);
        f.s(format!("store i32 {picked}, ptr addrspace(1) {a}, align 4"));
    });
    let slots = f.mul("%rows", "%samples");
    f.for_loop(&lane, &slots, "32", |f, i| {
        let i64 = f.zext64(i);
        let a = f.gaddr("%best", &i64, 8);
        f.s(format!("store i64 0, ptr addrspace(1) {a}, align 8"));
    });
    f.for_loop(&lane, "%rows", "32", |f, i| {
        let i64 = f.zext64(i);
        let a = f.gaddr("%done", &i64, 4);
        f.s(format!("store i32 0, ptr addrspace(1) {a}, align 4"));
    });
    f.s("ret void");
    f.finish(&NUCLEUS_PICK.llvm_header(NAME, "\"nvvm.maxntid\"=\"32\""))
}
