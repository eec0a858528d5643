//! Tests' LLVM IR interpreter for the small kernels codegen emits (`flashsample_decide` and
//! the helpers it calls, the exact nucleus kernels' paths that take no atomics): a parsed
//! function runs one CTA at a time, its threads in lockstep at barriers and warp collectives
//! (shuffles, ballots), every `.rn` intrinsic as the IEEE operation it is, global and shared
//! memory as byte buffers. An instruction it does not model parses, and panics only if a thread
//! reaches it. No GPU needed.

use flashsample_codegen_ptx::DECIDE_THREADS;
use std::collections::HashMap;

/// A value's type, as far as the interpreter needs it.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Ty {
    I1,
    I32,
    I64,
    F32,
    F64,
    Ptr,
    Agg,
    /// `i128` (stage two's exact logsumexp sums): the low word in a register's word 0, the
    /// high one in word 1 ([`Module::get_wide`]).
    Wide,
}

fn ty_of(s: &str) -> Ty {
    match s {
        "i1" => Ty::I1,
        "i8" | "i16" => Ty::I32,
        "i32" => Ty::I32,
        "i64" => Ty::I64,
        "i128" => Ty::Wide,
        "float" => Ty::F32,
        "double" => Ty::F64,
        "void" => Ty::Agg,
        s if s.starts_with("ptr") => Ty::Ptr,
        s if s.starts_with('{') => Ty::Agg,
        other => panic!("type {other}"),
    }
}

/// Bytes of a `getelementptr` element or a memory access.
fn size_of(s: &str) -> u64 {
    match s {
        "i8" => 1,
        "i16" => 2,
        "i1" => 1,
        "i32" | "float" => 4,
        "i64" | "double" => 8,
        "i128" => 16,
        other => panic!("size of {other}"),
    }
}

fn mask(v: u64, ty: Ty) -> u64 {
    match ty {
        Ty::I1 => v & 1,
        Ty::I32 | Ty::F32 => v & 0xffff_ffff,
        _ => v,
    }
}

fn sext(v: u64, ty: Ty) -> i64 {
    match ty {
        Ty::I1 => -((v & 1) as i64),
        Ty::I32 => v as u32 as i32 as i64,
        _ => v as i64,
    }
}

/// A scalar (in word 0), or an aggregate or vector of up to eight words.
type Word = [u64; WORDS];
const WORDS: usize = 8;

#[derive(Clone, Copy, Debug)]
enum Val {
    Reg(usize),
    Imm(u64),
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Intr {
    AddD,
    MulD,
    DivD,
    AddF,
    FabsD,
    FptosiSat,
    RoundevenD,
    Tid,
    Ctaid,
    CtaidY,
    NctaidX,
    NctaidY,
    Shfl,
    /// `shfl.sync.down` with the whole warp as its segment (clamp 31).
    ShflDown,
    Ballot,
    WarpSync,
    /// `match.any.sync.b32`: the lanes holding the same value.
    MatchAny,
    /// `redux.sync.umax`: the largest value over the warp.
    ReduxUmax,
    UmaxI,
    Cttz,
    Ctlz,
    Ctpop,
    FmaF,
    MulF,
    DivF,
    /// `rcp.approx.ftz.f32`, modelled as the correctly rounded reciprocal: the hardware's is
    /// within an ulp of it, and codegen only refines it into `div.rn`'s quotient
    /// (`Func::fdiv_fast_path`), which both give (checked on every input on a GPU).
    RcpApproxF,
    MaxnumF,
    MinnumF,
    FabsF,
    RoundevenF,
    FloorF,
    CopysignF,
    UminI,
    FptosiSatI32F,
    FptouiSatI64F,
}

#[derive(Debug)]
enum Inst {
    Bin { d: usize, op: String, ty: Ty, a: Val, b: Val },
    Cast { d: usize, op: String, from: Ty, to: Ty, a: Val },
    Cmp { d: usize, pred: String, ty: Ty, a: Val, b: Val },
    Select { d: usize, c: Val, a: Val, b: Val },
    /// `ptx::add_if`: `s + t` where `c`, else `s` (i64).
    AddIf { d: usize, c: Val, s: Val, t: Val },
    Fneg { d: usize, ty: Ty, a: Val },
    Alloca { d: usize },
    Load { d: usize, bytes: u64, p: Val },
    Store { bytes: u64, v: Val, p: Val },
    Gep { d: usize, size: u64, p: Val, idx: Val, idx_ty: Ty },
    Extract { d: usize, agg: Val, i: usize },
    Insert { d: usize, agg: Option<Val>, v: Val, i: usize },
    Intrinsic { d: usize, which: Intr, args: Vec<Val> },
    Call { d: Option<usize>, callee: String, args: Vec<Val> },
    Barrier,
    /// `atomicrmw op` on `bytes` at `p` with `v`; `d` gets the old value. Threads run one at a
    /// time, so every read-modify-write is atomic.
    Atomic { d: Option<usize>, op: String, bytes: u64, p: Val, v: Val },
    /// A memory fence (`membar`): threads run one at a time, so a no-op.
    Nop,
    /// A `<lanes x float>` load or store: lane `i` in word `i` of the register.
    LoadVec { d: usize, lanes: usize, p: Val },
    StoreVec { lanes: usize, v: Val, p: Val },
    /// An instruction the interpreter does not model (atomics, inline PTX other than
    /// `bar.sync 0`, other intrinsics): executing it panics with its text.
    Unsupported(String),
    Br(usize),
    CondBr(Val, usize, usize),
    Ret(Option<Val>),
}

/// A parsed function: its parameters (registers `0..params.len()`) and blocks.
pub(super) struct Function {
    pub(super) params: Vec<String>,
    regs: usize,
    blocks: Vec<Vec<Inst>>,
}

/// Splits a leading type (`ptr addrspace(1)`, `{ i32, … }` or one word) off `s`.
fn split_ty(s: &str) -> (&str, &str) {
    let s = s.trim_start();
    let end = if s.starts_with('{') {
        s.find('}').unwrap() + 1
    } else if s.starts_with("ptr addrspace(") {
        s.find(')').unwrap() + 1
    } else {
        s.find(' ').unwrap_or(s.len())
    };
    (&s[..end], s[end..].trim_start())
}

/// Parses one function's text.
struct Parser<'a> {
    regs: HashMap<String, usize>,
    labels: HashMap<String, usize>,
    globals: &'a HashMap<String, u64>,
}

