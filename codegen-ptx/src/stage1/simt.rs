//! [`Schedule::Simt`](crate::Schedule::Simt): each thread accumulates its own (token, column)
//! pairs with FMAs straight from global memory (L1-cached), any dtypes, any D. No ring.

use super::{Gen, Item, Thread};
use crate::ir::{i32c, Func, Global, Icmp, Ptr, F16, F32, I16, I32, I64};
use crate::params::arg;
use flashsample_ir::DType;

/// Loads one element of a `dtype` matrix at element index `index64` and widens it to f32.
pub(crate) fn load_elem(f: &mut Func, base: &Ptr<Global>, index64: &I64, dtype: DType) -> F32 {
    match dtype {
        DType::F32 => {
            let a = f.gaddr(base, index64, 4);
            f.load(&a, 4)
        }
        DType::BF16 => {
            let a = f.gaddr(base, index64, 2);
            let h: I16 = f.load(&a, 2);
            let w: I32 = f.zext(&h);
            let s = f.shl(&w, &i32c(16));
            f.bitcast(&s)
        }
        DType::F16 => {
            let a = f.gaddr(base, index64, 2);
            let h: F16 = f.load(&a, 2);
            f.fpext(&h)
        }
    }
}

impl Gen<'_> {
    /// SIMT: each thread accumulates its own (token, column) pairs straight from global
    /// memory (L1-cached), any dtypes, any D.
    pub(super) fn simt_mainloop(&self, f: &mut Func, th: &Thread, it: &Item) -> Vec<F32> {
        let acc: Vec<_> = (0..self.acc_count()).map(|_| f.var(&F32::ZERO)).collect();
        let dim64: I64 = f.zext(&arg::DIM);
        let warp_base = f.mul(&th.warp, &i32c(self.warp_rows()));
        let g4 = f.shl(&th.g, &i32c(2));
        let mut w_rows = Vec::new();
        for p in 0..self.quads {
            for o in 0..4 {
                let v = f.add(&it.v0, &warp_base);
                let v = f.add(&v, &i32c(p * 32 + o));
                let v = f.add(&v, &g4);
                let ok = f.icmp(Icmp::Ult, &v, &arg::VOCAB);
                // Out-of-range rows read row 0; their logits are excluded in the epilogue.
                let ve = f.sel(&ok, &v, &i32c(0));
                let ve: I64 = f.zext(&ve);
                w_rows.push(f.mul(&ve, &dim64));
            }
        }
        let t2 = f.shl(&th.t, &i32c(1));
        let mut h_rows = Vec::new();
        for n in 0..self.ntiles {
            for j in 0..2 {
                let r = f.add(&it.b0, &i32c(n * 8 + j));
                let r = f.add(&r, &t2);
                let ok = f.icmp(Icmp::Ult, &r, &arg::BATCH);
                let re = f.sel(&ok, &r, &i32c(0));
                let re: I64 = f.zext(&re);
                h_rows.push(f.mul(&re, &dim64));
            }
        }
        let (wd, hd) = (self.p.weights.dtype, self.p.hidden.dtype);
        f.for_loop(&i32c(0), &arg::DIM, &i32c(1), |f, k| {
            let k64: I64 = f.zext(k);
            let w: Vec<F32> = w_rows
                .iter()
                .map(|row| {
                    let i = f.add(row, &k64);
                    load_elem(f, &arg::WEIGHTS, &i, wd)
                })
                .collect();
            let h: Vec<F32> = h_rows
                .iter()
                .map(|row| {
                    let i = f.add(row, &k64);
                    load_elem(f, &arg::HIDDEN, &i, hd)
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
                            let nv = f.call("@llvm.fma.f32", &[wv, hv, &cur]);
                            f.set(a, &nv);
                        }
                    }
                }
            }
        });
        acc.iter().map(|a| f.get(a)).collect()
    }
}
