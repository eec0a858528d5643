//! Typed SSA values: each wraps the IR text of a value (an SSA name, a parameter or global,
//! or a constant) with its LLVM type, so an operand of the wrong width, kind or address space
//! is a rustc error, not an LLVM parse error at run time.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

/// A typed SSA value: implemented by the value newtypes.
pub(crate) trait Value: fmt::Display + Clone {
    /// The value's LLVM type.
    const LLVM: &'static str;
    /// Wraps IR text (an SSA name or a constant) that has this type.
    fn raw(text: impl Into<String>) -> Self;
    /// The IR text.
    fn text(&self) -> &str;
}

/// An operand as a call or instruction takes it: `type value`. Object-safe, so a call's
/// arguments of different types go in one slice.
pub(crate) trait Operand {
    /// `type value`.
    fn operand(&self) -> String;
}

impl<T: Value> Operand for T {
    fn operand(&self) -> String {
        format!("{} {self}", T::LLVM)
    }
}

macro_rules! value {
    ($(#[$doc:meta])* $name:ident, $llvm:literal) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub(crate) struct $name(Cow<'static, str>);

        impl $name {
            /// The value named `name` (a parameter, a global, a literal), usable in a `const`.
            #[allow(dead_code, reason = "not every type has a named value")]
            pub(crate) const fn named(name: &'static str) -> Self {
                $name(Cow::Borrowed(name))
            }
        }

        impl Value for $name {
            const LLVM: &'static str = $llvm;
            fn raw(text: impl Into<String>) -> Self {
                $name(Cow::Owned(text.into()))
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
    };
}

value!(
    /// An `i1` (predicate).
    I1, "i1"
);
value!(
    /// An `i16` (a 16-bit operand element, before widening).
    I16, "i16"
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
    /// An `i128` (the exact logsumexp sums).
    I128, "i128"
);
value!(
    /// A `half` (an f16 operand element, before widening).
    F16, "half"
);
value!(
    /// A `float`.
    F32, "float"
);
value!(
    /// A `double` (speculative verification's decision).
    F64, "double"
);
value!(
    /// A 32-bit shared-window address (`cvta`-free `.shared` operands of inline PTX: cp.async
    /// destinations, ldmatrix rows, mbarriers). Not interchangeable with an `i32` count.
    SharedAddr, "i32"
);

impl I1 {
    pub(crate) const TRUE: I1 = I1::named("true");
    pub(crate) const FALSE: I1 = I1::named("false");
}

impl SharedAddr {
    /// The address's bits as an `i32` (the same SSA value, no instruction): for descriptor
    /// arithmetic, which reads the address as a number.
    pub(crate) fn bits(&self) -> I32 {
        I32::raw(self.text())
    }
}

/// The integer types and `i1`: bitwise `and`, `or`, `xor`.
pub(crate) trait Bits: Value {
    /// The all-ones constant (`xor` with it is `not`).
    const ONES: &'static str;
}

impl Bits for I1 {
    const ONES: &'static str = "true";
}

/// The integer types: arithmetic, shifts, comparisons, constants.
pub(crate) trait Int: Bits {
    /// The constant `v` (decimal; negative values as LLVM reads them, two's complement).
    fn c(v: impl Into<i128>) -> Self {
        Self::raw(v.into().to_string())
    }
}

macro_rules! int {
    ($($name:ident),*) => {$(
        impl Bits for $name {
            const ONES: &'static str = "-1";
        }
        impl Int for $name {}
    )*};
}
int!(I16, I32, I64, I128);

/// An `i32` constant.
pub(crate) fn i32c(v: impl Into<i64>) -> I32 {
    I32::c(v.into())
}

/// The LLVM floating-point types: comparisons, negation, conversions.
pub(crate) trait AnyFloat: Value {}

impl AnyFloat for F16 {}

/// `float` and `double`: explicitly rounded (`.rn`) arithmetic and the constants it needs.
pub(crate) trait Float: AnyFloat {
    /// The NVVM intrinsics' type suffix (`add.rn.f`, `add.rn.d`).
    const RN: &'static str;
    /// `-inf`.
    const NEG_INF: Self;
}

macro_rules! float {
    ($name:ident, $rn:literal) => {
        impl AnyFloat for $name {}
        impl Float for $name {
            const RN: &'static str = $rn;
            const NEG_INF: Self = $name::NEG_INF;
        }
        #[allow(dead_code, reason = "both widths get the same constants")]
        impl $name {
            /// `-inf`.
            pub(crate) const NEG_INF: Self = $name::named("0xFFF0000000000000");
            /// `+inf`.
            pub(crate) const POS_INF: Self = $name::named("0x7FF0000000000000");
            /// A quiet NaN.
            pub(crate) const NAN: Self = $name::named("0x7FF8000000000000");
            /// `+0.0`.
            pub(crate) const ZERO: Self = $name::named("0.0");
            /// `-0.0`: the additive identity bit for bit (`x + -0 = x`, `-0` included).
            pub(crate) const NEG_ZERO: Self = $name::named("-0.0");
            /// `1.0`.
            pub(crate) const ONE: Self = $name::named("1.0");
        }
    };
}
float!(F32, "f");
float!(F64, "d");

/// An f32 constant in LLVM's exact hexadecimal form (the f32 value widened to f64 bits).
pub(crate) fn f32c(v: f32) -> F32 {
    F32::raw(format!("0x{:016X}", f64::from(v).to_bits()))
}

/// An f64 constant in LLVM's exact hexadecimal form.
pub(crate) fn f64c(v: f64) -> F64 {
    F64::raw(format!("0x{:016X}", v.to_bits()))
}

/// The scalar types a 4-lane vector holds.
pub(crate) trait Lane: Value {
    /// `<4 x T>`.
    const X4: &'static str;
}

impl Lane for F32 {
    const X4: &'static str = "<4 x float>";
}
impl Lane for I32 {
    const X4: &'static str = "<4 x i32>";
}

/// A `<4 x T>` vector (16-byte shared-memory accesses).
#[derive(Debug)]
pub(crate) struct X4<T: Lane>(Cow<'static, str>, PhantomData<T>);

impl<T: Lane> Clone for X4<T> {
    fn clone(&self) -> Self {
        X4(self.0.clone(), PhantomData)
    }
}

impl<T: Lane> X4<T> {
    /// The vector with every lane undefined, to build one lane by lane.
    pub(crate) const UNDEF: Self = X4(Cow::Borrowed("undef"), PhantomData);
}

impl<T: Lane> Value for X4<T> {
    const LLVM: &'static str = T::X4;
    fn raw(text: impl Into<String>) -> Self {
        X4(Cow::Owned(text.into()), PhantomData)
    }
    fn text(&self) -> &str {
        &self.0
    }
}

impl<T: Lane> fmt::Display for X4<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An address space of [`Ptr`].
pub(crate) trait Space {
    /// The LLVM pointer type in this space.
    const LLVM: &'static str;
    /// The type of byte offsets and element indices in this space.
    type Index: Int;
}

/// Global memory (`addrspace(1)`): kernel parameters, candidates, lists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Global;
/// Shared memory (`addrspace(3)`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Shared;
/// The generic address space (`ptr`): what `cvta`-style conversions yield.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Generic;

impl Space for Global {
    const LLVM: &'static str = "ptr addrspace(1)";
    type Index = I64;
}
impl Space for Shared {
    const LLVM: &'static str = "ptr addrspace(3)";
    type Index = I32;
}
impl Space for Generic {
    const LLVM: &'static str = "ptr";
    type Index = I64;
}

/// A pointer in address space `S`.
#[derive(Debug)]
pub(crate) struct Ptr<S: Space>(Cow<'static, str>, PhantomData<S>);

impl<S: Space> Clone for Ptr<S> {
    fn clone(&self) -> Self {
        Ptr(self.0.clone(), PhantomData)
    }
}

impl<S: Space> Ptr<S> {
    /// The pointer named `name` (a parameter or a global), usable in a `const`.
    pub(crate) const fn named(name: &'static str) -> Self {
        Ptr(Cow::Borrowed(name), PhantomData)
    }
}

impl<S: Space> Value for Ptr<S> {
    const LLVM: &'static str = S::LLVM;
    fn raw(text: impl Into<String>) -> Self {
        Ptr(Cow::Owned(text.into()), PhantomData)
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

/// A first-class aggregate (`{ i32, i64 }`, a call's or an inline asm's several results): its
/// LLVM type is known only at run time, so [`Func::extract`](super::Func::extract) and
/// [`Func::insert`](super::Func::insert) check each field's type against it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Agg {
    ty: Cow<'static, str>,
    text: String,
}

impl Agg {
    /// The aggregate of type `ty` with every field undefined, to build one field by field.
    pub(crate) fn undef(ty: impl Into<Cow<'static, str>>) -> Agg {
        Agg { ty: ty.into(), text: "undef".to_string() }
    }

    /// Wraps IR text of type `ty`.
    pub(crate) fn raw(ty: impl Into<Cow<'static, str>>, text: impl Into<String>) -> Agg {
        Agg { ty: ty.into(), text: text.into() }
    }

    /// The LLVM struct type, `{ t0, t1, ... }`.
    pub(crate) fn ty(&self) -> &str {
        &self.ty
    }

    /// The LLVM type of field `i`, if there is one.
    pub(crate) fn field_ty(&self, i: usize) -> Option<&str> {
        self.ty.trim().strip_prefix('{')?.strip_suffix('}')?.split(',').map(str::trim).nth(i)
    }

    /// The struct type of `n` fields of type `T`: `{ T, T, ... }`.
    pub(crate) fn of<T: Value>(n: usize) -> String {
        format!("{{ {} }}", vec![T::LLVM; n].join(", "))
    }
}

impl fmt::Display for Agg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_print_as_llvm_reads_them() {
        assert_eq!(i32c(-1).text(), "-1");
        assert_eq!(I64::c(u64::MAX >> 12).text(), "4503599627370495");
        assert_eq!(f32c(1.0).text(), "0x3FF0000000000000");
        assert_eq!(f64c(-0.5).text(), "0xBFE0000000000000");
        assert_eq!(F32::NEG_INF.text(), "0xFFF0000000000000");
        assert_eq!(X4::<F32>::LLVM, "<4 x float>");
    }

    #[test]
    fn aggregate_fields_have_their_types() {
        let a = Agg::undef("{ i32, i64, i64 }");
        assert_eq!((a.field_ty(0), a.field_ty(2), a.field_ty(3)), (Some("i32"), Some("i64"), None));
        assert_eq!(Agg::of::<F32>(3), "{ float, float, float }");
    }
}
