//! Typed instructions on [`Func`]: integer and f32/f64 arithmetic (every float operation an
//! explicit round-to-nearest NVVM intrinsic, never contracted), comparisons, casts, `select`,
//! loads, stores, atomics, addresses, calls, aggregates and vector lanes. Each emits exactly
//! one instruction (`fsub`: two) and returns its result typed.

use super::value::{Agg, AnyFloat, Bits, Float, Global, Int, Lane, Operand, Ptr, Shared, SharedAddr, Space, Value, F32, I1, I32, I64, X4};
use super::Func;

/// An integer comparison's predicate (`icmp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Icmp {
    Eq,
    Ne,
    Ult,
    Ule,
    Ugt,
    Uge,
    Sle,
    Sgt,
    Sge,
}

impl Icmp {
    fn llvm(self) -> &'static str {
        match self {
            Icmp::Eq => "eq",
            Icmp::Ne => "ne",
            Icmp::Ult => "ult",
            Icmp::Ule => "ule",
            Icmp::Ugt => "ugt",
            Icmp::Uge => "uge",
            Icmp::Sle => "sle",
            Icmp::Sgt => "sgt",
            Icmp::Sge => "sge",
        }
    }
}

/// A float comparison's predicate (`fcmp`): `O*` are false when either side is NaN, `U*`
/// true.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fcmp {
    Oeq,
    Ogt,
    Oge,
    Olt,
    Ole,
    Ueq,
    Uge,
}

impl Fcmp {
    fn llvm(self) -> &'static str {
        match self {
            Fcmp::Oeq => "oeq",
            Fcmp::Ogt => "ogt",
            Fcmp::Oge => "oge",
            Fcmp::Olt => "olt",
            Fcmp::Ole => "ole",
            Fcmp::Ueq => "ueq",
            Fcmp::Uge => "uge",
        }
    }
}

/// An atomic read-modify-write operation (`atomicrmw`, monotonic).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Atomic {
    Add,
    Or,
    Umax,
    Umin,
}

impl Atomic {
    fn llvm(self) -> &'static str {
        match self {
            Atomic::Add => "add",
            Atomic::Or => "or",
            Atomic::Umax => "umax",
            Atomic::Umin => "umin",
        }
    }
}

/// `, align N` or nothing (the type's ABI alignment).
fn align_suffix(align: Option<u32>) -> String {
    align.map(|a| format!(", align {a}")).unwrap_or_default()
}

impl Func {
    fn bin<T: Value>(&mut self, op: &str, a: &T, b: &T) -> T {
        self.typed(format!("{op} {} {a}, {b}", T::LLVM))
    }

    // ---- integers (wrapping) ----

    pub(crate) fn add<T: Int>(&mut self, a: &T, b: &T) -> T {
        self.bin("add", a, b)
    }
    pub(crate) fn sub<T: Int>(&mut self, a: &T, b: &T) -> T {
        self.bin("sub", a, b)
    }
    pub(crate) fn mul<T: Int>(&mut self, a: &T, b: &T) -> T {
        self.bin("mul", a, b)
    }
    pub(crate) fn udiv<T: Int>(&mut self, a: &T, b: &T) -> T {
        self.bin("udiv", a, b)
    }
    pub(crate) fn urem<T: Int>(&mut self, a: &T, b: &T) -> T {
        self.bin("urem", a, b)
    }
    pub(crate) fn shl<T: Int>(&mut self, a: &T, b: &T) -> T {
        self.bin("shl", a, b)
    }
    pub(crate) fn lshr<T: Int>(&mut self, a: &T, b: &T) -> T {
        self.bin("lshr", a, b)
    }
    pub(crate) fn ashr<T: Int>(&mut self, a: &T, b: &T) -> T {
        self.bin("ashr", a, b)
    }
    pub(crate) fn and<T: Bits>(&mut self, a: &T, b: &T) -> T {
        self.bin("and", a, b)
    }
    pub(crate) fn or<T: Bits>(&mut self, a: &T, b: &T) -> T {
        self.bin("or", a, b)
    }
    pub(crate) fn xor<T: Bits>(&mut self, a: &T, b: &T) -> T {
        self.bin("xor", a, b)
    }
    /// Every bit flipped (`xor` with all ones; for an `i1`, logical not).
    pub(crate) fn not<T: Bits>(&mut self, a: &T) -> T {
        self.typed(format!("xor {} {a}, {}", T::LLVM, T::ONES))
    }
    pub(crate) fn icmp<T: Int>(&mut self, pred: Icmp, a: &T, b: &T) -> I1 {
        self.typed(format!("icmp {} {} {a}, {b}", pred.llvm(), T::LLVM))
    }
    /// Whether `p` is not null (an optional pointer parameter was passed).
    pub(crate) fn non_null<S: Space>(&mut self, p: &Ptr<S>) -> I1 {
        self.typed(format!("icmp ne {} {p}, null", S::LLVM))
    }

