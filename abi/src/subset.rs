//! Some rows of a launch as a launch of their own: the exact nucleus path (DESIGN.md step 9)
//! recomputes only the rows whose nucleus outgrew the lists, never the whole batch.

use crate::params::{mask_words_per_row, PenaltyArg, RowFilter, SamplingParams, TemperatureArg};

/// The per-row parameters of some rows of a launch, owned; [`RowSubset::params`] lends them as
/// the parameters of a launch of just those rows, in the order given. Whatever decides a row's
/// transformed logits carries over (temperature, bias, logit bias, mask, bans, penalties), and
/// so do its filter, scored target, seed and step. A row without its own seed draws by its
/// launch row ([`SamplingParams::row_stream`]): consecutive rows keep it (the subset's
/// `row_offset` is its first row's), so a range of a launch samples what the whole launch
/// would; rows picked out of order cannot, and such a subset is read for its logits and
/// lists, its samples drawn with the full launch's [`SamplingParams::row_stream`].
#[derive(Clone, Debug)]
pub struct RowSubset<'a> {
    base: SamplingParams<'a>,
    temperatures: Option<Vec<f32>>,
    mask: Option<Vec<u32>>,
    banned: Option<Vec<Vec<u32>>>,
    row_seeds: Option<Vec<u64>>,
    row_steps: Option<Vec<u32>>,
    filter: Option<Vec<RowFilter>>,
    penalties: Option<PenaltyRows>,
    logit_bias: Option<Vec<Vec<(u32, f32)>>>,
    targets: Option<Vec<u32>>,
    row_offset: u32,
}

/// Owned [`PenaltyArg`] columns of the chosen rows.
#[derive(Clone, Debug)]
struct PenaltyRows {
    repetition: Vec<f32>,
    presence: Vec<f32>,
    frequency: Vec<f32>,
    history: Vec<Vec<(u32, u32)>>,
}

/// `column[r]` for each chosen row.
fn pick<T: Clone>(column: &[T], rows: &[usize]) -> Vec<T> {
    rows.iter().map(|&r| column[r].clone()).collect()
}

impl<'a> SamplingParams<'a> {
    /// The parameters of `rows` (indices into this launch of a `vocab`-token vocabulary, after
    /// [`SamplingParams::validate`]) as a launch of their own; see [`RowSubset`].
    pub fn select_rows(&self, rows: &[usize], vocab: usize) -> RowSubset<'a> {
        let words = mask_words_per_row(vocab);
        RowSubset {
            base: *self,
            temperatures: match self.temperature {
                TemperatureArg::PerRow(t) => Some(pick(t, rows)),
                _ => None,
            },
            mask: self.mask.map(|m| rows.iter().flat_map(|&r| m[r * words..][..words].iter().copied()).collect()),
            banned: self.banned.map(|b| pick(b, rows)),
            row_seeds: self.row_seeds.map(|s| pick(s, rows)),
            row_steps: self.row_steps.map(|s| pick(s, rows)),
            filter: self.filter.map(|f| pick(f, rows)),
            penalties: self.penalties.map(|p| PenaltyRows {
                repetition: pick(p.repetition, rows),
                presence: pick(p.presence, rows),
                frequency: pick(p.frequency, rows),
                history: pick(p.history, rows),
            }),
            logit_bias: self.logit_bias.map(|b| pick(b, rows)),
            targets: self.targets.map(|t| pick(t, rows)),
            row_offset: match rows.first() {
                Some(&first) if rows.windows(2).all(|w| w[1] == w[0] + 1) => self.row_offset.wrapping_add(first as u32),
                _ => self.row_offset,
            },
        }
    }
}

