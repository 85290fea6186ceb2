//! Offsets: `<updatedAtMs>_<seq>` (trigger's native format, TOK-01). STUB.

/// A parsed `offset` request parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OffsetParam {
    /// `-1` (or absent): send the snapshot.
    Initial,
    /// `<ms>_<seq>` as issued by this server.
    At(Offset),
}

/// An issued offset. `ms` is the newest `updatedAt` (epoch ms) the response covered; `seq`
/// identifies the response (unique per issuing instance).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Offset {
    pub ms: i64,
    pub seq: u64,
}

/// `offset` was not `-1` nor `<int>_<int>` with non-negative parts.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid offset {0:?}: expected -1 or <ms>_<seq>")]
pub struct InvalidOffset(pub String);

impl OffsetParam {
    /// Parses the request parameter; `None` (absent) means [`OffsetParam::Initial`].
    pub fn parse(raw: Option<&str>) -> Result<OffsetParam, InvalidOffset> {
        let _ = raw;
        unimplemented!("protocol helper")
    }
}

impl std::fmt::Display for Offset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}_{}", self.ms, self.seq)
    }
}