    // ---- floats ----

    fn rn<T: Float>(&mut self, op: &str, args: &[&T]) -> T {
        let args: Vec<&dyn Operand> = args.iter().map(|a| *a as &dyn Operand).collect();
        self.call(&format!("@llvm.nvvm.{op}.rn.{}", T::RN), &args)
    }
    pub(crate) fn fadd<T: Float>(&mut self, a: &T, b: &T) -> T {
        self.rn("add", &[a, b])
    }
    pub(crate) fn fmul<T: Float>(&mut self, a: &T, b: &T) -> T {
        self.rn("mul", &[a, b])
    }
    pub(crate) fn fdiv<T: Float>(&mut self, a: &T, b: &T) -> T {
        self.rn("div", &[a, b])
    }
    /// `a / b` rounded to nearest as `div.rn.f32` rounds it, for operands on which the
    /// hardware's `div.rn` takes its fast path (`FCHK` passes: `a` and `b` normal or `a` zero,
    /// the quotient normal): that path's own sequence, `rcp.approx` refined by four fmas,
    /// without the `FCHK` branch to the slow path and the convergence region around it, which
    /// keep ptxas from interleaving independent divisions. Only for operand ranges whose every
    /// value an exhaustive GPU test checks against IEEE division (`math::ln_f32`,
    /// `math::gumbel_f32`).
    pub(crate) fn fdiv_fast_path(&mut self, a: &F32, b: &F32) -> F32 {
        let r: F32 = self.call("@llvm.nvvm.rcp.approx.ftz.f", &[b]);
        let nb = self.fneg(b);
        let e = self.fma(&nb, &r, &super::f32c(1.0));
        let r = self.fma(&r, &e, &r);
        let q = self.fma(a, &r, &F32::ZERO);
        let rem = self.fma(&nb, &q, a);
        self.fma(&r, &rem, &q)
    }
    /// `a · b + c`, rounded once.
    pub(crate) fn fma<T: Float>(&mut self, a: &T, b: &T, c: &T) -> T {
        self.rn("fma", &[a, b, c])
    }
    /// `a - b` as `a + (-b)`: bit-identical to IEEE subtraction (negation is exact).
    pub(crate) fn fsub<T: Float>(&mut self, a: &T, b: &T) -> T {
        let nb = self.fneg(b);
        self.fadd(a, &nb)
    }
    pub(crate) fn fneg<T: AnyFloat>(&mut self, a: &T) -> T {
        self.typed(format!("fneg {} {a}", T::LLVM))
    }
    pub(crate) fn fcmp<T: AnyFloat>(&mut self, pred: Fcmp, a: &T, b: &T) -> I1 {
        self.typed(format!("fcmp {} {} {a}, {b}", pred.llvm(), T::LLVM))
    }
    pub(crate) fn fabs(&mut self, a: &F32) -> F32 {
        self.call("@llvm.fabs.f32", &[a])
    }
    /// `maxnum`: the larger, or the other operand where one is NaN.
    pub(crate) fn maxnum(&mut self, a: &F32, b: &F32) -> F32 {
        self.call("@llvm.maxnum.f32", &[a, b])
    }
    /// `minnum`: the smaller, or the other operand where one is NaN.
    pub(crate) fn minnum(&mut self, a: &F32, b: &F32) -> F32 {
        self.call("@llvm.minnum.f32", &[a, b])
    }
    pub(crate) fn umax(&mut self, a: &I32, b: &I32) -> I32 {
        self.call("@llvm.umax.i32", &[a, b])
    }
    pub(crate) fn umin(&mut self, a: &I32, b: &I32) -> I32 {
        self.call("@llvm.umin.i32", &[a, b])
    }

