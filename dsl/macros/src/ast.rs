//! The syntax tree of a `flashsample!` invocation, exactly as written.
//!
//! Parsing is deliberately loose (any `name(args)` call, any of `/ + - *`): what an op
//! *means* is decided in `lower`, which can then say "unknown op `frobnicate`" with the
//! op's span instead of syn's generic "expected ...".

use proc_macro2::{Punct, Spacing, Span, TokenStream};
use quote::{ToTokens, TokenStreamExt};
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{braced, bracketed, parenthesized, token, Attribute, Ident, Lit, Token, Visibility};

/// A first..last token range. `syn::Error::new_spanned` reads only the first and last token
/// spans of what it is given, so two spanned puncts are enough to underline any range; this
/// is the only way to get a multi-token range on stable, where `Span::join` is unavailable.
#[derive(Clone, Copy)]
pub struct SpanRange(pub Span, pub Span);

impl SpanRange {
    pub fn single(span: Span) -> Self {
        SpanRange(span, span)
    }
    pub fn error(self, message: impl std::fmt::Display) -> syn::Error {
        syn::Error::new_spanned(self, message)
    }
}

impl ToTokens for SpanRange {
    fn to_tokens(&self, tokens: &mut TokenStream) {
        for span in [self.0, self.1] {
            let mut p = Punct::new('#', Spacing::Alone);
            p.set_span(span);
            tokens.append(p);
        }
    }
}

/// The whole invocation: one or more pipelines.
pub struct Input {
    pub pipelines: Vec<PipelineDef>,
}

impl Parse for Input {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let mut pipelines = Vec::new();
        while !input.is_empty() {
            pipelines.push(input.parse()?);
        }
        if pipelines.is_empty() {
            return Err(input.error("expected at least one `pipeline Name { ... }`"));
        }
        Ok(Input { pipelines })
    }
}

/// `#[attrs] vis pipeline Name { operands; statements }`.
pub struct PipelineDef {
    pub attrs: Vec<Attribute>,
    pub vis: Visibility,
    pub name: Ident,
    pub operands: Vec<OperandDecl>,
    /// From the first operand to the `;` that ends the declarations.
    pub operands_range: SpanRange,
    pub stmts: Vec<Stmt>,
}

impl Parse for PipelineDef {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let attrs = input.call(Attribute::parse_outer)?;
        let vis: Visibility = input.parse()?;
        let kw: Ident = input
            .parse()
            .map_err(|e| syn::Error::new(e.span(), "expected `pipeline Name { ... }`"))?;
        if kw != "pipeline" {
            return Err(syn::Error::new_spanned(
                &kw,
                format!("expected `pipeline`, found `{kw}`"),
            ));
        }
        let name: Ident = input.parse()?;
        let body;
        braced!(body in input);

        let first = body.span();
        let mut operands = Vec::new();
        let last = loop {
            operands.push(body.parse::<OperandDecl>()?);
            if body.peek(Token![,]) {
                body.parse::<Token![,]>()?;
            }
            if body.peek(Token![;]) {
                let semi: Token![;] = body.parse()?;
                // `a: t[..]; b: t[..];` is accepted too: a statement never starts `ident :`.
                if !(body.peek(Ident) && body.peek2(Token![:])) {
                    break semi.span;
                }
            } else if !body.peek(Ident) {
                return Err(body.error("expected `,` or `;` after an operand declaration"));
            }
        };
        let mut stmts = Vec::new();
        while !body.is_empty() {
            stmts.push(body.parse()?);
        }
        Ok(PipelineDef {
            attrs,
            vis,
            name,
            operands,
            operands_range: SpanRange(first, last),
            stmts,
        })
    }
}

/// `name: dtype[rows, cols]`.
pub struct OperandDecl {
    pub name: Ident,
    pub dtype: Ident,
    pub bracket: token::Bracket,
    pub dims: Punctuated<Ident, Token![,]>,
}

impl OperandDecl {
    pub fn range(&self) -> SpanRange {
        SpanRange(self.name.span(), self.bracket.span.close())
    }
}

impl Parse for OperandDecl {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let name: Ident = input
            .parse()
            .map_err(|e| syn::Error::new(e.span(), "expected an operand declaration `name: dtype[rows, cols]`"))?;
        input.parse::<Token![:]>()?;
        let dtype: Ident = input.parse()?;
        let content;
        let bracket = bracketed!(content in input);
        let dims = Punctuated::parse_terminated(&content)?;
        Ok(OperandDecl {
            name,
            dtype,
            bracket,
            dims,
        })
    }
}

/// One `;`-terminated statement of the body.
pub enum Stmt {
    /// `logits = ...;` or `sample = ...;` (or any other target, rejected in lowering).
    Assign { target: Ident, expr: Expr, semi: Token![;] },
    /// `outputs(...);` (or any other bare call, rejected in lowering).
    Call { call: Call, semi: Token![;] },
}

impl Stmt {
    pub fn range(&self) -> SpanRange {
        match self {
            Stmt::Assign { target, semi, .. } => SpanRange(target.span(), semi.span),
            Stmt::Call { call, semi } => SpanRange(call.func.span(), semi.span),
        }
    }
}

impl Parse for Stmt {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let head: Ident = input.parse().map_err(|e| {
            syn::Error::new(
                e.span(),
                "expected a statement: `logits = ...;`, `sample = ...;` or `outputs(...);`",
            )
        })?;
        if input.peek(Token![=]) {
            input.parse::<Token![=]>()?;
            let expr = input.parse()?;
            Ok(Stmt::Assign {
                target: head,
                expr,
                semi: input.parse()?,
            })
        } else if input.peek(token::Paren) {
            let call = Call::parse_after(head, input)?;
            Ok(Stmt::Call {
                call,
                semi: input.parse()?,
            })
        } else {
            Err(input.error("expected `=` or `(`"))
        }
    }
}

