//! Ids as types. Each id is parsed (or read from the database, or decoded from a change record)
//! once at the edge and travels as its own type below it, so an environment id can never be
//! passed where a run id is expected, and a friendly id (`run_…`, from a URL) never where an
//! internal one (`"TaskRun".id`) is.
//!
//! The text is shared (`Arc<str>`): cloning an id into an index, a cache key or a response costs
//! a reference count, not an allocation.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Arc<str>);

        impl $name {
            /// The id with this text (no validation: where the text comes from decides).
            pub fn new(text: &str) -> Self {
                $name(Arc::from(text))
            }

            /// The id's text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl Default for $name {
            fn default() -> Self {
                $name::new("")
            }
        }

        impl Deref for $name {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&*self.0, f)
            }
        }

        impl From<&str> for $name {
            fn from(text: &str) -> Self {
                $name::new(text)
            }
        }

        impl From<String> for $name {
            fn from(text: String) -> Self {
                $name(Arc::from(text))
            }
        }

        impl From<&String> for $name {
            fn from(text: &String) -> Self {
                $name::new(text)
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                &*self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                &*self.0 == *other
            }
        }

        impl PartialEq<String> for $name {
            fn eq(&self, other: &String) -> bool {
                &*self.0 == other.as_str()
            }
        }
    };
}

id_type! {
    /// An internal environment id (`"RuntimeEnvironment".id`): the tenant every read is scoped
    /// to.
    EnvId
}

id_type! {
    /// An organization id (`"Organization".id`, the environment's `organizationId`): what
    /// per-organization concurrency limits are keyed by.
    OrgId
}

id_type! {
    /// An internal run id (`"TaskRun".id`, a cuid), as change records and the router carry it.
    RunId
}

id_type! {
    /// A run's friendly id (`run_…`, `"TaskRun"."friendlyId"`), as URLs carry it.
    FriendlyRunId
}

id_type! {
    /// An internal batch id (`"BatchTaskRun".id`, what `"TaskRun"."batchId"` holds).
    BatchId
}

id_type! {
    /// A batch's friendly id (`batch_…`), as URLs carry it.
    FriendlyBatchId
}

id_type! {
    /// A feed handle (`handle` / legacy `shape_id`): opaque to clients, signed by the server
    /// (see [`crate::protocol::handle`]).
    Handle
}

/// Longest run or batch id a URL may name, bytes; longer ids are not looked up.
pub const MAX_URL_ID_BYTES: usize = 256;

impl FriendlyRunId {
    /// The id a `/realtime/v1/runs/:runId` URL names, if it could name a run at all (non-empty,
    /// at most [`MAX_URL_ID_BYTES`], no NUL, which Postgres refuses in text); `None` answers 404
    /// without a query.
    pub fn parse(text: &str) -> Option<FriendlyRunId> {
        plausible_url_id(text).then(|| FriendlyRunId::new(text))
    }
}

impl FriendlyBatchId {
    /// The id a `/realtime/v1/batches/:batchId` URL names (same rules as
    /// [`FriendlyRunId::parse`]).
    pub fn parse(text: &str) -> Option<FriendlyBatchId> {
        plausible_url_id(text).then(|| FriendlyBatchId::new(text))
    }
}

fn plausible_url_id(text: &str) -> bool {
    !text.is_empty() && text.len() <= MAX_URL_ID_BYTES && !text.contains('\0')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_ids_are_refused_when_empty_too_long_or_holding_nul() {
        assert!(FriendlyRunId::parse("run_abc").is_some());
        assert!(FriendlyRunId::parse("").is_none());
        assert!(FriendlyRunId::parse("run_\0x").is_none());
        assert!(FriendlyBatchId::parse(&"b".repeat(MAX_URL_ID_BYTES + 1)).is_none());
        assert!(FriendlyBatchId::parse(&"b".repeat(MAX_URL_ID_BYTES)).is_some());
    }

    #[test]
    fn ids_compare_with_text_and_borrow_as_str() {
        let id = RunId::from("abc");
        assert_eq!(id, "abc");
        let mut map = std::collections::HashMap::new();
        map.insert(id.clone(), 1);
        assert_eq!(map.get("abc"), Some(&1));
        assert_eq!(format!("{id} {id:?}"), "abc \"abc\"");
    }
}