    /// An order key of a logit: `key(a) > key(b)` iff `a > b`, equal keys iff equal values,
    /// and 0 (below every key) for values that are not `> -inf` (`-inf`, NaN), which never
    /// enter a list. `-0.0` is first made `+0.0` (an exact `+ 0.0`) so the two zeros, equal
    /// as floats, get one key; positive values get the sign bit set, negative ones are
    /// bit-inverted.
    pub(crate) fn order_key(&mut self, x: &F32) -> I32 {
        let z = self.fadd(x, &F32::ZERO);
        let b: I32 = self.bitcast(&z);
        let m = self.ashr(&b, &I32::c(31));
        let flip = self.or(&m, &I32::c(i32::MIN));
        let k = self.xor(&b, &flip);
        let live = self.fcmp(Fcmp::Ogt, x, &F32::NEG_INF);
        self.sel(&live, &k, &I32::c(0))
    }

    /// The value an order key stands for: [`Func::order_key`] inverted (keys with the top bit
    /// set are non-negative floats, the rest bit-inverted negative ones; `-0` reads as `+0`).
    pub(crate) fn key_value(&mut self, k: &I32) -> F32 {
        let negative = self.icmp(Icmp::Sge, k, &I32::c(0));
        let inverted = self.not(k);
        let cleared = self.and(k, &I32::c(i32::MAX));
        let bits = self.sel(&negative, &inverted, &cleared);
        self.bitcast(&bits)
    }

    // ---- casts ----

    fn cast<A: Value, B: Value>(&mut self, op: &str, a: &A) -> B {
        self.typed(format!("{op} {} {a} to {}", A::LLVM, B::LLVM))
    }
    /// Zero-extends to the wider `B`.
    pub(crate) fn zext<A: Bits, B: Int>(&mut self, a: &A) -> B {
        self.cast("zext", a)
    }
    /// Sign-extends to the wider `B`.
    pub(crate) fn sext<A: Int, B: Int>(&mut self, a: &A) -> B {
        self.cast("sext", a)
    }
    /// The low bits, as the narrower `B`.
    pub(crate) fn trunc<A: Int, B: Bits>(&mut self, a: &A) -> B {
        self.cast("trunc", a)
    }
    /// The same bits as `B` (same width).
    pub(crate) fn bitcast<A: Value, B: Value>(&mut self, a: &A) -> B {
        self.cast("bitcast", a)
    }
    pub(crate) fn sitofp<A: Int, B: AnyFloat>(&mut self, a: &A) -> B {
        self.cast("sitofp", a)
    }
    pub(crate) fn uitofp<A: Int, B: AnyFloat>(&mut self, a: &A) -> B {
        self.cast("uitofp", a)
    }
    pub(crate) fn fptoui<A: AnyFloat, B: Int>(&mut self, a: &A) -> B {
        self.cast("fptoui", a)
    }
    /// Truncates toward zero; the value must be in `B`'s range (else poison).
    pub(crate) fn fptosi<A: AnyFloat, B: Int>(&mut self, a: &A) -> B {
        self.cast("fptosi", a)
    }
    /// Widens exactly to the wider float `B`.
    pub(crate) fn fpext<A: AnyFloat, B: AnyFloat>(&mut self, a: &A) -> B {
        self.cast("fpext", a)
    }
    /// Rounds to the narrower float `B` (to nearest).
    pub(crate) fn fptrunc<A: AnyFloat, B: AnyFloat>(&mut self, a: &A) -> B {
        self.cast("fptrunc", a)
    }
    /// The address of `p` as the integer `B`.
    pub(crate) fn ptrtoint<S: Space, B: Int>(&mut self, p: &Ptr<S>) -> B {
        self.cast("ptrtoint", p)
    }
    /// The shared-window address of shared pointer `p`.
    pub(crate) fn shared_addr(&mut self, p: &Ptr<Shared>) -> SharedAddr {
        self.cast("ptrtoint", p)
    }
    /// `c ? a : b`.
    pub(crate) fn sel<T: Value>(&mut self, c: &I1, a: &T, b: &T) -> T {
        self.typed(format!("select i1 {c}, {ty} {a}, {ty} {b}", ty = T::LLVM))
    }