impl Parser<'_> {
    fn reg(&mut self, name: &str) -> usize {
        let n = self.regs.len();
        *self.regs.entry(name.to_string()).or_insert(n)
    }

    fn val(&mut self, text: &str, ty: Ty) -> Val {
        let t = text.trim().trim_end_matches(',');
        if t.starts_with('%') {
            return Val::Reg(self.reg(t));
        }
        if let Some(&a) = self.globals.get(t) {
            return Val::Imm(a);
        }
        let bits = match (t, ty) {
            ("null" | "undef", _) => 0,
            ("true", _) => 1,
            ("false", _) => 0,
            (t, Ty::F32) => {
                let v = match t.strip_prefix("0x") {
                    Some(h) => f64::from_bits(u64::from_str_radix(h, 16).unwrap()),
                    None => t.parse().unwrap(),
                };
                u64::from((v as f32).to_bits())
            }
            (t, Ty::F64) => match t.strip_prefix("0x") {
                Some(h) => u64::from_str_radix(h, 16).unwrap(),
                None => t.parse::<f64>().unwrap().to_bits(),
            },
            (t, ty) => mask(t.parse::<i64>().unwrap_or_else(|_| panic!("operand {t}")) as u64, ty),
        };
        Val::Imm(bits)
    }

    /// `ty a` → the value.
    fn typed(&mut self, s: &str) -> Val {
        let (ty, v) = split_ty(s);
        self.val(v, ty_of(ty))
    }

    fn label(&mut self, s: &str) -> usize {
        let name = s.trim().trim_start_matches("label ").trim_start_matches('%');
        let n = self.labels.len();
        *self.labels.entry(name.to_string()).or_insert(n)
    }

    /// An inline-asm call with a result: its destination register and its typed operands,
    /// the list after the constraint string (`..."(i32 %a, ptr addrspace(1) %p) #1`).
    fn asm_call(&mut self, line: &str) -> (usize, Vec<Val>) {
        let (dst, rhs) = line.split_once(" = ").unwrap();
        let d = self.reg(dst);
        let args = rhs.split_once("\"(").unwrap().1;
        let args = &args[..args.rfind(')').unwrap()];
        (d, args.split(", ").map(|a| self.typed(a)).collect())
    }

    fn inst(&mut self, line: &str) -> Inst {
        if line.starts_with("call void asm sideeffect \"bar.sync 0;\"") {
            return Inst::Barrier;
        }
        if line.starts_with("call void asm sideeffect \"membar.") {
            return Inst::Nop;
        }
        if let Some(at) = line.find("atomicrmw ") {
            let d = line.split_once(" = ").map(|(dst, _)| self.reg(dst));
            let rest = &line[at + "atomicrmw ".len()..];
            let (op, rest) = rest.split_once(' ').unwrap();
            let (_, rest) = split_ty(rest);
            let (p, rest) = rest.split_once(", ").unwrap();
            let p = self.val(p, Ty::Ptr);
            let (ty, rest) = split_ty(rest);
            let v = self.val(rest.split_whitespace().next().unwrap(), ty_of(ty));
            return Inst::Atomic { d, op: op.to_string(), bytes: size_of(ty), p, v };
        }
        if line.contains("call i32 asm \"mov.b32 $0, $1;\"") {
            // `ptx::opaque`: the identity, hidden from LLVM.
            let (d, a) = self.asm_call(line);
            return Inst::Bin { d, op: "or".to_string(), ty: Ty::I32, a: a[0], b: Val::Imm(0) };
        }
        if line.contains("asm \"{ mov.b64 $0, $1; @$3 add.s64 $0, $1, $2; }\"") {
            let (d, a) = self.asm_call(line);
            return Inst::AddIf { d, c: a[2], s: a[0], t: a[1] };
        }
        if line.contains("asm sideeffect \"ld.relaxed.gpu.global.b32") {
            // `ptx::ld_relaxed_gpu`: a plain 4-byte load (one CTA runs at a time).
            let (d, a) = self.asm_call(line);
            return Inst::Load { d, bytes: 4, p: a[0] };
        }
        if line.contains("asm sideeffect \"match.any.sync.b32") {
            let (d, a) = self.asm_call(line);
            return Inst::Intrinsic { d, which: Intr::MatchAny, args: vec![Val::Imm(0), a[0]] };
        }
        if let Some(rest) = line.strip_prefix("store <4 x float> ") {
            let (v, p) = rest.split_once(", ").unwrap();
            let v = self.val(v, Ty::Agg);
            let (_, p) = split_ty(p);
            let p = self.val(p.split(',').next().unwrap(), Ty::Ptr);
            return Inst::StoreVec { lanes: 4, v, p };
        }
        if let Some((dst, rhs)) = line.split_once(" = ") {
            if let Some(rest) = rhs.strip_prefix("load <4 x float>, ") {
                let d = self.reg(dst);
                let (_, p) = split_ty(rest);
                let p = self.val(p.split(',').next().unwrap(), Ty::Ptr);
                return Inst::LoadVec { d, lanes: 4, p };
            }
            if let Some(rest) = rhs.strip_prefix("insertelement <4 x float> ") {
                let d = self.reg(dst);
                let parts: Vec<&str> = rest.split(", ").collect();
                let agg = (parts[0] != "undef").then(|| self.val(parts[0], Ty::Agg));
                let i = parts[2].trim_start_matches("i32 ").parse().unwrap();
                return Inst::Insert { d, agg, v: self.typed(parts[1]), i };
            }
            if let Some(rest) = rhs.strip_prefix("extractelement <4 x float> ") {
                let d = self.reg(dst);
                let (agg, i) = rest.split_once(", ").unwrap();
                let i = i.trim_start_matches("i32 ").parse().unwrap();
                return Inst::Extract { d, agg: self.val(agg, Ty::Agg), i };
            }
        }
        if line.contains(" asm ") || line.contains("atomicrmw ") || line.contains("cmpxchg ") || line.starts_with("fence") || line.contains(" x ") {
            return Inst::Unsupported(line.to_string());
        }
        if let Some(rest) = line.strip_prefix("store ").map(|r| r.strip_prefix("volatile ").unwrap_or(r)) {
            let (ty, rest) = split_ty(rest);
            let (v, p) = rest.split_once(", ").unwrap();
            let v = self.val(v, ty_of(ty));
            let (_, p) = split_ty(p);
            let p = self.val(p.split(',').next().unwrap(), Ty::Ptr);
            return Inst::Store { bytes: size_of(ty), v, p };
        }
        if let Some(rest) = line.strip_prefix("br ") {
            return match rest.strip_prefix("i1 ") {
                Some(c) => {
                    let parts: Vec<&str> = c.split(", ").collect();
                    let c = self.val(parts[0], Ty::I1);
                    Inst::CondBr(c, self.label(parts[1]), self.label(parts[2]))
                }
                None => Inst::Br(self.label(rest)),
            };
        }
        if let Some(rest) = line.strip_prefix("ret ") {
            return if rest == "void" { Inst::Ret(None) } else { Inst::Ret(Some(self.typed(rest))) };
        }
        if line.starts_with("call void @llvm.nvvm.bar.warp.sync(") {
            // The warp's lanes meet here, as at a ballot (the result is ignored).
            let d = self.reg("%warp.sync");
            return Inst::Intrinsic { d, which: Intr::WarpSync, args: vec![Val::Imm(0), Val::Imm(0)] };
        }
        if line.starts_with("call void @llvm") {
            return Inst::Unsupported(line.to_string());
        }
        if let Some(rest) = line.strip_prefix("call void @") {
            let (callee, args) = rest.split_once('(').unwrap();
            let args = args.strip_suffix(')').unwrap_or(args);
            let args: Vec<Val> = if args.is_empty() { Vec::new() } else { args.split(", ").map(|a| self.typed(a)).collect() };
            return Inst::Call { d: None, callee: callee.to_string(), args };
        }
        let (dst, rhs) = line.split_once(" = ").unwrap_or_else(|| panic!("{line}"));
        let d = self.reg(dst);
        let (op, rest) = rhs.split_once(' ').unwrap();
        match op {
            "alloca" => Inst::Alloca { d },
            "load" => {
                let rest = rest.strip_prefix("volatile ").unwrap_or(rest);
                let (ty, rest) = rest.split_once(", ").unwrap();
                let (_, p) = split_ty(rest);
                let p = self.val(p.split(',').next().unwrap(), Ty::Ptr);
                Inst::Load { d, bytes: size_of(ty), p }
            }
            "getelementptr" => {
                let (elem, rest) = rest.split_once(", ").unwrap();
                let (_, rest) = split_ty(rest);
                let (p, idx) = rest.split_once(", ").unwrap();
                let p = self.val(p, Ty::Ptr);
                let (idx_ty, idx) = split_ty(idx);
                let idx_ty = ty_of(idx_ty);
                Inst::Gep { d, size: size_of(elem), p, idx: self.val(idx, idx_ty), idx_ty }
            }
            "extractvalue" => {
                let (_, rest) = split_ty(rest);
                let (agg, i) = rest.split_once(", ").unwrap();
                Inst::Extract { d, agg: self.val(agg, Ty::Agg), i: i.parse().unwrap() }
            }
            "insertvalue" => {
                let (_, rest) = split_ty(rest);
                let parts: Vec<&str> = rest.split(", ").collect();
                let agg = (parts[0] != "undef").then(|| self.val(parts[0], Ty::Agg));
                Inst::Insert { d, agg, v: self.typed(parts[1]), i: parts[2].parse().unwrap() }
            }
            "select" => {
                let parts: Vec<&str> = rest.split(", ").collect();
                let c = self.typed(parts[0]);
                Inst::Select { d, c, a: self.typed(parts[1]), b: self.typed(parts[2]) }
            }
            "fneg" => {
                let (ty, a) = split_ty(rest);
                let ty = ty_of(ty);
                Inst::Fneg { d, ty, a: self.val(a, ty) }
            }
            "icmp" | "fcmp" => {
                let (pred, rest) = rest.split_once(' ').unwrap();
                let (ty, rest) = split_ty(rest);
                let ty = ty_of(ty);
                let (a, b) = rest.split_once(", ").unwrap();
                Inst::Cmp { d, pred: pred.to_string(), ty, a: self.val(a, ty), b: self.val(b, ty) }
            }
            "call" => {
                let at = rest.find('@').unwrap();
                let (callee, args) = rest[at..].split_once('(').unwrap();
                let args = args.strip_suffix(')').unwrap_or(args);
                let args: Vec<Val> = if args.is_empty() { Vec::new() } else { args.split(", ").map(|a| self.typed(a)).collect() };
                let which = match callee {
                    "@llvm.nvvm.add.rn.d" => Some(Intr::AddD),
                    "@llvm.nvvm.mul.rn.d" => Some(Intr::MulD),
                    "@llvm.nvvm.div.rn.d" => Some(Intr::DivD),
                    "@llvm.nvvm.add.rn.f" => Some(Intr::AddF),
                    "@llvm.fabs.f64" => Some(Intr::FabsD),
                    "@llvm.fptosi.sat.i64.f64" => Some(Intr::FptosiSat),
                    "@llvm.roundeven.f64" => Some(Intr::RoundevenD),
                    "@llvm.nvvm.read.ptx.sreg.tid.x" => Some(Intr::Tid),
                    "@llvm.nvvm.read.ptx.sreg.ctaid.x" => Some(Intr::Ctaid),
                    "@llvm.nvvm.read.ptx.sreg.ctaid.y" => Some(Intr::CtaidY),
                    "@llvm.nvvm.read.ptx.sreg.nctaid.x" => Some(Intr::NctaidX),
                    "@llvm.nvvm.shfl.sync.bfly.i32" => Some(Intr::Shfl),
                    "@llvm.nvvm.shfl.sync.down.i32" => Some(Intr::ShflDown),
                    "@llvm.nvvm.vote.ballot.sync" => Some(Intr::Ballot),
                    "@llvm.ctpop.i32" => Some(Intr::Ctpop),
                    "@llvm.cttz.i32" => Some(Intr::Cttz),
                    "@llvm.ctlz.i32" => Some(Intr::Ctlz),
                    "@llvm.umax.i32" => Some(Intr::UmaxI),
                    "@llvm.nvvm.redux.sync.umax" => Some(Intr::ReduxUmax),
                    "@llvm.nvvm.read.ptx.sreg.nctaid.y" => Some(Intr::NctaidY),
                    "@llvm.nvvm.fma.rn.f" | "@llvm.fma.f32" => Some(Intr::FmaF),
                    "@llvm.nvvm.mul.rn.f" => Some(Intr::MulF),
                    "@llvm.nvvm.div.rn.f" => Some(Intr::DivF),
                    "@llvm.nvvm.rcp.approx.ftz.f" => Some(Intr::RcpApproxF),
                    "@llvm.maxnum.f32" => Some(Intr::MaxnumF),
                    "@llvm.minnum.f32" => Some(Intr::MinnumF),
                    "@llvm.fabs.f32" => Some(Intr::FabsF),
                    "@llvm.roundeven.f32" => Some(Intr::RoundevenF),
                    "@llvm.floor.f32" => Some(Intr::FloorF),
                    "@llvm.copysign.f32" => Some(Intr::CopysignF),
                    "@llvm.umin.i32" => Some(Intr::UminI),
                    "@llvm.fptosi.sat.i32.f32" => Some(Intr::FptosiSatI32F),
                    "@llvm.fptoui.sat.i64.f32" => Some(Intr::FptouiSatI64F),
                    c if c.starts_with("@llvm") => return Inst::Unsupported(line.to_string()),
                    _ => None,
                };
                match which {
                    Some(which) => Inst::Intrinsic { d, which, args },
                    None => Inst::Call { d: Some(d), callee: callee[1..].to_string(), args },
                }
            }
            _ => {
                if let Some((src, to)) = rest.split_once(" to ") {
                    let (from, a) = split_ty(src);
                    let from = ty_of(from);
                    Inst::Cast { d, op: op.to_string(), from, to: ty_of(to), a: self.val(a, from) }
                } else {
                    let (ty, rest) = split_ty(rest);
                    let ty = ty_of(ty);
                    let (a, b) = rest.split_once(", ").unwrap();
                    Inst::Bin { d, op: op.to_string(), ty, a: self.val(a, ty), b: self.val(b, ty) }
                }
            }
        }
    }
}

