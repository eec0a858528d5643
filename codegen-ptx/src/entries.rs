//! The abi's ranked entries as IR values: [`Candidate`] (`abi::Candidate`, a tile's or a
//! block's best token; the speculative decision's f64-scored one) with the order every argmax
//! of the kernels uses and its warp reduction, and [`Scored`] (`abi::filter::Scored`, a list
//! entry), each with its global-memory layout from the abi struct.

use crate::ir::{i32c, Fcmp, Float, Func, Global, Icmp, Ptr, Shuffle, Var, F32, I1, I32, I64};
use crate::params::arg;
use flashsample_abi::INDEX_NONE;
use std::mem::{offset_of, size_of};

/// A candidate token: its score (`S`: f32, or f64 in the speculative decision), index and
/// logit (the payload the winner reports).
#[derive(Clone, Debug)]
pub(crate) struct Candidate<S = F32> {
    pub(crate) score: S,
    pub(crate) index: I32,
    pub(crate) logit: F32,
}

/// `abi::StageTwo::beats`: candidate 1 beats candidate 2 (higher score, ties to the lower index).
pub(crate) fn beats<S: Float>(f: &mut Func, score1: &S, index1: &I32, score2: &S, index2: &I32) -> I1 {
    let gt = f.fcmp(Fcmp::Ogt, score1, score2);
    let eq = f.fcmp(Fcmp::Oeq, score1, score2);
    let lo = f.icmp(Icmp::Ult, index1, index2);
    let tie = f.and(&eq, &lo);
    f.or(&gt, &tie)
}

impl<S: Float + Shuffle> Candidate<S> {
    /// No candidate: `(-inf, INDEX_NONE, -inf)`, which every real one beats.
    pub(crate) fn none() -> Self {
        Candidate { score: S::NEG_INF, index: i32c(INDEX_NONE as i32), logit: F32::NEG_INF }
    }

    /// Whether this candidate beats `other` ([`beats`]).
    pub(crate) fn beats(&self, f: &mut Func, other: &Self) -> I1 {
        beats(f, &self.score, &self.index, &other.score, &other.index)
    }

    /// `a` where `c`, else `b`, field by field.
    pub(crate) fn select(f: &mut Func, c: &I1, a: &Self, b: &Self) -> Self {
        Candidate { score: f.sel(c, &a.score, &b.score), index: f.sel(c, &a.index, &b.index), logit: f.sel(c, &a.logit, &b.logit) }
    }

    /// Lane `lane ^ mask`'s candidate, every field.
    pub(crate) fn shfl_xor(&self, f: &mut Func, mask: u32) -> Self {
        Candidate { score: f.shfl_xor(&self.score, mask), index: f.shfl_xor(&self.index, mask), logit: f.shfl_xor(&self.logit, mask) }
    }

    /// `other` where it beats `self`, else `self`.
    pub(crate) fn keep_best(self, f: &mut Func, other: &Self) -> Self {
        let take = other.beats(f, &self);
        Candidate::select(f, &take, other, &self)
    }

    /// [`Candidate::keep_best`] over the lanes of a warp: one butterfly step per shuffle mask
    /// in `masks`, so the lanes the masks span end with their best candidate.
    pub(crate) fn shfl_best(self, f: &mut Func, masks: &[u32]) -> Self {
        let mut best = self;
        for &sh in masks {
            let other = best.shfl_xor(f, sh);
            best = best.keep_best(f, &other);
        }
        best
    }

    /// [`Candidate::shfl_best`] that moves only the score and index: the lanes the masks span
    /// agree on their best (score, index), each keeps its own logit, and `held` says whether
    /// this lane's own candidate is that best (exactly one lane's, as indices differ, unless
    /// the best is `none`, which every lane without a candidate holds alike). The holder
    /// reports the logit.
    pub(crate) fn shfl_best_held(self, f: &mut Func, masks: &[u32]) -> (Self, I1) {
        let own = self.index.clone();
        let mut best = self;
        for &sh in masks {
            let (score, index) = (f.shfl_xor(&best.score, sh), f.shfl_xor(&best.index, sh));
            let take = beats(f, &score, &index, &best.score, &best.index);
            best.score = f.sel(&take, &score, &best.score);
            best.index = f.sel(&take, &index, &best.index);
        }
        let held = f.icmp(Icmp::Eq, &own, &best.index);
        (best, held)
    }
}