/// The right-hand side of an assignment.
pub enum Expr {
    /// `op(args)`.
    Call(Call),
    /// `lhs / rhs`, `lhs + rhs` (and `-`, `*`, parsed only to be rejected precisely).
    Binary { lhs: Ident, op: BinOp, rhs: Arg },
}

impl Parse for Expr {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let head: Ident = input.parse()?;
        if input.peek(token::Paren) {
            return Ok(Expr::Call(Call::parse_after(head, input)?));
        }
        let op = if input.peek(Token![/]) {
            {
                input.parse::<Token![/]>()?;
                BinOp::Div
            }
        } else if input.peek(Token![+]) {
            {
                input.parse::<Token![+]>()?;
                BinOp::Add
            }
        } else if input.peek(Token![-]) {
            BinOp::Other('-', input.parse::<Token![-]>()?.span)
        } else if input.peek(Token![*]) {
            BinOp::Other('*', input.parse::<Token![*]>()?.span)
        } else {
            return Err(input.error("expected `op(...)`, `logits / temperature` or `logits + bias[V]`"));
        };
        Ok(Expr::Binary {
            lhs: head,
            op,
            rhs: input.parse()?,
        })
    }
}

pub enum BinOp {
    Div,
    Add,
    Other(char, Span),
}

/// `func(arg, ...)`.
pub struct Call {
    pub func: Ident,
    pub paren: token::Paren,
    pub args: Punctuated<Arg, Token![,]>,
}

impl Call {
    fn parse_after(func: Ident, input: ParseStream) -> syn::Result<Self> {
        let content;
        let paren = parenthesized!(content in input);
        let args = Punctuated::parse_terminated(&content)?;
        Ok(Call { func, paren, args })
    }
    pub fn range(&self) -> SpanRange {
        SpanRange(self.func.span(), self.paren.span.close())
    }
}

/// A call argument or the right operand of `/` and `+`.
pub enum Arg {
    /// `logits`, `seed`, a scalar `temperature`.
    Ident(Ident),
    /// `bias[V]`, `allowed[B, V]`.
    Indexed {
        name: Ident,
        bracket: token::Bracket,
        dims: Punctuated<Ident, Token![,]>,
    },
    /// `30.0`, `-1.0`, `1`.
    Number(Number),
    /// `samples = 2`, `max_k = 64`, `top_logprobs = 5`.
    Named { name: Ident, value: Number },
}

impl Arg {
    pub fn range(&self) -> SpanRange {
        match self {
            Arg::Ident(i) => SpanRange::single(i.span()),
            Arg::Indexed { name, bracket, .. } => SpanRange(name.span(), bracket.span.close()),
            Arg::Number(n) => n.range(),
            Arg::Named { name, value } => SpanRange(name.span(), value.range().1),
        }
    }
    pub fn is_ident(&self, s: &str) -> bool {
        matches!(self, Arg::Ident(i) if i == s)
    }
}

impl Parse for Arg {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        if input.peek(Token![-]) || input.peek(syn::LitFloat) || input.peek(syn::LitInt) {
            return Ok(Arg::Number(input.parse()?));
        }
        let name: Ident = input.parse().map_err(|e| {
            syn::Error::new(
                e.span(),
                "expected an argument: a name, `name[dims]`, a number or `name = N`",
            )
        })?;
        if input.peek(token::Bracket) {
            let content;
            let bracket = bracketed!(content in input);
            let dims = Punctuated::parse_terminated(&content)?;
            Ok(Arg::Indexed { name, bracket, dims })
        } else if input.peek(Token![=]) {
            input.parse::<Token![=]>()?;
            Ok(Arg::Named {
                name,
                value: input.parse()?,
            })
        } else {
            Ok(Arg::Ident(name))
        }
    }
}

/// A numeric literal with an optional leading `-`.
pub struct Number {
    pub neg: Option<Span>,
    pub lit: Lit,
}

impl Number {
    pub fn range(&self) -> SpanRange {
        SpanRange(self.neg.unwrap_or(self.lit.span()), self.lit.span())
    }
    /// The value as the nearest f32 (parsed directly as f32: no double rounding through f64).
    pub fn f32(&self) -> syn::Result<f32> {
        let v = match &self.lit {
            Lit::Float(f) => f.base10_parse::<f32>()?,
            Lit::Int(i) => i.base10_parse::<f32>()?,
            _ => return Err(self.range().error("expected a number")),
        };
        Ok(if self.neg.is_some() { -v } else { v })
    }
    /// The value as a `u32` count: an unsuffixed or integer-suffixed integer literal.
    pub fn u32(&self) -> syn::Result<u32> {
        match (&self.lit, self.neg) {
            (Lit::Int(i), None) => i.base10_parse::<u32>(),
            _ => Err(self.range().error("expected a non-negative integer")),
        }
    }
}

impl Parse for Number {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let neg = if input.peek(Token![-]) {
            Some(input.parse::<Token![-]>()?.span)
        } else {
            None
        };
        let lit: Lit = input.parse()?;
        match lit {
            Lit::Float(_) | Lit::Int(_) => Ok(Number { neg, lit }),
            other => Err(syn::Error::new_spanned(other, "expected a number")),
        }
    }
}
