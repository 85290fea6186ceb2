//! Response bodies as lists of shared `Bytes` fragments.
//! STUB: signatures fixed; the protocol helper implements them.

use bytes::Bytes;

use super::SerializedRow;

/// Change operation of one emitted row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    Insert,
    Update,
}

/// A JSON array body made of fragments; `len()` is the exact byte length.
#[derive(Clone, Debug, Default)]
pub struct FragmentBody {
    pub chunks: Vec<Bytes>,
}

impl FragmentBody {
    /// `[change…, {"headers":{"control":"up-to-date"}}]`. When `legacy_api_version` is true,
    /// rows whose value contains `"status":"DEQUEUED"` are rewritten to `EXECUTING` (the only
    /// per-feed copy).
    pub fn changes_then_up_to_date(rows: &[(Operation, &SerializedRow)], legacy_api_version: bool) -> FragmentBody {
        let _ = (rows, legacy_api_version);
        unimplemented!("protocol helper")
    }

    /// `[{"headers":{"control":"up-to-date"}}]`.
    pub fn up_to_date() -> FragmentBody {
        unimplemented!("protocol helper")
    }

    /// `[{"headers":{"control":"must-refetch"}}]` (the 409 body, protocol §5.2).
    pub fn must_refetch() -> FragmentBody {
        unimplemented!("protocol helper")
    }

    /// Total length in bytes.
    pub fn len(&self) -> usize {
        self.chunks.iter().map(Bytes::len).sum()
    }

    /// Whether the body has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The body as one contiguous buffer (tests, small bodies).
    pub fn to_bytes(&self) -> Bytes {
        let mut out = Vec::with_capacity(self.len());
        for c in &self.chunks {
            out.extend_from_slice(c);
        }
        Bytes::from(out)
    }
}