/// Where a parameter list (after its `(`) ends: the first `)` outside `addrspace(N)`.
fn params_end(s: &str) -> usize {
    let mut depth = 0;
    for (j, ch) in s.char_indices() {
        match ch {
            '(' => depth += 1,
            ')' if depth == 0 => return j,
            ')' => depth -= 1,
            _ => {}
        }
    }
    s.len()
}

/// The text of function `name`'s definition in `ir` (not a call site that comes first), up
/// to its closing brace.
fn definition<'a>(ir: &'a str, name: &str) -> &'a str {
    let signature = format!("@{name}(");
    let start = ir
        .match_indices("define ")
        .map(|(i, _)| i)
        .find(|&i| ir[i..].lines().next().is_some_and(|l| l.contains(&signature)))
        .unwrap_or_else(|| panic!("{name}"));
    let text = &ir[start..];
    &text[..text.find("\n}").unwrap()]
}

/// Parses function `name` of module `ir`.
pub(super) fn parse(ir: &str, name: &str, globals: &HashMap<String, u64>) -> Function {
    let text = definition(ir, name);
    let mut lines = text.lines();
    let header = lines.next().unwrap();
    let open = header.find(&format!("@{name}(")).unwrap() + name.len() + 2;
    let params_text = &header[open..open + params_end(&header[open..])];
    let params: Vec<String> = params_text.split(", ").map(|p| p.split_whitespace().last().unwrap().to_string()).collect();
    let mut parser = Parser { regs: HashMap::new(), labels: HashMap::new(), globals };
    for p in &params {
        parser.reg(p);
    }
    let mut blocks: Vec<(usize, Vec<Inst>)> = Vec::new();
    for line in lines.map(str::trim).filter(|l| !l.is_empty()) {
        if let Some(label) = line.strip_suffix(':') {
            let id = parser.label(label);
            blocks.push((id, Vec::new()));
            continue;
        }
        let inst = parser.inst(line);
        blocks.last_mut().unwrap().1.push(inst);
    }
    let mut ordered: Vec<Vec<Inst>> = (0..parser.labels.len()).map(|_| Vec::new()).collect();
    for (id, insts) in blocks {
        ordered[id] = insts;
    }
    Function { params, regs: parser.regs.len(), blocks: ordered }
}

