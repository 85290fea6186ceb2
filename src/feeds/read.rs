//! What a store read is for and what it returns: a feed's [`Target`], one read of it
//! ([`SetRead`]), the [`RunSet`] read for it and the [`ReadError`] that ends it. Shared by the
//! readers ([`super::sets`]) and the backstops ([`super::backstop`]).

use std::sync::Arc;

use tokio::time::Instant;

use crate::protocol::{BatchId, ColumnSet, EnvId, RunId, SerializedRow};
use crate::router::ReplayCursor;
use crate::store::StoreError;

/// What a feed is about (internal ids).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    Run { run_id: RunId },
    Tag { tags: Arc<[String]>, floor_ms: i64 },
    Batch { batch_id: BatchId },
}

impl Target {
    /// A tag feed's tag filter, as the request sent it (`None` for run and batch feeds).
    pub fn tags(&self) -> Option<Arc<[String]>> {
        match self {
            Target::Tag { tags, .. } => Some(tags.clone()),
            _ => None,
        }
    }
}

/// One read of what a feed carries: whose, of what, with which columns and by when.
#[derive(Clone, Copy, Debug)]
pub struct SetRead<'a> {
    /// The environment the feed belongs to.
    pub env_id: &'a EnvId,
    /// What the feed is about.
    pub target: &'a Target,
    /// The columns its rows are serialized with.
    pub cols: ColumnSet,
    /// When the read gives up with [`ReadError::Deadline`].
    pub deadline: Instant,
}

/// A store read result: the rows (serialized for one column set) and the router cursor taken
/// before the read.
#[derive(Debug)]
pub struct RunSet {
    pub cursor: ReplayCursor,
    pub rows: Vec<SerializedRow>,
    /// The read-your-writes gate let the read through: the replica had applied what the
    /// records before `cursor` announced. When false, a response built from this read must
    /// hand out a cursor later polls re-check.
    pub settled: bool,
    /// Wall time the read started, epoch ms.
    pub read_ms: i64,
}

/// A read failed or ran past the poll's deadline.
#[derive(Debug, thiserror::Error, Clone)]
pub enum ReadError {
    #[error("{0}")]
    Store(Arc<StoreError>),
    #[error("deadline exceeded")]
    Deadline,
}

impl From<StoreError> for ReadError {
    fn from(e: StoreError) -> ReadError {
        ReadError::Store(Arc::new(e))
    }
}
