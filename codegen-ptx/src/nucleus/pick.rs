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
    let lane = f.sreg_u("tid.x");
    let lt = f.v(format!("shl i32 1, {lane}"));
    let lt = f.v(format!("sub i32 {lt}, 1"));
    let count = f.var_u("i32", "0");
    f.for_loop_u("0", "%batch", "32", |f, base| {
        let r = f.add_u(base, &lane);
        let inside = f.ult_u(&r, "%batch");
        let rs = f.sel_u("i32", &inside, &r, "0");
        let r64 = f.zext64_u(&rs);
        let a = f.gaddr_u("%status", &r64, 4);
        let st = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
        let too_large = f.v(format!("icmp eq i32 {st}, {}", RowStatus::NucleusTooLarge.code()));
        let hit = f.and1_u(&inside, &too_large);
        let hit = if verify {
            let draft = crate::stage1::is_draft_row(f, &r);
            let bonus = f.v(format!("xor i1 {draft}, true"));
            f.and1_u(&hit, &bonus)
        } else {
            hit
        };
        let ballot = f.ballot_u(&hit);
        let before = f.v(format!("and i32 {ballot}, {lt}"));
        let before = popc(f, &before);
        let c = f.get_u(&count);
        let slot = f.add_u(&c, &before);
        let fits = f.ult_u(&slot, "%rows");
        let store = f.and1_u(&hit, &fits);
        f.if_then_u(&store, |f| {
            let s64 = f.zext64_u(&slot);
            let a = f.gaddr_u("%picks", &s64, 4);
            f.s(format!("store i32 {r}, ptr addrspace(1) {a}, align 4"));
        });
        let all = popc(f, &ballot);
        let c1 = f.add_u(&c, &all);
        f.set_u(&count, &c1);
    });
    let c = f.get_u(&count);
    let over = f.v(format!("icmp ugt i32 {c}, %rows"));
    let picked = f.sel_u("i32", &over, "%rows", &c);
    let lane0 = f.v(format!("icmp eq i32 {lane}, 0"));
    f.if_then_u(&lane0, |f| {
        let r64 = f.zext64_u("%rows");
        let a = f.gaddr_u("%picks", &r64, 4);
        f.s(format!("store i32 {picked}, ptr addrspace(1) {a}, align 4"));
    });
    let slots = f.mul_u("%rows", "%samples");
    f.for_loop_u(&lane, &slots, "32", |f, i| {
        let i64 = f.zext64_u(i);
        let a = f.gaddr_u("%best", &i64, 8);
        f.s(format!("store i64 0, ptr addrspace(1) {a}, align 8"));
    });
    f.for_loop_u(&lane, "%rows", "32", |f, i| {
        let i64 = f.zext64_u(i);
        let a = f.gaddr_u("%done", &i64, 4);
        f.s(format!("store i32 0, ptr addrspace(1) {a}, align 4"));
    });
    f.s("ret void");
    f.finish(&NUCLEUS_PICK.llvm_header(NAME, "\"nvvm.maxntid\"=\"32\""))
}