/// Global and shared memory: buffer `id` at addresses `id << 40 ..`; allocas live per thread.
pub(super) struct Memory {
    pub(super) bufs: Vec<Vec<u8>>,
}

const LOCAL: u64 = 1 << 62;

impl Memory {
    pub(super) fn add(&mut self, bytes: Vec<u8>) -> u64 {
        self.bufs.push(bytes);
        (self.bufs.len() as u64) << 40
    }
    fn at(&mut self, addr: u64, bytes: u64) -> &mut [u8] {
        let (id, off) = ((addr >> 40) as usize, (addr & ((1 << 40) - 1)) as usize);
        assert!(id > 0, "null dereference");
        &mut self.bufs[id - 1][off..off + bytes as usize]
    }
    pub(super) fn load(&mut self, addr: u64, bytes: u64) -> u64 {
        let mut w = [0u8; 8];
        w[..bytes as usize].copy_from_slice(self.at(addr, bytes));
        u64::from_le_bytes(w)
    }
    fn store(&mut self, addr: u64, bytes: u64, v: u64) {
        let b = v.to_le_bytes();
        self.at(addr, bytes).copy_from_slice(&b[..bytes as usize]);
    }
}

fn fd(b: u64) -> f64 {
    f64::from_bits(b)
}
fn ff(b: u64) -> f32 {
    f32::from_bits(b as u32)
}

/// A launch's arguments as the interpreter's parameter words.
pub(super) fn arg_words(args: &[flashsample_codegen_ptx::KernelArg]) -> Vec<u64> {
    use flashsample_codegen_ptx::KernelArg;
    args.iter()
        .map(|a| match a {
            KernelArg::U64(v) => *v,
            KernelArg::U32(v) => u64::from(*v),
            // Only the TMA schedules read them, which the interpreter does not run.
            KernelArg::TensorMaps(_) => 0,
        })
        .collect()
}

/// A CTA's place in its grid: `ctaid.x`, `ctaid.y` and `nctaid.x`.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Cta {
    pub(super) x: u64,
    pub(super) y: u64,
    pub(super) grid_x: u64,
    pub(super) grid_y: u64,
}

/// The lane a warp shuffle reads.
#[derive(Clone, Copy)]
enum ShuffleFrom {
    /// `shfl.sync.bfly`: lane `l` reads lane `l ^ mask`.
    Xor(usize),
    /// `shfl.sync.down` over the whole warp: lane `l` reads lane `l + delta`, itself past lane 31.
    Down(usize),
}

impl ShuffleFrom {
    fn source(self, lane: usize) -> usize {
        match self {
            ShuffleFrom::Xor(mask) => lane ^ mask,
            ShuffleFrom::Down(delta) if lane + delta < 32 => lane + delta,
            ShuffleFrom::Down(_) => lane,
        }
    }
}

/// Why a thread stopped.
enum Stop {
    Barrier,
    Shuffle { d: usize, v: u64, from: ShuffleFrom },
    Ballot { d: usize, pred: bool },
    MatchAny { d: usize, v: u64 },
    Redux { d: usize, v: u64 },
    Done,
}

