//! A small LLVM-IR text writer: fresh SSA names, entry-block allocas for mutable values
//! (promoted to registers by `mem2reg`), structured loops and ifs, and typed SSA values
//! (`value.rs`: [`I1`], [`I32`], [`I64`], [`F32`], [`F64`], [`Ptr`] by address space,
//! [`SharedAddr`], ...) with typed instructions on them (`ops.rs`) and warp and block
//! primitives (`warp.rs`). Inline PTX lives in `ptx` (one function per instruction family).
//!
//! The kernels are emitted as textual LLVM IR and parsed by LLVM (through inkwell), so the
//! generated code reads like the PTX it becomes and every instruction is visible in review.
//! Every instruction takes and returns typed values, so code that passes an i64 where an i32
//! goes, a float where a predicate goes, or a global pointer where a shared address goes does
//! not compile: rustc rejects it, not LLVM's parser at run time. [`Func::v`] and [`Func::s`]
//! remain for what has no single typed result: labels and branches, inline asm, aggregates.

mod ops;
mod value;
mod warp;

use std::fmt::Write;
use std::marker::PhantomData;

pub(crate) use ops::{Atomic, Fcmp, Icmp};
pub(crate) use value::{f32c, f64c, i32c, Agg, Float, Generic, Global, Int, Operand, Ptr, Shared, SharedAddr, Value, F16, F32, F64, I1, I128, I16, I32, I64, X4};
pub(crate) use warp::{Shuffle, SCATTER_ITEMS};

/// One function body under construction.
pub(crate) struct Func {
    allocas: String,
    body: String,
    next: u32,
    /// What [`Func::barrier`] synchronises: `None` is the whole CTA (`bar.sync 0`); `Some((id,
    /// threads))` a named barrier of `threads` threads, for code that one warp-specialized
    /// consumer set runs while the rest of the CTA does other work.
    barrier_scope: Option<(I32, u32)>,
}

/// A mutable value of type `T`: an entry-block alloca.
pub(crate) struct Var<T> {
    ptr: String,
    _ty: PhantomData<T>,
}

impl Func {
    pub(crate) fn new() -> Self {
        Func {
            allocas: String::new(),
            body: String::new(),
            next: 0,
            barrier_scope: None,
        }
    }

    fn fresh(&mut self, prefix: &str) -> String {
        self.next += 1;
        format!("{prefix}{}", self.next)
    }

    /// Emits `%vN = rhs` and returns `%vN`: for results that are not one typed value (inline
    /// asm returning several, aggregates).
    pub(crate) fn v(&mut self, rhs: impl AsRef<str>) -> String {
        let name = self.fresh("%v");
        let _ = writeln!(self.body, "  {name} = {}", rhs.as_ref());
        name
    }

    /// Emits `%vN = rhs` whose result has type `T`, and returns it typed.
    pub(crate) fn typed<T: Value>(&mut self, rhs: impl AsRef<str>) -> T {
        T::raw(self.v(rhs))
    }

    /// Emits `%vN = rhs` whose result is an aggregate of type `ty` (an inline asm's several
    /// results), and returns it.
    pub(crate) fn agg(&mut self, ty: impl Into<std::borrow::Cow<'static, str>>, rhs: impl AsRef<str>) -> Agg {
        let ty = ty.into();
        Agg::raw(ty, self.v(rhs))
    }

    /// Emits a statement without a result.
    pub(crate) fn s(&mut self, stmt: impl AsRef<str>) {
        let _ = writeln!(self.body, "  {}", stmt.as_ref());
    }

    pub(crate) fn label(&mut self, hint: &str) -> String {
        self.fresh(&format!("{hint}."))
    }

    pub(crate) fn place(&mut self, label: &str) {
        let _ = writeln!(self.body, "{label}:");
    }

    pub(crate) fn br(&mut self, label: &str) {
        self.s(format!("br label %{label}"));
    }

    fn cond_br(&mut self, cond: &I1, yes: &str, no: &str) {
        self.s(format!("br i1 {cond}, label %{yes}, label %{no}"));
    }

    /// A mutable value (an entry-block alloca) initialised here to `init`.
    pub(crate) fn var<T: Value>(&mut self, init: &T) -> Var<T> {
        let ptr = self.fresh("%m");
        let _ = writeln!(self.allocas, "  {ptr} = alloca {}", T::LLVM);
        let var = Var { ptr, _ty: PhantomData };
        self.set(&var, init);
        var
    }

    pub(crate) fn get<T: Value>(&mut self, var: &Var<T>) -> T {
        self.typed(format!("load {}, ptr {}", T::LLVM, var.ptr))
    }

    pub(crate) fn set<T: Value>(&mut self, var: &Var<T>, value: &T) {
        self.s(format!("store {} {value}, ptr {}", T::LLVM, var.ptr));
    }

