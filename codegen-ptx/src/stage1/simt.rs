//! [`Schedule::Simt`](crate::Schedule::Simt): each thread accumulates its own (token, column)
//! pairs with FMAs straight from global memory (L1-cached), any dtypes, any D. No ring.

use super::{Gen, Item, Thread};
use crate::ir::{Func, Var};
use flashsample_ir::DType;

/// Loads one element of a `dtype` matrix at element index `index64` and widens it to f32.
pub(crate) fn load_elem(f: &mut Func, base: &str, index64: &str, dtype: DType) -> String {
    match dtype {
        DType::F32 => {
            let a = f.gaddr_u(base, index64, 4);
            f.v(format!("load float, ptr addrspace(1) {a}, align 4"))
        }
        DType::BF16 => {
            let a = f.gaddr_u(base, index64, 2);
            let h = f.v(format!("load i16, ptr addrspace(1) {a}, align 2"));
            let w = f.v(format!("zext i16 {h} to i32"));
            let s = f.v(format!("shl i32 {w}, 16"));
            f.v(format!("bitcast i32 {s} to float"))
        }
        DType::F16 => {
            let a = f.gaddr_u(base, index64, 2);
            let h = f.v(format!("load half, ptr addrspace(1) {a}, align 2"));
            f.v(format!("fpext half {h} to float"))
        }
    }
}

impl Gen<'_> {
    /// SIMT: each thread accumulates its own (token, column) pairs straight from global
    /// memory (L1-cached), any dtypes, any D.
    pub(super) fn simt_mainloop(&self, f: &mut Func, th: &Thread, it: &Item) -> Vec<String> {
        let acc: Vec<Var> = (0..self.acc_count())
            .map(|_| f.var_u("float", "0.0"))
            .collect();
        let dim64 = f.zext64_u("%dim");
        let warp_base = f.mul_u(&th.warp, &self.warp_rows().to_string());
        let g4 = f.v(format!("shl i32 {}, 2", th.g));
        let mut w_rows = Vec::new();
        for p in 0..self.quads {
            for o in 0..4 {
                let v = f.add_u(&it.v0, &warp_base);
                let v = f.add_u(&v, &(p * 32 + o).to_string());
                let v = f.add_u(&v, &g4);
                let ok = f.ult_u(&v, "%vocab");
                // Out-of-range rows read row 0; their logits are excluded in the epilogue.
                let ve = f.sel_u("i32", &ok, &v, "0");
                let ve = f.zext64_u(&ve);
                w_rows.push(f.v(format!("mul i64 {ve}, {dim64}")));
            }
        }
        let t2 = f.v(format!("shl i32 {}, 1", th.t));
        let mut h_rows = Vec::new();
        for n in 0..self.ntiles {
            for j in 0..2 {
                let r = f.add_u(&it.b0, &(n * 8 + j).to_string());
                let r = f.add_u(&r, &t2);
                let ok = f.ult_u(&r, "%batch");
                let re = f.sel_u("i32", &ok, &r, "0");
                let re = f.zext64_u(&re);
                h_rows.push(f.v(format!("mul i64 {re}, {dim64}")));
            }
        }
        let (wd, hd) = (self.p.weights.dtype, self.p.hidden.dtype);
        f.for_loop_u("0", "%dim", "1", |f, k| {
            let k64 = f.zext64_u(k);
            let w: Vec<String> = w_rows
                .iter()
                .map(|row| {
                    let i = f.v(format!("add i64 {row}, {k64}"));
                    load_elem(f, "%weights", &i, wd)
                })
                .collect();
            let h: Vec<String> = h_rows
                .iter()
                .map(|row| {
                    let i = f.v(format!("add i64 {row}, {k64}"));
                    load_elem(f, "%hidden", &i, hd)
                })
                .collect();
            for p in 0..self.quads {
                for o in 0..4 {
                    for n in 0..self.ntiles {
                        for j in 0..2 {
                            let a = &acc[self.acc_index(p, o, n, j)];
                            let cur = f.get_u(a);
                            let wv = &w[(p * 4 + o) as usize];
                            let hv = &h[(n * 2 + j) as usize];
                            let nv = f.v(format!(
                                "call float @llvm.fma.f32(float {wv}, float {hv}, float {cur})"
                            ));
                            f.set_u(a, &nv);
                        }
                    }
                }
            }
        });
        acc.iter().map(|a| f.get_u(a)).collect()
    }
}