/// A caller's state while a thread runs a collective helper ([`Module::collective`]).
struct Frame {
    /// The caller: `None` for the kernel.
    func: Option<String>,
    block: usize,
    /// The instruction after the call.
    pc: usize,
    regs: Vec<Word>,
    /// The caller's register that takes the result.
    dest: Option<usize>,
}

/// One thread of the kernel: its block, position, registers and allocas, and the frames of
/// the collective helpers it is in (`func`: the helper it runs, `None` for the kernel).
struct Thread {
    block: usize,
    pc: usize,
    regs: Vec<Word>,
    func: Option<String>,
    frames: Vec<Frame>,
    locals: HashMap<u64, u128>,
    next_local: u64,
    tid: u64,
    stop: Option<Stop>,
}

pub(super) struct Module {
    pub(super) funcs: HashMap<String, Function>,
    /// The helpers that hold warp collectives (themselves or in a callee): a kernel thread
    /// runs them in its own frames, stopping at each collective with its warp, where other
    /// helpers run to their `ret` at once ([`Module::call`]).
    collective: std::collections::HashSet<String>,
}

impl Module {
    /// The functions `roots` of module `ir` and every `fs_` helper they call, transitively,
    /// parsed; `globals` gives the addresses of the shared arrays they name.
    pub(super) fn with_callees(ir: &str, roots: &[&str], globals: &HashMap<String, u64>) -> Module {
        let mut todo: Vec<String> = roots.iter().map(|r| r.to_string()).collect();
        let mut funcs = HashMap::new();
        while let Some(name) = todo.pop() {
            if funcs.contains_key(&name) {
                continue;
            }
            let calls = definition(ir, &name).split("call ").skip(1).filter_map(|c| c.lines().next()?.split_once('@'));
            todo.extend(calls.map(|(_, c)| c.split('(').next().unwrap().to_string()).filter(|c| c.starts_with("fs_")));
            funcs.insert(name.clone(), parse(ir, &name, globals));
        }
        let mut collective = std::collections::HashSet::new();
        loop {
            let more: Vec<String> = funcs
                .iter()
                .filter(|(name, f)| {
                    !collective.contains(*name)
                        && f.blocks.iter().flatten().any(|i| match i {
                            Inst::Intrinsic { which, .. } => {
                                matches!(which, Intr::Shfl | Intr::ShflDown | Intr::Ballot | Intr::WarpSync | Intr::MatchAny | Intr::ReduxUmax)
                            }
                            Inst::Call { callee, .. } => collective.contains(callee),
                            _ => false,
                        })
                })
                .map(|(name, _)| name.clone())
                .collect();
            if more.is_empty() {
                break;
            }
            collective.extend(more);
        }
        Module { funcs, collective }
    }

    fn get(regs: &[Word], v: Val) -> u64 {
        match v {
            Val::Reg(r) => regs[r][0],
            Val::Imm(b) => b,
        }
    }

    /// An `i128` operand (immediates are small and non-negative in the kernels).
    fn get_wide(regs: &[Word], v: Val) -> u128 {
        match v {
            Val::Reg(r) => (u128::from(regs[r][1]) << 64) | u128::from(regs[r][0]),
            Val::Imm(b) => u128::from(b),
        }
    }

    fn set_wide(w: &mut Word, v: u128) {
        w[0] = v as u64;
        w[1] = (v >> 64) as u64;
    }

