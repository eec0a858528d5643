//! The decision kernel's f64 helpers (`@fs_ln_f64`, `@fs_exp_f64`, `@fs_gumbel_f64`) compute
//! `abi::math::ln_f64`, `abi::math::exp_f64` and `abi::rng::gumbel_f64` bit for bit: their
//! emitted LLVM IR, straight-line code over a handful of instructions, is interpreted here on
//! the host (the `.rn` intrinsics as IEEE round-to-nearest operations, which they are) and
//! compared with the abi over many inputs. No GPU needed; ptxas checks the same text compiles.

use flashsample_codegen_ptx::{llvm_ir, GpuConfig, Schedule, Grid};
use flashsample_ir::{DType, Outputs, PipelineBuilder};
use std::collections::HashMap;

/// The module text of a verifying pipeline.
fn module() -> String {
    let p = PipelineBuilder::new("Verify", DType::BF16, DType::BF16)
        .temperature_per_row("t")
        .verify_greedy("drafts")
        .outputs(Outputs { logprob: true, ..Outputs::default() })
        .build()
        .unwrap();
    let mut c = GpuConfig::new(128, 8, 4, Schedule::MmaSync { stages: 2, k_step: 64, grid: Grid::PerItem });
    c.fit_lists(&p);
    llvm_ir(&p, &c).unwrap()
}

/// The body lines of `define ... @name(...)`.
fn body<'a>(ir: &'a str, name: &str) -> Vec<&'a str> {
    let start = ir.find(&format!("@{name}(")).and_then(|i| ir[..i].rfind("define ")).expect(name);
    let text = &ir[start..];
    let end = text.find("\n}").expect("function end");
    text[..end].lines().skip(1).map(str::trim).filter(|l| !l.is_empty() && !l.ends_with(':')).collect()
}

/// A value: its bits (ints zero-extended, doubles as `to_bits`).
type Env = HashMap<String, u64>;

fn width(ty: &str) -> u32 {
    match ty {
        "i1" => 1,
        "i32" => 32,
        "i64" | "double" => 64,
        other => panic!("type {other}"),
    }
}

fn mask(v: u64, ty: &str) -> u64 {
    let w = width(ty);
    if w == 64 {
        v
    } else {
        v & ((1u64 << w) - 1)
    }
}

/// An operand: `%name`, an integer, a hexadecimal double or `true`/`false`.
fn operand(env: &Env, text: &str, ty: &str) -> u64 {
    let t = text.trim();
    if let Some(v) = env.get(t) {
        return *v;
    }
    if let Some(hex) = t.strip_prefix("0x") {
        return u64::from_str_radix(hex, 16).unwrap();
    }
    match t {
        "true" => 1,
        "false" => 0,
        _ if ty == "double" => t.parse::<f64>().unwrap_or_else(|_| panic!("operand {t}")).to_bits(),
        _ => mask(t.parse::<i64>().unwrap_or_else(|_| panic!("operand {t}")) as u64, ty),
    }
}

fn sext(v: u64, ty: &str) -> i64 {
    let w = width(ty);
    ((v << (64 - w)) as i64) >> (64 - w)
}

/// Runs function `name` of `ir` on `args` (bits), returning the bits it returns.
fn run(ir: &str, name: &str, args: &[(&str, u64)]) -> u64 {
    let mut env: Env = args.iter().map(|(n, v)| (n.to_string(), *v)).collect();
    for line in body(ir, name) {
        if let Some(rest) = line.strip_prefix("ret ") {
            let (ty, v) = rest.split_once(' ').unwrap();
            return operand(&env, v, ty);
        }
        let (dst, rhs) = line.split_once(" = ").unwrap_or_else(|| panic!("{line}"));
        let value = eval(ir, &env, rhs);
        env.insert(dst.to_string(), value);
    }
    panic!("{name} returned nothing")
}

fn f(bits: u64) -> f64 {
    f64::from_bits(bits)
}

