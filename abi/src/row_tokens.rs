//! Per-row sparse token tables as kernels read them: a bitset for the test every logit takes,
//! and sorted CSR lists found by binary search. One lookup serves every per-row table
//! (penalties, logit bias); each table adds its per-entry values.

/// Per-row sets of token ids: bit `v % 32` of `bits[r * ceil(V/32) + v / 32]` is set iff `v`
/// is listed in row `r`, whose entries are `tokens[offsets[r] .. offsets[r + 1]]`, sorted and
/// distinct. A listed token's entry index (into a table's per-entry values) is its position in
/// `tokens`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowTokens {
    /// `[B, ceil(V/32)]`, bit `v % 32` of word `v / 32`; the padding bits past `V` are 0.
    pub bits: Vec<u32>,
    /// `[B + 1]`: row `r`'s entries are `offsets[r]..offsets[r + 1]`.
    pub offsets: Vec<u32>,
    /// Sorted, distinct per row.
    pub tokens: Vec<u32>,
}

/// A table whose arrays do not have the layout [`RowTokens`] documents.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RowTokensError {
    /// An array of the wrong length.
    #[error("`{what}` has {got} elements, expected {expected}")]
    Length {
        /// The array.
        what: &'static str,
        /// Its expected length.
        expected: usize,
        /// Its length.
        got: usize,
    },
    /// The offsets are not a CSR index of the tokens, or a row's tokens are not sorted and distinct.
    #[error("row {row}: the offsets are not a CSR index of sorted, distinct tokens")]
    Csr {
        /// The first row that breaks it.
        row: usize,
    },
}

impl RowTokens {
    /// The table of `batch` rows over a `vocab`-token vocabulary listing `rows[r]`'s tokens in
    /// row `r`; each row's tokens must be sorted and distinct (callers validate first).
    pub fn from_sorted_rows<R: IntoIterator<Item = u32>>(vocab: usize, rows: impl IntoIterator<Item = R>) -> RowTokens {
        let words = crate::params::mask_words_per_row(vocab);
        let mut t = RowTokens { bits: Vec::new(), offsets: vec![0], tokens: Vec::new() };
        for (row, tokens) in rows.into_iter().enumerate() {
            t.bits.resize((row + 1) * words, 0);
            for tok in tokens {
                t.bits[row * words + tok as usize / 32] |= 1 << (tok % 32);
                t.tokens.push(tok);
            }
            t.offsets.push(t.tokens.len() as u32);
        }
        t
    }

    /// Rows of the table.
    pub fn batch(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    /// The entry index of token `v` in `row`'s list, `None` if it is not listed (or `v` is past
    /// the vocabulary).
    pub fn find(&self, row: usize, v: u32) -> Option<usize> {
        let words = self.bits.len() / self.batch().max(1);
        if v as usize / 32 >= words || self.bits[row * words + v as usize / 32] >> (v % 32) & 1 == 0 {
            return None;
        }
        let (lo, hi) = (self.offsets[row] as usize, self.offsets[row + 1] as usize);
        self.tokens[lo..hi].binary_search(&v).ok().map(|j| lo + j)
    }

    /// Checks the layout a kernel relies on for `batch` rows of `vocab` tokens, with `values`
    /// per-entry values: lengths, and offsets that index sorted, distinct rows of `tokens`.
    pub fn check(&self, batch: usize, vocab: usize, values: usize) -> Result<(), RowTokensError> {
        let words = crate::params::mask_words_per_row(vocab);
        for (what, expected, got) in [
            ("bitset", batch * words, self.bits.len()),
            ("offsets", batch + 1, self.offsets.len()),
            ("values", self.tokens.len(), values),
        ] {
            if got != expected {
                return Err(RowTokensError::Length { what, expected, got });
            }
        }
        if self.offsets[0] != 0 {
            return Err(RowTokensError::Csr { row: 0 });
        }
        for row in 0..batch {
            let (lo, hi) = (self.offsets[row] as usize, self.offsets[row + 1] as usize);
            let sorted = lo <= hi && hi <= self.tokens.len() && self.tokens[lo..hi].windows(2).all(|w| w[0] < w[1]);
            if !sorted {
                return Err(RowTokensError::Csr { row });
            }
        }
        if self.offsets[batch] as usize != self.tokens.len() {
            return Err(RowTokensError::Csr { row: batch.saturating_sub(1) });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_exactly_the_listed_tokens() {
        let t = RowTokens::from_sorted_rows(70, [vec![0u32, 31, 32, 69], vec![], vec![5]]);
        t.check(3, 70, 5).unwrap();
        assert_eq!(t.bits.len(), 3 * 3);
        for v in 0..80u32 {
            let want = [0u32, 31, 32, 69].iter().position(|&t| t == v);
            assert_eq!(t.find(0, v), want, "row 0 token {v}");
            assert_eq!(t.find(1, v), None);
            assert_eq!(t.find(2, v), (v == 5).then_some(4));
        }
    }

    #[test]
    fn rejects_broken_layouts() {
        let t = RowTokens::from_sorted_rows(64, [vec![1u32, 2], vec![3]]);
        assert_eq!(t.check(2, 64, 2), Err(RowTokensError::Length { what: "values", expected: 3, got: 2 }));
        assert_eq!(t.check(3, 64, 3), Err(RowTokensError::Length { what: "bitset", expected: 6, got: 4 }));
        let mut unsorted = t.clone();
        unsorted.tokens = vec![2, 1, 3];
        assert_eq!(unsorted.check(2, 64, 3), Err(RowTokensError::Csr { row: 0 }));
        let mut past = t.clone();
        past.offsets = vec![0, 2, 4];
        assert_eq!(past.check(2, 64, 3), Err(RowTokensError::Csr { row: 1 }));
        let mut short = t;
        short.offsets = vec![0, 1, 2];
        assert_eq!(short.check(2, 64, 3), Err(RowTokensError::Csr { row: 1 }));
    }
}
