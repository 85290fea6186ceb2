//! The Electric shape wire format as the real npm clients consume it (`@electric-sql/client`
//! 1.0.14 / 1.0.0-beta.1 / 0.6.3, `@trigger.dev/sdk` 4.x). Pure: no I/O.
//!
//! - [`columns`]: the 26 `TaskRun` columns trigger.dev projects, their Electric types, column sets.
//! - [`row`]: [`RunRow`] (one hydrated run) and [`SerializedRow`] (its wire value, serialized once).
//! - [`encode`]: value encoding (timestamps without zone, `t`/`f`, JS number strings, array literals).
//! - [`body`]: response bodies as shared `Bytes` fragments (zero-copy fan-out).
//! - [`offset`], [`handle`], [`cursor`]: resume tokens; handles are MAC-signed.
//! - [`headers`]: modern vs legacy Electric header names.
//! - [`params`]: `createdAt` duration grammar and tag validation (trigger.dev rules).
//! - [`electric`]: what the current client (`@electric-sql/client` 1.5) sends and its limits.
//! - [`sse`]: server-sent events framing for the SSE live mode.

pub mod body;
pub mod columns;
pub mod cursor;
pub mod electric;
pub mod encode;
pub mod handle;
pub mod headers;
pub mod ids;
pub mod offset;
pub mod params;
pub mod row;
pub mod sse;

pub use columns::{Column, ColumnSet};
pub use ids::{BatchId, EnvId, FriendlyBatchId, FriendlyRunId, Handle, OrgId, RunId};
pub use row::{held_bytes, is_final_status, RunMeta, RunRow, SerializedRow};