impl RowSubset<'_> {
    /// The chosen rows' parameters, row `i` being the `i`-th chosen row.
    pub fn params(&self) -> SamplingParams<'_> {
        SamplingParams {
            temperature: match (&self.temperatures, self.base.temperature) {
                (Some(t), _) => TemperatureArg::PerRow(t),
                (None, other) => other,
            },
            mask: self.mask.as_deref(),
            banned: self.banned.as_deref(),
            row_seeds: self.row_seeds.as_deref(),
            row_steps: self.row_steps.as_deref(),
            filter: self.filter.as_deref(),
            penalties: self.penalties.as_ref().map(|p| PenaltyArg {
                repetition: &p.repetition,
                presence: &p.presence,
                frequency: &p.frequency,
                history: &p.history,
            }),
            logit_bias: self.logit_bias.as_deref(),
            targets: self.targets.as_deref(),
            // Drafts belong to sequences of rows, not to rows: a recompute of draft rows
            // passes what verification needs itself (runtime `verify`).
            drafts: None,
            draft_probs: None,
            // Launch-wide values are the full launch's. Every field is named (no `..base`), so
            // a new per-row parameter cannot silently carry the whole batch's value.
            bias: self.base.bias,
            seed: self.base.seed,
            vocab_offset: self.base.vocab_offset,
            row_offset: self.row_offset,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashsample_ir::{DType, PipelineBuilder};

    #[test]
    fn a_subset_row_has_the_full_rows_logit_parameters() {
        let p = PipelineBuilder::new("S", DType::F32, DType::F32)
            .temperature_per_row("t")
            .mask("m")
            .ban("b")
            .penalties("pen")
            .filter("f", 4)
            .build()
            .unwrap();
        let (batch, vocab) = (3, 40);
        let temps = [0.5, 0.0, 2.0];
        let mask: Vec<u32> = (0..batch * 2).map(|i| 0x0f0f_0f0f ^ i as u32).collect();
        let banned = vec![vec![1], vec![], vec![3, 39]];
        let steps = [7, 8, 9];
        let filters = [RowFilter::top_k(2), RowFilter::OFF, RowFilter::top_p(0.9)];
        let history = vec![vec![(5, 1)], vec![], vec![(6, 2), (38, 0)]];
        let full = SamplingParams {
            temperature: TemperatureArg::PerRow(&temps),
            mask: Some(&mask),
            banned: Some(&banned),
            row_steps: Some(&steps),
            filter: Some(&filters),
            penalties: Some(PenaltyArg { repetition: &[1.1, 1.2, 1.3], presence: &[0.1, 0.2, 0.3], frequency: &[0.4, 0.5, 0.6], history: &history }),
            seed: 11,
            ..Default::default()
        };
        full.validate(&p, batch, vocab).unwrap();
        let subset = full.select_rows(&[2, 0], vocab);
        let sub = subset.params();
        sub.validate(&p, 2, vocab).unwrap();
        let (full_bits, sub_bits) = (full.allowed_bitset(batch, vocab).unwrap(), sub.allowed_bitset(2, vocab).unwrap());
        let (full_pen, sub_pen) = (full.penalty_table(batch, vocab).unwrap(), sub.penalty_table(2, vocab).unwrap());
        for (i, r) in [(0, 2), (1, 0)] {
            assert_eq!(sub.row_temperature(&p, i), full.row_temperature(&p, r));
            assert_eq!(sub_bits[i * 2..][..2], full_bits[r * 2..][..2]);
            assert_eq!(sub.row_filter(i), full.row_filter(r));
            assert_eq!(sub.row_step(i), full.row_step(r));
            for v in 0..vocab as u32 {
                assert_eq!(sub_pen.apply(i, v, 1.5).to_bits(), full_pen.apply(r, v, 1.5).to_bits(), "row {r} token {v}");
            }
        }
        assert_eq!(sub.seed, 11);
    }

    #[test]
    fn a_range_of_rows_keeps_their_noise_streams() {
        let full = SamplingParams { seed: 5, row_offset: 100, ..Default::default() };
        let range = full.select_rows(&[3, 4, 5], 16);
        for (i, r) in [(0, 3), (1, 4), (2, 5)] {
            assert_eq!(range.params().row_stream(i), full.row_stream(r));
        }
        assert_eq!(full.row_stream(4), (5, 104));
        // Out of order there is no one offset: the subset keeps the launch's and says so.
        let scattered = full.select_rows(&[5, 3], 16);
        assert_eq!(scattered.params().row_offset, 100);
        // Rows with their own seeds never depend on it.
        let seeds = [9, 8];
        let seeded = SamplingParams { row_seeds: Some(&seeds), row_offset: 7, ..Default::default() };
        assert_eq!(seeded.row_stream(1), (8, 0));
    }

    #[test]
    fn a_row_offset_past_two_to_the_32_is_an_error() {
        let p = PipelineBuilder::new("S", DType::F32, DType::F32).gumbel("seed", 1).build().unwrap();
        let at = |offset: u32, batch: usize| SamplingParams { row_offset: offset, ..Default::default() }.validate(&p, batch, 8);
        assert_eq!(at(u32::MAX, 1), Ok(()));
        assert_eq!(at(u32::MAX, 2), Err(crate::ParamError::RowOffset { offset: u32::MAX, batch: 2 }));
    }
}
