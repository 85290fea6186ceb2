//! Change records and where they come from.
//!
//! trigger.dev publishes one small JSON [`ChangeRecord`] per run change to the Redis channel
//! `realtime:env:{<envId>}` (trigger-facts §5). This module decodes them tolerantly
//! ([`record`]), subscribes per environment ([`source`]: Redis classic pub/sub, sharded pub/sub
//! on a Redis Cluster, or an in-memory source for tests), coalesces bursts per environment on
//! the leading edge ([`coalesce`]), and publishes records the way trigger.dev's webapp does
//! ([`publish`]). [`RedisOptions`] says how to reach Redis (the `[redis]` section).

pub mod coalesce;
mod conn;
pub mod publish;
pub mod record;
pub mod source;

pub use coalesce::Coalescer;
pub use conn::RedisOptions;
pub use publish::{publish_once, publish_once_with, PublishError, Publisher};
pub use record::{channel_name, env_of_channel, ChangeRecord};
pub use source::{ChangeSource, MemoryChangeSource, RedisChangeSource, SourceError, SourceEvent};