    // ---- memory ----

    /// Stores `v` at `ptr` (aligned to `align` bytes).
    pub(crate) fn store<T: Value, S: Space>(&mut self, v: &T, ptr: &Ptr<S>, align: u32) {
        self.s(format!("store {} {v}, {} {ptr}, align {align}", T::LLVM, S::LLVM));
    }

    /// Stores `v` at `ptr`, at its type's ABI alignment.
    pub(crate) fn store_natural<T: Value, S: Space>(&mut self, v: &T, ptr: &Ptr<S>) {
        self.s(format!("store {} {v}, {} {ptr}", T::LLVM, S::LLVM));
    }

    /// The value at `ptr` (aligned to `align` bytes).
    pub(crate) fn load<T: Value, S: Space>(&mut self, ptr: &Ptr<S>, align: u32) -> T {
        self.typed(format!("load {}, {} {ptr}, align {align}", T::LLVM, S::LLVM))
    }

    /// The value at `ptr`, at its type's ABI alignment.
    pub(crate) fn load_natural<T: Value, S: Space>(&mut self, ptr: &Ptr<S>) -> T {
        self.typed(format!("load {}, {} {ptr}", T::LLVM, S::LLVM))
    }

    /// The value at `ptr`, read even where LLVM could prove it unchanged (another thread
    /// wrote it before a barrier LLVM does not see through).
    pub(crate) fn load_volatile<T: Value, S: Space>(&mut self, ptr: &Ptr<S>, align: u32) -> T {
        self.typed(format!("load volatile {}, {} {ptr}, align {align}", T::LLVM, S::LLVM))
    }

    fn rmw_text<T: Int, S: Space>(op: Atomic, ptr: &Ptr<S>, v: &T, align: Option<u32>) -> String {
        format!("atomicrmw {} {} {ptr}, {} {v} monotonic{}", op.llvm(), S::LLVM, T::LLVM, align_suffix(align))
    }

    /// `*ptr = op(*ptr, v)` atomically (monotonic); returns the old value.
    pub(crate) fn atomic<T: Int, S: Space>(&mut self, op: Atomic, ptr: &Ptr<S>, v: &T, align: Option<u32>) -> T {
        self.typed(Self::rmw_text(op, ptr, v, align))
    }

    /// [`Func::atomic`] whose old value is not needed.
    pub(crate) fn atomic_update<T: Int, S: Space>(&mut self, op: Atomic, ptr: &Ptr<S>, v: &T, align: Option<u32>) {
        self.s(Self::rmw_text(op, ptr, v, align));
    }

    /// `ptr + bytes`.
    pub(crate) fn offset<S: Space>(&mut self, ptr: &Ptr<S>, bytes: u32) -> Ptr<S> {
        self.byte_offset(ptr, &S::Index::c(bytes))
    }

