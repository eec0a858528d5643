//! Per-row launch status: what only the kernels know about a row (all tokens masked, a
//! non-finite logit, lists too short, a nucleus larger than the lists). The kernels write these
//! codes to a `u32 [B]` status buffer; the runtime turns them into typed row errors. Defined once
//! here, emitted by `codegen-ptx` and read by the runtime.

use crate::{ListError, RowError};

/// A row's outcome as the kernels write it (`u32` codes, 0 = ok).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum RowStatus {
    /// The row's sample is valid.
    Ok = 0,
    /// Every token of the row is masked, banned or `-inf`.
    AllMasked = 1,
    /// A logit of the row is NaN or infinite.
    NonFinite = 2,
    /// A tile list was shorter than the filter needed (the launch reruns with longer lists).
    ListOverflow = 3,
    /// The row's top-p / min-p nucleus holds more tokens than the lists.
    NucleusTooLarge = 4,
}

impl RowStatus {
    /// Every status, in code order.
    pub const ALL: [RowStatus; 5] =
        [RowStatus::Ok, RowStatus::AllMasked, RowStatus::NonFinite, RowStatus::ListOverflow, RowStatus::NucleusTooLarge];

    /// The code the kernels store.
    pub const fn code(self) -> u32 {
        self as u32
    }

    /// The status a kernel stored, `None` for a code no kernel writes.
    pub fn from_code(code: u32) -> Option<RowStatus> {
        RowStatus::ALL.get(code as usize).copied()
    }

    /// The typed error of `row` with this status, `None` for [`RowStatus::Ok`]; `capacity` is the
    /// launch's list capacity (named by [`ListError::NucleusTooLarge`]).
    pub fn error(self, row: usize, capacity: usize) -> Option<RowStatusError> {
        match self {
            RowStatus::Ok => None,
            RowStatus::AllMasked => Some(RowStatusError::Row(RowError::AllMasked { row })),
            RowStatus::NonFinite => Some(RowStatusError::Row(RowError::NonFinite { row })),
            RowStatus::ListOverflow => Some(RowStatusError::List(ListError::Overflow { row })),
            RowStatus::NucleusTooLarge => Some(RowStatusError::List(ListError::NucleusTooLarge { row, capacity })),
        }
    }
}

impl From<ListError> for RowStatus {
    /// The status stage three writes for a list error (the inverse of [`RowStatus::error`]).
    fn from(e: ListError) -> RowStatus {
        match e {
            ListError::Overflow { .. } => RowStatus::ListOverflow,
            ListError::NucleusTooLarge { .. } => RowStatus::NucleusTooLarge,
        }
    }
}

/// The typed error a non-ok [`RowStatus`] stands for.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RowStatusError {
    /// Status 1 or 2.
    #[error(transparent)]
    Row(#[from] RowError),
    /// Status 3 or 4.
    #[error(transparent)]
    List(#[from] ListError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for s in RowStatus::ALL {
            assert_eq!(RowStatus::from_code(s.code()), Some(s));
        }
        assert_eq!(RowStatus::from_code(5), None);
        assert_eq!(RowStatus::Ok.error(3, 64), None);
        assert_eq!(RowStatus::NonFinite.error(3, 64), Some(RowStatusError::Row(RowError::NonFinite { row: 3 })));
    }
}