    /// `for (i = start; i < end (unsigned); i += step) body(i)`.
    pub(crate) fn for_loop(&mut self, start: &I32, end: &I32, step: &I32, body: impl FnOnce(&mut Func, &I32)) {
        let i = self.var(start);
        let head = self.label("loop");
        let inner = self.label("body");
        let exit = self.label("done");
        self.br(&head);
        self.place(&head);
        let iv = self.get(&i);
        let go = self.icmp(Icmp::Ult, &iv, end);
        self.cond_br(&go, &inner, &exit);
        self.place(&inner);
        body(self, &iv);
        let nx = self.add(&iv, step);
        self.set(&i, &nx);
        self.br(&head);
        self.place(&exit);
    }

    /// `while (cond()) body()`: `cond` emits the test (evaluated before every iteration).
    pub(crate) fn while_loop(&mut self, cond: impl FnOnce(&mut Func) -> I1, body: impl FnOnce(&mut Func)) {
        let head = self.label("while");
        let inner = self.label("wbody");
        let exit = self.label("wdone");
        self.br(&head);
        self.place(&head);
        let go = cond(self);
        self.cond_br(&go, &inner, &exit);
        self.place(&inner);
        body(self);
        self.br(&head);
        self.place(&exit);
    }

    pub(crate) fn if_then(&mut self, cond: &I1, then: impl FnOnce(&mut Func)) {
        let yes = self.label("then");
        let join = self.label("endif");
        self.cond_br(cond, &yes, &join);
        self.place(&yes);
        then(self);
        self.br(&join);
        self.place(&join);
    }

    pub(crate) fn if_else(&mut self, cond: &I1, then: impl FnOnce(&mut Func), otherwise: impl FnOnce(&mut Func)) {
        let yes = self.label("then");
        let no = self.label("else");
        let join = self.label("endif");
        self.cond_br(cond, &yes, &no);
        self.place(&yes);
        then(self);
        self.br(&join);
        self.place(&no);
        otherwise(self);
        self.br(&join);
        self.place(&join);
    }

    /// `ret void`: the end of a kernel.
    pub(crate) fn ret_void(&mut self) {
        self.s("ret void");
    }

    /// `ret T v`: returns `v` from a helper function.
    pub(crate) fn ret<T: Value>(&mut self, v: &T) {
        self.s(format!("ret {} {v}", T::LLVM));
    }

    /// Returns the aggregate `v` from a helper function.
    pub(crate) fn ret_agg(&mut self, v: &Agg) {
        self.s(format!("ret {} {v}", v.ty()));
    }

    /// The function text: `header {` entry allocas, body, `}`.
    pub(crate) fn finish(self, header: &str) -> String {
        format!("{header} {{\nentry:\n{}{}}}\n", self.allocas, self.body)
    }
}


/// Declarations every module needs (intrinsics, attribute groups).
pub(crate) const PRELUDE: &str = r#"target triple = "nvptx64-nvidia-cuda"

declare i32 @llvm.nvvm.read.ptx.sreg.tid.x()
declare i32 @llvm.nvvm.read.ptx.sreg.ctaid.x()
declare i32 @llvm.nvvm.read.ptx.sreg.ctaid.y()
declare i32 @llvm.nvvm.read.ptx.sreg.nctaid.x()
declare i32 @llvm.nvvm.read.ptx.sreg.nctaid.y()
declare i32 @llvm.nvvm.shfl.sync.bfly.i32(i32, i32, i32, i32)
declare i32 @llvm.nvvm.shfl.sync.down.i32(i32, i32, i32, i32)
declare i32 @llvm.nvvm.redux.sync.umax(i32, i32)
declare i32 @llvm.nvvm.vote.ballot.sync(i32, i1)
declare i32 @llvm.cttz.i32(i32, i1)
declare i32 @llvm.ctlz.i32(i32, i1)
declare i32 @llvm.umax.i32(i32, i32)
declare float @llvm.nvvm.add.rn.f(float, float)
declare float @llvm.nvvm.mul.rn.f(float, float)
declare float @llvm.nvvm.div.rn.f(float, float)
declare float @llvm.nvvm.rcp.approx.ftz.f(float)
declare float @llvm.nvvm.fma.rn.f(float, float, float)
declare float @llvm.fabs.f32(float)
declare float @llvm.maxnum.f32(float, float)
declare float @llvm.minnum.f32(float, float)
declare float @llvm.copysign.f32(float, float)
declare float @llvm.roundeven.f32(float)

attributes #0 = { alwaysinline nounwind }
attributes #1 = { convergent nounwind }
attributes #2 = { noinline nounwind }
attributes #3 = { noinline convergent nounwind }
attributes #4 = { alwaysinline convergent nounwind }
"#;