    /// Executes one non-control instruction (shared by the kernel and the helpers).
    fn exec(&self, inst: &Inst, regs: &mut [Word], locals: &mut HashMap<u64, u128>, next_local: &mut u64, mem: &mut Memory, ids: (u64, Cta)) {
        let g = |regs: &[Word], v: Val| Self::get(regs, v);
        let gw = |regs: &[Word], v: Val| Self::get_wide(regs, v);
        match inst {
            Inst::Bin { d, op, ty: Ty::Wide, a, b } => {
                let (a, b) = (gw(regs, *a), gw(regs, *b));
                let r = match op.as_str() {
                    "add" => a.wrapping_add(b),
                    "sub" => a.wrapping_sub(b),
                    "mul" => a.wrapping_mul(b),
                    "and" => a & b,
                    "or" => a | b,
                    "xor" => a ^ b,
                    "shl" => a << b,
                    "lshr" => a >> b,
                    "ashr" => ((a as i128) >> b) as u128,
                    other => panic!("i128 {other}"),
                };
                Self::set_wide(&mut regs[*d], r);
            }
            Inst::Cast { d, op, from, to: Ty::Wide, a } => {
                let a = g(regs, *a);
                let r = match op.as_str() {
                    "zext" => u128::from(a),
                    "sext" => sext(a, *from) as i128 as u128,
                    other => panic!("cast {other} to i128"),
                };
                Self::set_wide(&mut regs[*d], r);
            }
            Inst::Cmp { d, pred, ty: Ty::Wide, a, b } => {
                let (a, b) = (gw(regs, *a), gw(regs, *b));
                let (x, y) = (a as i128, b as i128);
                regs[*d][0] = u64::from(match pred.as_str() {
                    "eq" => a == b,
                    "ne" => a != b,
                    "ult" => a < b,
                    "ugt" => a > b,
                    "ule" => a <= b,
                    "uge" => a >= b,
                    "sgt" => x > y,
                    "sge" => x >= y,
                    "slt" => x < y,
                    "sle" => x <= y,
                    other => panic!("i128 predicate {other}"),
                });
            }
            Inst::Load { d, bytes: 16, p } => {
                let p = g(regs, *p);
                let v = if p & LOCAL != 0 {
                    locals.get(&p).copied().unwrap_or(0)
                } else {
                    (u128::from(mem.load(p + 8, 8)) << 64) | u128::from(mem.load(p, 8))
                };
                Self::set_wide(&mut regs[*d], v);
            }
            Inst::Store { bytes: 16, v, p } => {
                let (v, p) = (gw(regs, *v), g(regs, *p));
                if p & LOCAL != 0 {
                    locals.insert(p, v);
                } else {
                    mem.store(p, 8, v as u64);
                    mem.store(p + 8, 8, (v >> 64) as u64);
                }
            }
            Inst::Bin { d, op, ty, a, b } => {
                let (a, b) = (g(regs, *a), g(regs, *b));
                let r = match op.as_str() {
                    "add" => a.wrapping_add(b),
                    "sub" => a.wrapping_sub(b),
                    "mul" => a.wrapping_mul(b),
                    "udiv" => a / b,
                    "urem" => a % b,
                    "and" => a & b,
                    "or" => a | b,
                    "xor" => a ^ b,
                    "shl" => a << b,
                    "lshr" => a >> b,
                    "ashr" => (sext(a, *ty) >> b) as u64,
                    other => panic!("{other}"),
                };
                regs[*d][0] = mask(r, *ty);
            }
            Inst::Cast { d, op, from, to, a } => {
                let a = g(regs, *a);
                regs[*d][0] = match op.as_str() {
                    "zext" | "bitcast" => a,
                    "trunc" => mask(a, *to),
                    "sext" => mask(sext(a, *from) as u64, *to),
                    "fpext" => (f64::from(ff(a))).to_bits(),
                    "sitofp" if *to == Ty::F64 => (sext(a, *from) as f64).to_bits(),
                    "uitofp" if *to == Ty::F64 => (a as f64).to_bits(),
                    "sitofp" => u64::from((sext(a, *from) as f32).to_bits()),
                    "uitofp" => u64::from((a as f32).to_bits()),
                    // LLVM's result is poison out of range; the kernels convert in range.
                    "fptoui" if *from == Ty::F32 => mask(ff(a) as u64, *to),
                    "fptosi" if *from == Ty::F32 => mask(ff(a) as i64 as u64, *to),
                    "fptoui" => mask(fd(a) as u64, *to),
                    "fptosi" => mask(fd(a) as i64 as u64, *to),
                    "fptrunc" => u64::from((fd(a) as f32).to_bits()),
                    other => panic!("cast {other}"),
                };
            }
            Inst::Cmp { d, pred, ty, a, b } => {
                let (a, b) = (g(regs, *a), g(regs, *b));
                let (x, y) = match ty {
                    Ty::F32 => (f64::from(ff(a)), f64::from(ff(b))),
                    _ => (fd(a), fd(b)),
                };
                let float = matches!(ty, Ty::F32 | Ty::F64);
                let nan = x.is_nan() || y.is_nan();
                regs[*d][0] = u64::from(match pred.as_str() {
                    // icmp (integers and pointers: `a`, `b` are their bits)
                    "eq" => a == b,
                    "ne" => a != b,
                    "ult" if !float => a < b,
                    "ugt" if !float => a > b,
                    "ule" if !float => a <= b,
                    "uge" if !float => a >= b,
                    "sgt" => sext(a, *ty) > sext(b, *ty),
                    "sge" => sext(a, *ty) >= sext(b, *ty),
                    "slt" => sext(a, *ty) < sext(b, *ty),
                    "sle" => sext(a, *ty) <= sext(b, *ty),
                    // fcmp: ordered predicates are false, unordered true, when a side is NaN.
                    "oeq" => x == y,
                    "ogt" => x > y,
                    "olt" => x < y,
                    "oge" => x >= y,
                    "ole" => x <= y,
                    "one" => !nan && x != y,
                    "ueq" => nan || x == y,
                    "une" => nan || x != y,
                    "ugt" => nan || x > y,
                    "uge" => nan || x >= y,
                    "ult" => nan || x < y,
                    "ule" => nan || x <= y,
                    "uno" => nan,
                    "ord" => !nan,
                    other => panic!("predicate {other}"),
                });
            }
            Inst::Select { d, c, a, b } => {
                regs[*d] = if g(regs, *c) & 1 == 1 { self.word(regs, *a) } else { self.word(regs, *b) };
            }
            Inst::AddIf { d, c, s, t } => {
                let s = g(regs, *s);
                regs[*d][0] = if g(regs, *c) & 1 == 1 { s.wrapping_add(g(regs, *t)) } else { s };
            }
            Inst::Fneg { d, ty, a } => {
                let a = g(regs, *a);
                regs[*d][0] = if *ty == Ty::F32 { a ^ 0x8000_0000 } else { a ^ (1 << 63) };
            }
            Inst::Alloca { d } => {
                *next_local += 8;
                regs[*d][0] = LOCAL | *next_local;
            }
            Inst::Load { d, bytes, p } => {
                let p = g(regs, *p);
                regs[*d][0] = if p & LOCAL != 0 { locals.get(&p).copied().unwrap_or(0) as u64 } else { mem.load(p, *bytes) };
            }
            Inst::Store { bytes, v, p } => {
                let (v, p) = (g(regs, *v), g(regs, *p));
                if p & LOCAL != 0 {
                    locals.insert(p, u128::from(v));
                } else {
                    mem.store(p, *bytes, v);
                }
            }
            Inst::Gep { d, size, p, idx, idx_ty } => {
                let i = sext(g(regs, *idx), *idx_ty);
                regs[*d][0] = g(regs, *p).wrapping_add((i * *size as i64) as u64);
            }
            Inst::Extract { d, agg, i } => {
                let w = self.word(regs, *agg);
                regs[*d][0] = w[*i];
            }
            Inst::Insert { d, agg, v, i } => {
                let mut w = agg.map_or([0; WORDS], |a| self.word(regs, a));
                w[*i] = g(regs, *v);
                regs[*d] = w;
            }
            Inst::Intrinsic { d, which, args } => {
                let a: Vec<u64> = args.iter().map(|v| g(regs, *v)).collect();
                regs[*d][0] = match which {
                    Intr::AddD => (fd(a[0]) + fd(a[1])).to_bits(),
                    Intr::MulD => (fd(a[0]) * fd(a[1])).to_bits(),
                    Intr::DivD => (fd(a[0]) / fd(a[1])).to_bits(),
                    Intr::AddF => u64::from((ff(a[0]) + ff(a[1])).to_bits()),
                    Intr::FabsD => fd(a[0]).abs().to_bits(),
                    Intr::FptosiSat => (fd(a[0]) as i64) as u64,
                    Intr::RoundevenD => fd(a[0]).round_ties_even().to_bits(),
                    Intr::Tid => ids.0,
                    Intr::Ctaid => ids.1.x,
                    Intr::CtaidY => ids.1.y,
                    Intr::NctaidX => ids.1.grid_x,
                    Intr::NctaidY => ids.1.grid_y,
                    Intr::Ctpop => u64::from((a[0] as u32).count_ones()),
                    // cttz(0) is 32 (the kernels pass `is_zero_poison` only for non-zero words).
                    Intr::Cttz => u64::from((a[0] as u32).trailing_zeros()),
                    Intr::UmaxI => (a[0] as u32).max(a[1] as u32).into(),
                    Intr::Ctlz => u64::from((a[0] as u32).leading_zeros()),
                    Intr::FmaF => u64::from(ff(a[0]).mul_add(ff(a[1]), ff(a[2])).to_bits()),
                    Intr::MulF => u64::from((ff(a[0]) * ff(a[1])).to_bits()),
                    Intr::DivF => u64::from((ff(a[0]) / ff(a[1])).to_bits()),
                    Intr::RcpApproxF => u64::from((1.0 / ff(a[0])).to_bits()),
                    // PTX's max/min: a NaN operand yields the other.
                    Intr::MaxnumF => u64::from(ff(a[0]).max(ff(a[1])).to_bits()),
                    Intr::MinnumF => u64::from(ff(a[0]).min(ff(a[1])).to_bits()),
                    Intr::FabsF => u64::from(ff(a[0]).abs().to_bits()),
                    Intr::RoundevenF => u64::from(ff(a[0]).round_ties_even().to_bits()),
                    Intr::FloorF => u64::from(ff(a[0]).floor().to_bits()),
                    Intr::CopysignF => u64::from(ff(a[0]).copysign(ff(a[1])).to_bits()),
                    Intr::UminI => (a[0] as u32).min(a[1] as u32).into(),
                    Intr::FptosiSatI32F => mask(ff(a[0]) as i32 as u32 as u64, Ty::I32),
                    Intr::FptouiSatI64F => ff(a[0]) as u64,
                    Intr::Shfl | Intr::ShflDown | Intr::Ballot | Intr::WarpSync | Intr::MatchAny | Intr::ReduxUmax => {
                        unreachable!("warp collectives synchronize the warp")
                    }
                };
            }
            Inst::Call { d, callee, args } => {
                let a: Vec<Word> = args.iter().map(|v| self.word(regs, *v)).collect();
                let r = self.call(callee, &a, mem);
                if let Some(d) = d {
                    regs[*d] = r;
                }
            }
            Inst::Atomic { d, op, bytes, p, v } => {
                let (p, v) = (g(regs, *p), g(regs, *v));
                let old = mem.load(p, *bytes);
                let new = match op.as_str() {
                    "add" => old.wrapping_add(v),
                    "or" => old | v,
                    "and" => old & v,
                    "xchg" => v,
                    "umax" => old.max(v),
                    "umin" => old.min(v),
                    other => panic!("atomicrmw {other}"),
                };
                let width = if *bytes == 4 { Ty::I32 } else { Ty::I64 };
                mem.store(p, *bytes, mask(new, width));
                if let Some(d) = d {
                    regs[*d][0] = old;
                }
            }
            Inst::Nop => {}
            Inst::LoadVec { d, lanes, p } => {
                let p = g(regs, *p);
                for (i, lane) in regs[*d].iter_mut().take(*lanes).enumerate() {
                    *lane = mem.load(p + 4 * i as u64, 4);
                }
            }
            Inst::StoreVec { lanes, v, p } => {
                let (w, p) = (self.word(regs, *v), g(regs, *p));
                for (i, lane) in w.iter().take(*lanes).enumerate() {
                    mem.store(p + 4 * i as u64, 4, *lane);
                }
            }
            Inst::Unsupported(line) => panic!("the interpreter does not model `{line}`"),
            other => panic!("not a straight-line instruction: {other:?}"),
        }
    }

