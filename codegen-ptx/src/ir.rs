//! A small LLVM-IR text writer: fresh SSA names, entry-block allocas for mutable values
//! (promoted to registers by `mem2reg`), structured loops and ifs, warp and block primitives,
//! and typed SSA values ([`I1`], [`I32`], [`I64`], [`F32`], [`Ptr`] by address space,
//! [`SharedAddr`]). Inline PTX lives in `ptx` (one function per instruction family).
//!
//! The kernels are emitted as textual LLVM IR and parsed by LLVM (through inkwell), so the
//! generated code reads like the PTX it becomes and every instruction is visible in review.
//! The typed values wrap an SSA name (or constant) with its LLVM type, so that the instruction
//! wrappers, the rings and the mainloops cannot pass an i64 where an i32 goes or a global
//! pointer where a shared address goes: rustc rejects it, not LLVM's parser at run time.
//! Much of the epilogue still passes plain `String`s through [`Func::v`]; a typed value is
//! made from one with `T::raw` at that boundary.

use std::fmt::{self, Write};
use std::marker::PhantomData;

/// A typed SSA value: implemented by the value newtypes.
pub(crate) trait Value: fmt::Display {
    /// The value's LLVM type.
    const LLVM: &'static str;
    /// Wraps IR text (an SSA name or a constant) that has this type.
    fn raw(text: impl Into<String>) -> Self;
    /// The IR text.
    fn text(&self) -> &str;
}