/// `abi::Candidate`'s size in global memory and its fields' offsets.
pub(crate) const CANDIDATE_BYTES: u32 = size_of::<flashsample_abi::Candidate>() as u32;
const CANDIDATE_INDEX: u32 = offset_of!(flashsample_abi::Candidate, index) as u32;
const CANDIDATE_LOGIT: u32 = offset_of!(flashsample_abi::Candidate, logit) as u32;
const _: () = assert!(offset_of!(flashsample_abi::Candidate, score) == 0);

impl Candidate {
    /// The `abi::Candidate` at `at`.
    pub(crate) fn load(f: &mut Func, at: &Ptr<Global>) -> Candidate {
        let score = f.load(at, 4);
        let a = f.offset(at, CANDIDATE_INDEX);
        let index = f.load(&a, 4);
        let a = f.offset(at, CANDIDATE_LOGIT);
        let logit = f.load(&a, 4);
        Candidate { score, index, logit }
    }

    /// Writes this candidate as sample `at` of the kernel's outputs: its index to
    /// `%out_tokens`, its score to `%out_scores`, its logit to `%out_logits`.
    pub(crate) fn store_sample(&self, f: &mut Func, at: &I64) {
        let a = f.gaddr(&arg::OUT_TOKENS, at, 4);
        f.store(&self.index, &a, 4);
        let a = f.gaddr(&arg::OUT_SCORES, at, 4);
        f.store(&self.score, &a, 4);
        let a = f.gaddr(&arg::OUT_LOGITS, at, 4);
        f.store(&self.logit, &a, 4);
    }

    /// Stores this candidate as the `abi::Candidate` at `at`.
    pub(crate) fn store(&self, f: &mut Func, at: &Ptr<Global>) {
        f.store(&self.score, at, 4);
        let a = f.offset(at, CANDIDATE_INDEX);
        f.store(&self.index, &a, 4);
        let a = f.offset(at, CANDIDATE_LOGIT);
        f.store(&self.logit, &a, 4);
    }
}

/// A list entry (`abi::filter::Scored`): a logit and its token.
#[derive(Clone, Debug)]
pub(crate) struct Scored {
    pub(crate) logit: F32,
    pub(crate) index: I32,
}

/// `abi::filter::Scored`'s size and its index's offset (the logit comes first).
pub(crate) const SCORED_BYTES: u32 = size_of::<flashsample_abi::filter::Scored>() as u32;
pub(crate) const SCORED_INDEX: u32 = offset_of!(flashsample_abi::filter::Scored, index) as u32;
const _: () = assert!(offset_of!(flashsample_abi::filter::Scored, logit) == 0);

impl Scored {
    /// The `abi::filter::Scored` at `at`.
    pub(crate) fn load(f: &mut Func, at: &Ptr<Global>) -> Scored {
        let logit = f.load(at, 4);
        let a = f.offset(at, SCORED_INDEX);
        let index = f.load(&a, 4);
        Scored { logit, index }
    }

    /// Stores this entry as the `abi::filter::Scored` at `at`.
    pub(crate) fn store(&self, f: &mut Func, at: &Ptr<Global>) {
        f.store(&self.logit, at, 4);
        let a = f.offset(at, SCORED_INDEX);
        f.store(&self.index, &a, 4);
    }
}

/// A [`Candidate`] in three mutable values: a running best that branches update.
pub(crate) struct CandidateVar<S = F32> {
    pub(crate) score: Var<S>,
    pub(crate) index: Var<I32>,
    pub(crate) logit: Var<F32>,
}

impl<S: Float> CandidateVar<S> {
    /// The variables, initialised here to `init`.
    pub(crate) fn new(f: &mut Func, init: &Candidate<S>) -> Self {
        CandidateVar { score: f.var(&init.score), index: f.var(&init.index), logit: f.var(&init.logit) }
    }

    pub(crate) fn get(&self, f: &mut Func) -> Candidate<S> {
        Candidate { score: f.get(&self.score), index: f.get(&self.index), logit: f.get(&self.logit) }
    }

    pub(crate) fn set(&self, f: &mut Func, c: &Candidate<S>) {
        f.set(&self.score, &c.score);
        f.set(&self.index, &c.index);
        f.set(&self.logit, &c.logit);
    }
}
