//! Warp and block primitives on [`Func`]: shuffles of any 32- or 64-bit value, `redux`,
//! `ballot`, the CTA (or named) barrier and the special registers.

use super::value::{Int, Value, F32, F64, I1, I32, I64};
use super::{i32c, Func};

/// A value the lanes of a warp can exchange: one `shfl.sync` per 32-bit word.
pub(crate) trait Shuffle: Value {
    /// The value of lane `lane ^ mask`.
    fn shfl_xor(f: &mut Func, v: &Self, mask: u32) -> Self;
}

impl Shuffle for I32 {
    fn shfl_xor(f: &mut Func, v: &I32, mask: u32) -> I32 {
        f.call("@llvm.nvvm.shfl.sync.bfly.i32", &[&i32c(-1), v, &i32c(mask), &i32c(31)])
    }
}

impl Shuffle for F32 {
    fn shfl_xor(f: &mut Func, v: &F32, mask: u32) -> F32 {
        let i: I32 = f.bitcast(v);
        let o = f.shfl_xor(&i, mask);
        f.bitcast(&o)
    }
}

impl Shuffle for F64 {
    fn shfl_xor(f: &mut Func, v: &F64, mask: u32) -> F64 {
        let b: I64 = f.bitcast(v);
        let lo: I32 = f.trunc(&b);
        let hi = f.lshr(&b, &I64::c(32));
        let hi: I32 = f.trunc(&hi);
        let lo = f.shfl_xor(&lo, mask);
        let hi = f.shfl_xor(&hi, mask);
        let lo: I64 = f.zext(&lo);
        let hi: I64 = f.zext(&hi);
        let hi = f.shl(&hi, &I64::c(32));
        let b = f.or(&hi, &lo);
        f.bitcast(&b)
    }
}

/// Items a [`Func::reduce_scatter`] takes: one per lane of the 8 that share them.
pub(crate) const SCATTER_ITEMS: usize = 8;

impl Func {
    /// A reduce-scatter of a lane's [`SCATTER_ITEMS`] `items` over the 8 lanes that share them
    /// (the lanes of one `lane & 3`): at xor 16, 8 and 4 each lane keeps half of its items
    /// (the upper half where its lane bit is set), trades the other half with its partner
    /// (`shuffle`) and merges each kept item with the one it receives (`merge`), so lane
    /// `lane` ends with item `lane >> 2` merged over the 8 lanes (bit 2 of `lane >> 2` from
    /// xor 16, bit 1 from xor 8, bit 0 from xor 4). `merge` must give the same result in any
    /// order (associative and commutative); `select(c, a, b)` is `a` where `c`, else `b`.
    /// Every lane of the warp must call it.
    pub(crate) fn reduce_scatter<T>(
        &mut self,
        lane: &I32,
        items: Vec<T>,
        select: impl Fn(&mut Func, &I1, &T, &T) -> T,
        shuffle: impl Fn(&mut Func, &T, u32) -> T,
        merge: impl Fn(&mut Func, T, T) -> T,
    ) -> T {
        assert_eq!(items.len(), SCATTER_ITEMS, "a reduce-scatter takes one item per lane group");
        let mut cur = items;
        for mask in [16u32, 8, 4] {
            let bit = self.and(lane, &i32c(mask));
            let upper = self.icmp(super::Icmp::Ne, &bit, &i32c(0));
            let hi = cur.split_off(cur.len() / 2);
            cur = cur
                .iter()
                .zip(&hi)
                .map(|(lo, hi)| {
                    let send = select(self, &upper, lo, hi);
                    let keep = select(self, &upper, hi, lo);
                    let got = shuffle(self, &send, mask);
                    merge(self, keep, got)
                })
                .collect();
        }
        cur.pop().expect("the reduce-scatter leaves one item")
    }

    /// Lane `lane ^ mask`'s `v` (the full warp takes part).
    pub(crate) fn shfl_xor<T: Shuffle>(&mut self, v: &T, mask: u32) -> T {
        T::shfl_xor(self, v, mask)
    }

    /// Lane `lane + delta`'s `v` (its own past the warp's end).
    pub(crate) fn shfl_down(&mut self, v: &I32, delta: u32) -> I32 {
        self.call("@llvm.nvvm.shfl.sync.down.i32", &[&i32c(-1), v, &i32c(delta), &i32c(31)])
    }

    /// Warp-wide unsigned max (`redux.sync.max.u32`, sm_80+); every lane must take part.
    pub(crate) fn redux_umax(&mut self, v: &I32) -> I32 {
        self.call("@llvm.nvvm.redux.sync.umax", &[v, &i32c(-1)])
    }

    /// `vote.sync.ballot.b32` over the full warp: bit `l` is lane `l`'s `p`.
    pub(crate) fn ballot(&mut self, p: &I1) -> I32 {
        self.call("@llvm.nvvm.vote.ballot.sync", &[&i32c(-1), p])
    }

    /// The barrier of the threads that run this code: the CTA (`bar.sync 0`), or inside
    /// [`Func::with_barrier_scope`] its named barrier.
    pub(crate) fn barrier(&mut self) {
        match self.barrier_scope.clone() {
            None => self.s("call void asm sideeffect \"bar.sync 0;\", \"~{memory}\"() #1"),
            Some((id, threads)) => self.s(format!(
                "call void asm sideeffect \"bar.sync $0, {threads};\", \"r,~{{memory}}\"(i32 {id}) #1"
            )),
        }
    }

    /// Runs `body` with [`Func::barrier`] scoped to named barrier `id` of `threads`.
    pub(crate) fn with_barrier_scope(&mut self, id: &I32, threads: u32, body: impl FnOnce(&mut Func)) {
        let outer = self.barrier_scope.replace((id.clone(), threads));
        body(self);
        self.barrier_scope = outer;
    }

    /// The special register `%name` (`tid.x`, `ctaid.y`, `nsmid`, ...).
    pub(crate) fn sreg(&mut self, name: &str) -> I32 {
        self.call(&format!("@llvm.nvvm.read.ptx.sreg.{name}"), &[])
    }
}