macro_rules! value {
    ($(#[$doc:meta])* $name:ident, $llvm:literal) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub(crate) struct $name(String);

        impl Value for $name {
            const LLVM: &'static str = $llvm;
            fn raw(text: impl Into<String>) -> Self {
                $name(text.into())
            }
            fn text(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

value!(
    /// An `i1` (predicate).
    I1, "i1"
);
value!(
    /// An `i32`.
    I32, "i32"
);
value!(
    /// An `i64`.
    I64, "i64"
);
value!(
    /// A `float`.
    F32, "float"
);
value!(
    /// A 32-bit shared-window address (`cvta`-free `.shared` operands of inline PTX: cp.async
    /// destinations, ldmatrix rows, mbarriers). Not interchangeable with an `i32` count.
    SharedAddr, "i32"
);

/// An address space of [`Ptr`].
pub(crate) trait Space {
    /// The LLVM pointer type in this space.
    const LLVM: &'static str;
}

/// Global memory (`addrspace(1)`): kernel parameters, candidates, lists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Global;
/// Shared memory (`addrspace(3)`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Shared;

impl Space for Global {
    const LLVM: &'static str = "ptr addrspace(1)";
}
impl Space for Shared {
    const LLVM: &'static str = "ptr addrspace(3)";
}

/// A pointer in address space `S`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ptr<S: Space>(String, PhantomData<S>);

impl<S: Space> Value for Ptr<S> {
    const LLVM: &'static str = S::LLVM;
    fn raw(text: impl Into<String>) -> Self {
        Ptr(text.into(), PhantomData)
    }
    fn text(&self) -> &str {
        &self.0
    }
}

impl<S: Space> fmt::Display for Ptr<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<S: Space> AsRef<str> for Ptr<S> {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// An `i32` constant.
pub(crate) fn i32c(v: u32) -> I32 {
    I32(v.to_string())
}

/// An f32 constant in LLVM's exact hexadecimal form (the f32 value widened to f64 bits).
pub(crate) fn f32c(v: f32) -> String {
    format!("0x{:016X}", f64::from(v).to_bits())
}

/// One function body under construction.
pub(crate) struct Func {
    allocas: String,
    body: String,
    next: u32,
    /// What [`Func::barrier`] synchronises: `None` is the whole CTA (`bar.sync 0`); `Some((id,
    /// threads))` a named barrier of `threads` threads, for code that one warp-specialized
    /// consumer set runs while the rest of the CTA does other work.
    barrier_scope: Option<(String, u32)>,
}

/// `-inf` as an LLVM float literal.
pub(crate) const NEG_INF: &str = "0xFFF0000000000000";

/// `+inf` as an LLVM float literal.
pub(crate) const POS_INF: &str = "0x7FF0000000000000";

impl Func {
    /// `abi::StageTwo::beats`: candidate 1 beats candidate 2 (higher score, ties to the lower index).
    pub(crate) fn beats(&mut self, s1: &str, i1: &str, s2: &str, i2: &str) -> String {
        let gt = self.v(format!("fcmp ogt float {s1}, {s2}"));
        let eq = self.v(format!("fcmp oeq float {s1}, {s2}"));
        let lo = self.v(format!("icmp ult i32 {i1}, {i2}"));
        let tie = self.and1(&eq, &lo);
        self.v(format!("or i1 {gt}, {tie}"))
    }

    /// The better of two (score, index, payload) candidates by [`Func::beats`]: `other`
    /// where it beats `best`, else `best`.
    pub(crate) fn keep_best(&mut self, best: (String, String, String), other: (&str, &str, &str)) -> (String, String, String) {
        let (bs, bi, bp) = best;
        let (os, oi, op) = other;
        let take = self.beats(os, oi, &bs, &bi);
        (self.sel("float", &take, os, &bs), self.sel("i32", &take, oi, &bi), self.sel("float", &take, op, &bp))
    }

    /// [`Func::keep_best`] over the lanes of a warp: one butterfly step per shuffle mask in
    /// `masks`, so the lanes the masks span end with their best candidate.
    pub(crate) fn shfl_best(&mut self, mut best: (String, String, String), masks: &[u32]) -> (String, String, String) {
        for &sh in masks {
            let os = self.shfl_xor_f32(&best.0, sh);
            let oi = self.shfl_xor_i32(&best.1, sh);
            let op = self.shfl_xor_f32(&best.2, sh);
            best = self.keep_best(best, (&os, &oi, &op));
        }
        best
    }

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

    /// Emits `%vN = rhs` and returns `%vN`.
    pub(crate) fn v(&mut self, rhs: impl AsRef<str>) -> String {
        let name = self.fresh("%v");
        let _ = writeln!(self.body, "  {name} = {}", rhs.as_ref());
        name
    }

    /// Emits `%vN = rhs` whose result has type `T`, and returns it typed.
    pub(crate) fn typed<T: Value>(&mut self, rhs: impl AsRef<str>) -> T {
        T::raw(self.v(rhs))
    }

    /// `a + b` (i32, wrapping).
    pub(crate) fn add32(&mut self, a: &I32, b: &I32) -> I32 {
        self.typed(format!("add i32 {a}, {b}"))
    }

    /// `a · b` (i32, wrapping).
    pub(crate) fn mul32(&mut self, a: &I32, b: &I32) -> I32 {
        self.typed(format!("mul i32 {a}, {b}"))
    }

    /// `a <u b` (i32).
    pub(crate) fn ult32(&mut self, a: &I32, b: &I32) -> I1 {
        self.typed(format!("icmp ult i32 {a}, {b}"))
    }

    /// Stores `v` at `ptr` (aligned to `align` bytes).
    pub(crate) fn store<T: Value, S: Space>(&mut self, v: &T, ptr: &Ptr<S>, align: u32) {
        self.s(format!("store {} {v}, {} {ptr}, align {align}", T::LLVM, S::LLVM));
    }

    /// The value at `ptr` (aligned to `align` bytes).
    pub(crate) fn load<T: Value, S: Space>(&mut self, ptr: &Ptr<S>, align: u32) -> T {
        self.typed(format!("load {}, {} {ptr}, align {align}", T::LLVM, S::LLVM))
    }

    /// `ptr + bytes`.
    pub(crate) fn offset<S: Space>(&mut self, ptr: &Ptr<S>, bytes: u32) -> Ptr<S> {
        let index = if S::LLVM == Global::LLVM { "i64" } else { "i32" };
        self.typed(format!("getelementptr i8, {} {ptr}, {index} {bytes}", S::LLVM))
    }

    /// The shared address `base + off` bytes.
    pub(crate) fn shared_offset(&mut self, base: &SharedAddr, off: &I32) -> SharedAddr {
        self.typed(format!("add i32 {base}, {off}"))
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

    /// A mutable value of type `ty` (an entry-block alloca) initialised here to `init`.
    pub(crate) fn var(&mut self, ty: &str, init: &str) -> Var {
        let ptr = self.fresh("%m");
        let _ = writeln!(self.allocas, "  {ptr} = alloca {ty}");
        let var = Var {
            ptr,
            ty: ty.to_string(),
        };
        self.set(&var, init);
        var
    }

    pub(crate) fn get(&mut self, var: &Var) -> String {
        self.v(format!("load {}, ptr {}", var.ty, var.ptr))
    }

    pub(crate) fn set(&mut self, var: &Var, value: &str) {
        self.s(format!("store {} {value}, ptr {}", var.ty, var.ptr));
    }

    /// `for (i = start; i < end (unsigned); i += step) body(i)`; all i32.
    pub(crate) fn for_loop(
        &mut self,
        start: &str,
        end: &str,
        step: &str,
        body: impl FnOnce(&mut Func, &str),
    ) {
        let i = self.var("i32", start);
        let head = self.label("loop");
        let inner = self.label("body");
        let exit = self.label("done");
        self.br(&head);
        self.place(&head);
        let iv = self.get(&i);
        let go = self.v(format!("icmp ult i32 {iv}, {end}"));
        self.s(format!("br i1 {go}, label %{inner}, label %{exit}"));
        self.place(&inner);
        body(self, &iv);
        let nx = self.v(format!("add i32 {iv}, {step}"));
        self.set(&i, &nx);
        self.br(&head);
        self.place(&exit);
    }

    /// `while (cond()) body()`: `cond` emits the test (evaluated before every iteration).
    pub(crate) fn while_loop(
        &mut self,
        cond: impl FnOnce(&mut Func) -> String,
        body: impl FnOnce(&mut Func),
    ) {
        let head = self.label("while");
        let inner = self.label("wbody");
        let exit = self.label("wdone");
        self.br(&head);
        self.place(&head);
        let go = cond(self);
        self.s(format!("br i1 {go}, label %{inner}, label %{exit}"));
        self.place(&inner);
        body(self);
        self.br(&head);
        self.place(&exit);
    }

    pub(crate) fn if_then(&mut self, cond: &str, then: impl FnOnce(&mut Func)) {
        let yes = self.label("then");
        let join = self.label("endif");
        self.s(format!("br i1 {cond}, label %{yes}, label %{join}"));
        self.place(&yes);
        then(self);
        self.br(&join);
        self.place(&join);
    }

    pub(crate) fn if_else(
        &mut self,
        cond: &str,
        then: impl FnOnce(&mut Func),
        otherwise: impl FnOnce(&mut Func),
    ) {
        let yes = self.label("then");
        let no = self.label("else");
        let join = self.label("endif");
        self.s(format!("br i1 {cond}, label %{yes}, label %{no}"));
        self.place(&yes);
        then(self);
        self.br(&join);
        self.place(&no);
        otherwise(self);
        self.br(&join);
        self.place(&join);
    }

    /// The function text: `header {` entry allocas, body, `}`.
    pub(crate) fn finish(self, header: &str) -> String {
        format!("{header} {{\nentry:\n{}{}}}\n", self.allocas, self.body)
    }

    // ---- integer and address helpers (i32 unless stated) ----

    pub(crate) fn add(&mut self, a: &str, b: &str) -> String {
        self.v(format!("add i32 {a}, {b}"))
    }
    pub(crate) fn mul(&mut self, a: &str, b: &str) -> String {
        self.v(format!("mul i32 {a}, {b}"))
    }
    pub(crate) fn ult(&mut self, a: &str, b: &str) -> String {
        self.v(format!("icmp ult i32 {a}, {b}"))
    }
    pub(crate) fn and1(&mut self, a: &str, b: &str) -> String {
        self.v(format!("and i1 {a}, {b}"))
    }
    pub(crate) fn sel(&mut self, ty: &str, c: &str, a: &str, b: &str) -> String {
        self.v(format!("select i1 {c}, {ty} {a}, {ty} {b}"))
    }
    /// `base + index * scale` bytes on a global pointer, index widened to i64.
    pub(crate) fn gaddr(&mut self, base: &str, index64: &str, scale: u32) -> Ptr<Global> {
        let off = self.v(format!("mul i64 {index64}, {scale}"));
        self.typed(format!(
            "getelementptr i8, ptr addrspace(1) {base}, i64 {off}"
        ))
    }
    pub(crate) fn zext64(&mut self, a: &str) -> String {
        self.v(format!("zext i32 {a} to i64"))
    }
    /// A shared-memory byte pointer at i32 offset `off` from the kernel's shared buffer.
    pub(crate) fn saddr(&mut self, buffer: &str, off: &str) -> Ptr<Shared> {
        self.typed(format!(
            "getelementptr i8, ptr addrspace(3) {buffer}, i32 {off}"
        ))
    }

    // ---- f32 arithmetic with explicit IEEE round-to-nearest (never contracted) ----

    pub(crate) fn fadd(&mut self, a: &str, b: &str) -> String {
        self.v(format!(
            "call float @llvm.nvvm.add.rn.f(float {a}, float {b})"
        ))
    }
    pub(crate) fn fmul(&mut self, a: &str, b: &str) -> String {
        self.v(format!(
            "call float @llvm.nvvm.mul.rn.f(float {a}, float {b})"
        ))
    }
    pub(crate) fn fdiv(&mut self, a: &str, b: &str) -> String {
        self.v(format!(
            "call float @llvm.nvvm.div.rn.f(float {a}, float {b})"
        ))
    }
    /// `a - b` as `a + (-b)`: bit-identical to IEEE subtraction (negation is exact).
    pub(crate) fn fsub(&mut self, a: &str, b: &str) -> String {
        let nb = self.v(format!("fneg float {b}"));
        self.fadd(a, &nb)
    }
    pub(crate) fn fma(&mut self, a: &str, b: &str, c: &str) -> String {
        self.v(format!(
            "call float @llvm.nvvm.fma.rn.f(float {a}, float {b}, float {c})"
        ))
    }

    // ---- warp and block primitives ----

    pub(crate) fn shfl_xor_i32(&mut self, v: &str, mask: u32) -> String {
        self.v(format!(
            "call i32 @llvm.nvvm.shfl.sync.bfly.i32(i32 -1, i32 {v}, i32 {mask}, i32 31)"
        ))
    }
    pub(crate) fn shfl_xor_f32(&mut self, v: &str, mask: u32) -> String {
        let i = self.v(format!("bitcast float {v} to i32"));
        let o = self.shfl_xor_i32(&i, mask);
        self.v(format!("bitcast i32 {o} to float"))
    }
    pub(crate) fn shfl_down_i32(&mut self, v: &str, delta: u32) -> String {
        self.v(format!(
            "call i32 @llvm.nvvm.shfl.sync.down.i32(i32 -1, i32 {v}, i32 {delta}, i32 31)"
        ))
    }
    /// Warp-wide unsigned max (`redux.sync.max.u32`, sm_80+); every lane must take part.
    pub(crate) fn redux_umax(&mut self, v: &str) -> String {
        self.v(format!("call i32 @llvm.nvvm.redux.sync.umax(i32 {v}, i32 -1)"))
    }
    /// `vote.sync.ballot.b32` over the full warp.
    pub(crate) fn ballot(&mut self, p: &str) -> String {
        self.v(format!("call i32 @llvm.nvvm.vote.ballot.sync(i32 -1, i1 {p})"))
    }
    pub(crate) fn umax(&mut self, a: &str, b: &str) -> String {
        self.v(format!("call i32 @llvm.umax.i32(i32 {a}, i32 {b})"))
    }
    /// An order key of a logit: `key(a) > key(b)` iff `a > b`, equal keys iff equal values,
    /// and 0 (below every key) for values that are not `> -inf` (`-inf`, NaN), which never
    /// enter a list. `-0.0` is first made `+0.0` (an exact `+ 0.0`) so the two zeros, equal
    /// as floats, get one key; positive values get the sign bit set, negative ones are
    /// bit-inverted.
    pub(crate) fn order_key(&mut self, x: &str) -> String {
        let z = self.fadd(x, "0.0");
        let b = self.v(format!("bitcast float {z} to i32"));
        let m = self.v(format!("ashr i32 {b}, 31"));
        let flip = self.v(format!("or i32 {m}, -2147483648"));
        let k = self.v(format!("xor i32 {b}, {flip}"));
        let live = self.v(format!("fcmp ogt float {x}, {NEG_INF}"));
        self.sel("i32", &live, &k, "0")
    }
    pub(crate) fn barrier(&mut self) {
        match self.barrier_scope.clone() {
            None => self.s("call void asm sideeffect \"bar.sync 0;\", \"~{memory}\"() #1"),
            Some((id, threads)) => self.s(format!(
                "call void asm sideeffect \"bar.sync $0, {threads};\", \"r,~{{memory}}\"(i32 {id}) #1"
            )),
        }
    }

    /// Runs `body` with [`Func::barrier`] scoped to named barrier `id` (a value) of `threads`.
    pub(crate) fn with_barrier_scope(&mut self, id: &str, threads: u32, body: impl FnOnce(&mut Func)) {
        let outer = self.barrier_scope.replace((id.to_string(), threads));
        body(self);
        self.barrier_scope = outer;
    }
    pub(crate) fn sreg(&mut self, name: &str) -> String {
        self.v(format!("call i32 @llvm.nvvm.read.ptx.sreg.{name}()"))
    }
}

/// A mutable value: an alloca and its type.
pub(crate) struct Var {
    ptr: String,
    ty: String,
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
declare float @llvm.nvvm.fma.rn.f(float, float, float)
declare float @llvm.fabs.f32(float)
declare float @llvm.maxnum.f32(float, float)
declare float @llvm.minnum.f32(float, float)
declare float @llvm.copysign.f32(float, float)
declare float @llvm.roundeven.f32(float)

attributes #0 = { alwaysinline nounwind }
attributes #1 = { convergent nounwind }
attributes #2 = { noinline nounwind }
"#;