    /// `ptr + off` bytes.
    pub(crate) fn byte_offset<S: Space>(&mut self, ptr: &Ptr<S>, off: &S::Index) -> Ptr<S> {
        self.typed(format!("getelementptr i8, {} {ptr}, {} {off}", S::LLVM, <S::Index as Value>::LLVM))
    }

    /// The address of element `i` of the `T` array at `base`.
    pub(crate) fn element<S: Space, T: Value>(&mut self, base: &Ptr<S>, i: &S::Index) -> Ptr<S> {
        self.typed(format!("getelementptr {}, {} {base}, {} {i}", T::LLVM, S::LLVM, <S::Index as Value>::LLVM))
    }

    /// `base + index · scale` bytes on a global pointer.
    pub(crate) fn gaddr(&mut self, base: &Ptr<Global>, index: &I64, scale: u32) -> Ptr<Global> {
        let off = self.mul(index, &I64::c(scale));
        self.byte_offset(base, &off)
    }

    /// The shared pointer `off` bytes past `buffer`.
    pub(crate) fn saddr(&mut self, buffer: &Ptr<Shared>, off: &I32) -> Ptr<Shared> {
        self.byte_offset(buffer, off)
    }

    /// The shared address `base + off` bytes.
    pub(crate) fn shared_offset(&mut self, base: &SharedAddr, off: &I32) -> SharedAddr {
        self.typed(format!("add i32 {base}, {off}"))
    }

    // ---- calls, aggregates, vectors ----

    /// `call R name(args)`.
    pub(crate) fn call<R: Value>(&mut self, name: &str, args: &[&dyn Operand]) -> R {
        self.typed(format!("call {} {name}({})", R::LLVM, operands(args)))
    }

    /// `call void name(args)`.
    pub(crate) fn call_void(&mut self, name: &str, args: &[&dyn Operand]) {
        self.s(format!("call void {name}({})", operands(args)));
    }

    /// `call ty name(args)` of a function returning the aggregate type `ty`.
    pub(crate) fn call_agg(&mut self, ty: &'static str, name: &str, args: &[&dyn Operand]) -> Agg {
        self.agg(ty, format!("call {ty} {name}({})", operands(args)))
    }

    /// Field `i` of `agg`, which must have type `T`.
    pub(crate) fn extract<T: Value>(&mut self, agg: &Agg, i: usize) -> T {
        assert_eq!(agg.field_ty(i), Some(T::LLVM), "field {i} of {}", agg.ty());
        self.typed(format!("extractvalue {} {agg}, {i}", agg.ty()))
    }

    /// `agg` with field `i` (of type `T`) replaced by `v`.
    pub(crate) fn insert<T: Value>(&mut self, agg: &Agg, v: &T, i: usize) -> Agg {
        assert_eq!(agg.field_ty(i), Some(T::LLVM), "field {i} of {}", agg.ty());
        self.agg(agg.ty().to_string(), format!("insertvalue {} {agg}, {} {v}, {i}", agg.ty(), T::LLVM))
    }

    /// Lane `lane` of `vec`.
    pub(crate) fn extract_lane<T: Lane>(&mut self, vec: &X4<T>, lane: u32) -> T {
        self.typed(format!("extractelement {} {vec}, i32 {lane}", T::X4))
    }

    /// `vec` with lane `lane` replaced by `v`.
    pub(crate) fn insert_lane<T: Lane>(&mut self, vec: &X4<T>, v: &T, lane: u32) -> X4<T> {
        self.typed(format!("insertelement {} {vec}, {} {v}, i32 {lane}", T::X4, T::LLVM))
    }
}

/// A call's argument list: `type value, ...`.
fn operands(args: &[&dyn Operand]) -> String {
    args.iter().map(|a| a.operand()).collect::<Vec<_>>().join(", ")
}