    fn word(&self, regs: &[Word], v: Val) -> Word {
        match v {
            Val::Reg(r) => regs[r],
            Val::Imm(b) => {
                let mut w = [0; WORDS];
                w[0] = b;
                w
            }
        }
    }

    /// Runs a helper (no barriers or shuffles) to its `ret`.
    pub(super) fn call(&self, name: &str, args: &[Word], mem: &mut Memory) -> Word {
        let f = &self.funcs[name];
        let mut regs = vec![[0u64; WORDS]; f.regs];
        regs[..args.len()].copy_from_slice(args);
        let (mut locals, mut next) = (HashMap::new(), 0);
        let (mut block, mut pc) = (0, 0);
        loop {
            match &f.blocks[block][pc] {
                Inst::Br(b) => (block, pc) = (*b, 0),
                Inst::CondBr(c, t, e) => (block, pc) = (if Self::get(&regs, *c) & 1 == 1 { *t } else { *e }, 0),
                Inst::Ret(v) => return v.map_or([0; WORDS], |v| self.word(&regs, v)),
                inst => {
                    self.exec(inst, &mut regs, &mut locals, &mut next, mem, (0, Cta::default()));
                    pc += 1;
                }
            }
        }
    }

    /// Runs `t` of the kernel until it reaches a barrier, a shuffle or its end.
    fn run_thread(&self, kernel: &Function, t: &mut Thread, cta: Cta, mem: &mut Memory) {
        loop {
            let f = t.func.as_ref().map_or(kernel, |name| &self.funcs[name]);
            match &f.blocks[t.block][t.pc] {
                Inst::Br(b) => (t.block, t.pc) = (*b, 0),
                Inst::CondBr(c, a, b) => (t.block, t.pc) = (if Self::get(&t.regs, *c) & 1 == 1 { *a } else { *b }, 0),
                Inst::Ret(v) => {
                    let Some(caller) = t.frames.pop() else {
                        t.stop = Some(Stop::Done);
                        return;
                    };
                    let r = v.map_or([0; WORDS], |v| self.word(&t.regs, v));
                    (t.func, t.block, t.pc, t.regs) = (caller.func, caller.block, caller.pc, caller.regs);
                    if let Some(d) = caller.dest {
                        t.regs[d] = r;
                    }
                }
                Inst::Call { d, callee, args } if self.collective.contains(callee) => {
                    let callee_f = &self.funcs[callee];
                    let mut regs = vec![[0u64; WORDS]; callee_f.regs];
                    for (r, a) in regs.iter_mut().zip(args) {
                        *r = self.word(&t.regs, *a);
                    }
                    let caller_regs = std::mem::replace(&mut t.regs, regs);
                    let caller = Frame { func: t.func.take(), block: t.block, pc: t.pc + 1, regs: caller_regs, dest: *d };
                    t.frames.push(caller);
                    (t.func, t.block, t.pc) = (Some(callee.clone()), 0, 0);
                }
                Inst::Barrier => {
                    t.pc += 1;
                    t.stop = Some(Stop::Barrier);
                    return;
                }
                Inst::Intrinsic { d, which: Intr::ReduxUmax, args } => {
                    let v = Self::get(&t.regs, args[0]);
                    t.pc += 1;
                    t.stop = Some(Stop::Redux { d: *d, v });
                    return;
                }
                Inst::Intrinsic { d, which: Intr::MatchAny, args } => {
                    let v = Self::get(&t.regs, args[1]);
                    t.pc += 1;
                    t.stop = Some(Stop::MatchAny { d: *d, v });
                    return;
                }
                Inst::Intrinsic { d, which: Intr::Ballot | Intr::WarpSync, args } => {
                    let pred = Self::get(&t.regs, args[1]) & 1 == 1;
                    t.pc += 1;
                    t.stop = Some(Stop::Ballot { d: *d, pred });
                    return;
                }
                Inst::Intrinsic { d, which: which @ (Intr::Shfl | Intr::ShflDown), args } => {
                    let v = Self::get(&t.regs, args[1]);
                    let b = Self::get(&t.regs, args[2]) as usize;
                    let from = if *which == Intr::ShflDown {
                        assert_eq!(Self::get(&t.regs, args[3]), 31, "shfl.sync.down over a segment other than the warp");
                        ShuffleFrom::Down(b)
                    } else {
                        ShuffleFrom::Xor(b)
                    };
                    t.pc += 1;
                    t.stop = Some(Stop::Shuffle { d: *d, v, from });
                    return;
                }
                inst => {
                    self.exec(inst, &mut t.regs, &mut t.locals, &mut t.next_local, mem, (t.tid, cta));
                    t.pc += 1;
                }
            }
        }
    }