fn eval(ir: &str, env: &Env, rhs: &str) -> u64 {
    let (op, rest) = rhs.split_once(' ').unwrap();
    if op == "call" {
        let (callee, args) = rest.split_once('(').unwrap();
        let callee = callee.split_whitespace().last().unwrap();
        let args: Vec<(&str, &str)> =
            args.trim_end_matches(')').split(", ").map(|a| a.trim().split_once(' ').unwrap()).collect();
        let v: Vec<u64> = args.iter().map(|(ty, x)| operand(env, x, ty)).collect();
        return match callee {
            "@llvm.nvvm.add.rn.d" => (f(v[0]) + f(v[1])).to_bits(),
            "@llvm.nvvm.mul.rn.d" => (f(v[0]) * f(v[1])).to_bits(),
            "@llvm.nvvm.div.rn.d" => (f(v[0]) / f(v[1])).to_bits(),
            "@llvm.roundeven.f64" => f(v[0]).round_ties_even().to_bits(),
            "@llvm.fabs.f64" => f(v[0]).abs().to_bits(),
            "@llvm.fptosi.sat.i64.f64" => (f(v[0]) as i64) as u64,
            "@fs_ln_f64" => run(ir, "fs_ln_f64", &[("%x", v[0])]),
            other => panic!("call {other}"),
        };
    }
    if op == "fneg" {
        let (_, a) = rest.split_once(' ').unwrap();
        return (-f(operand(env, a, "double"))).to_bits();
    }
    if op == "select" {
        let parts: Vec<&str> = rest.split(", ").collect();
        let c = operand(env, parts[0].trim_start_matches("i1 "), "i1");
        let (ty, a) = parts[1].split_once(' ').unwrap();
        let (_, b) = parts[2].split_once(' ').unwrap();
        return if c != 0 { operand(env, a, ty) } else { operand(env, b, ty) };
    }
    if op == "icmp" || op == "fcmp" {
        let mut it = rest.splitn(3, ' ');
        let (pred, ty, ops) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
        let (a, b) = ops.split_once(", ").unwrap();
        let (a, b) = (operand(env, a, ty), operand(env, b, ty));
        return u64::from(match pred {
            "sgt" => sext(a, ty) > sext(b, ty),
            "eq" => a == b,
            "oge" => f(a) >= f(b),
            "ogt" => f(a) > f(b),
            other => panic!("predicate {other}"),
        });
    }
    // Casts: `<op> <ty> <a> to <ty2>`.
    if let Some((src, to)) = rest.split_once(" to ") {
        let (ty, a) = src.split_once(' ').unwrap();
        let a = operand(env, a, ty);
        return match op {
            "bitcast" | "zext" => a,
            "trunc" => mask(a, to),
            "sitofp" => (sext(a, ty) as f64).to_bits(),
            "uitofp" => (a as f64).to_bits(),
            other => panic!("cast {other}"),
        };
    }
    // Integer binary operations: `<op> <ty> <a>, <b>`.
    let (ty, ops) = rest.split_once(' ').unwrap();
    let (a, b) = ops.split_once(", ").unwrap();
    let (a, b) = (operand(env, a, ty), operand(env, b, ty));
    let r = match op {
        "add" => a.wrapping_add(b),
        "sub" => a.wrapping_sub(b),
        "and" => a & b,
        "or" => a | b,
        "xor" => a ^ b,
        "shl" => a << b,
        "lshr" => a >> b,
        other => panic!("instruction {other}"),
    };
    mask(r, ty)
}

#[test]
fn the_emitted_f64_math_is_the_abis_bit_for_bit() {
    use flashsample_abi::math::{exp_f64, ln_f64};
    use flashsample_abi::rng::gumbel_f64;
    let ir = module();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for i in 0..5_000 {
        // ln over normal positives of every magnitude, and near 1 (the fdlibm branch).
        let x = if i % 2 == 0 {
            f64::from_bits(next() % (0x7fe0_0000_0000_0000 - 0x0010_0000_0000_0000) + 0x0010_0000_0000_0000)
        } else {
            1.0 + ((next() % 2_000_001) as f64 - 1e6) * 1e-7
        };
        assert_eq!(run(&ir, "fs_ln_f64", &[("%x", x.to_bits())]), ln_f64(x).to_bits(), "ln {x:e}");
        // exp over the decision's domain (x − L ≤ ~0) and past its ends.
        let y = (next() % 1_000_000) as f64 * -7.2e-4 + 2.0;
        assert_eq!(run(&ir, "fs_exp_f64", &[("%x", y.to_bits())]), exp_f64(y).to_bits(), "exp {y}");
        let bits = next() as u32;
        assert_eq!(run(&ir, "fs_gumbel_f64", &[("%bits", u64::from(bits))]), gumbel_f64(bits).to_bits(), "gumbel {bits:#x}");
    }
    for y in [0.0, -708.0, -708.5, -1e300, f64::NEG_INFINITY, f64::NAN, 1e-300, -1e-300] {
        assert_eq!(run(&ir, "fs_exp_f64", &[("%x", y.to_bits())]), exp_f64(y).to_bits(), "exp {y}");
    }
    for bits in [0, u32::MAX, 0xff, 0x100, 0x8000_0000] {
        assert_eq!(run(&ir, "fs_gumbel_f64", &[("%bits", u64::from(bits))]), gumbel_f64(bits).to_bits(), "gumbel {bits:#x}");
    }
}