    /// Runs CTA `cta` of kernel `f` ([`DECIDE_THREADS`] threads) with parameters `params`.
    pub(super) fn run_cta(&self, f: &Function, params: &[u64], cta: u64, mem: &mut Memory) {
        self.run_cta_of(f, params, Cta { x: cta, ..Cta::default() }, DECIDE_THREADS as usize, mem);
    }

    /// Runs every CTA of `grid` (x fastest) of kernel `name` with `threads` threads each, one
    /// CTA after another: a valid schedule for kernels whose CTAs meet only through atomics.
    pub(super) fn run_grid(&self, name: &str, params: &[u64], grid: (u32, u32, u32), threads: usize, mem: &mut Memory) {
        let f = &self.funcs[name];
        for y in 0..grid.1 {
            for x in 0..grid.0 {
                let cta = Cta { x: u64::from(x), y: u64::from(y), grid_x: u64::from(grid.0), grid_y: u64::from(grid.1) };
                self.run_cta_of(f, params, cta, threads, mem);
            }
        }
    }

    /// Runs CTA `cta` of kernel `f` with `n` threads (a multiple of 32) and `params`.
    pub(super) fn run_cta_of(&self, f: &Function, params: &[u64], cta: Cta, n: usize, mem: &mut Memory) {
        let mut threads: Vec<Thread> = (0..n)
            .map(|tid| {
                let mut regs = vec![[0u64; WORDS]; f.regs];
                for (r, p) in regs.iter_mut().zip(params) {
                    r[0] = *p;
                }
                Thread { block: 0, pc: 0, regs, func: None, frames: Vec::new(), locals: HashMap::new(), next_local: 0, tid: tid as u64, stop: None }
            })
            .collect();
        loop {
            for t in threads.iter_mut().filter(|t| t.stop.is_none()) {
                self.run_thread(f, t, cta, mem);
            }
            if threads.iter().all(|t| matches!(t.stop, Some(Stop::Done))) {
                return;
            }
            let ballots = threads.iter().any(|t| matches!(t.stop, Some(Stop::Ballot { .. })));
            let matches = threads.iter().any(|t| matches!(t.stop, Some(Stop::MatchAny { .. })));
            if threads.iter().any(|t| matches!(t.stop, Some(Stop::Redux { .. }))) {
                for warp in threads.chunks_mut(32) {
                    let lanes: Vec<Option<(usize, u64)>> =
                        warp.iter().map(|t| if let Some(Stop::Redux { d, v }) = t.stop { Some((d, v)) } else { None }).collect();
                    if lanes.iter().all(Option::is_none) {
                        continue;
                    }
                    assert!(lanes.iter().all(Option::is_some), "a warp reduction reached by only some lanes");
                    let max = lanes.iter().map(|l| l.unwrap().1 as u32).max().unwrap();
                    for (lane, t) in warp.iter_mut().enumerate() {
                        t.regs[lanes[lane].unwrap().0][0] = u64::from(max);
                        t.stop = None;
                    }
                }
                continue;
            }
            if matches {
                for warp in threads.chunks_mut(32) {
                    let lanes: Vec<Option<(usize, u64)>> =
                        warp.iter().map(|t| if let Some(Stop::MatchAny { d, v }) = t.stop { Some((d, v)) } else { None }).collect();
                    if lanes.iter().all(Option::is_none) {
                        continue;
                    }
                    assert!(lanes.iter().all(Option::is_some), "a warp match reached by only some lanes");
                    for (lane, t) in warp.iter_mut().enumerate() {
                        let (d, v) = lanes[lane].unwrap();
                        let same = lanes.iter().enumerate().filter(|(_, l)| l.unwrap().1 == v).fold(0u64, |m, (i, _)| m | 1 << i);
                        t.regs[d][0] = same;
                        t.stop = None;
                    }
                }
                continue;
            }
            let shuffles = threads.iter().any(|t| matches!(t.stop, Some(Stop::Shuffle { .. })));
            if ballots {
                for warp in threads.chunks_mut(32) {
                    let lanes: Vec<Option<(usize, bool)>> =
                        warp.iter().map(|t| if let Some(Stop::Ballot { d, pred }) = t.stop { Some((d, pred)) } else { None }).collect();
                    if lanes.iter().all(Option::is_none) {
                        continue;
                    }
                    assert!(lanes.iter().all(Option::is_some), "a warp ballot reached by only some lanes");
                    let bits = lanes.iter().enumerate().filter(|(_, l)| l.unwrap().1).fold(0u64, |b, (lane, _)| b | 1 << lane);
                    for (lane, t) in warp.iter_mut().enumerate() {
                        t.regs[lanes[lane].unwrap().0][0] = bits;
                        t.stop = None;
                    }
                }
            } else if shuffles {
                for warp in threads.chunks_mut(32) {
                    let lanes: Vec<Option<(usize, u64, ShuffleFrom)>> =
                        warp.iter().map(|t| if let Some(Stop::Shuffle { d, v, from }) = t.stop { Some((d, v, from)) } else { None }).collect();
                    if lanes.iter().all(Option::is_none) {
                        continue;
                    }
                    assert!(lanes.iter().all(Option::is_some), "a warp shuffle reached by only some lanes");
                    for (lane, t) in warp.iter_mut().enumerate() {
                        let (d, _, from) = lanes[lane].unwrap();
                        t.regs[d][0] = lanes[from.source(lane)].unwrap().1;
                        t.stop = None;
                    }
                }
            } else {
                assert!(threads.iter().all(|t| matches!(t.stop, Some(Stop::Barrier))), "a barrier reached by only some threads");
                for t in &mut threads {
                    t.stop = None;
                }
            }
        }
    }
}
