//! Change records and the change-source seam.
//!
//! trigger.dev publishes one small JSON [`ChangeRecord`] per run change to the Redis channel
//! `realtime:env:{<envId>}` (docs/trigger-dev.md §5). This module decodes them tolerantly
//! ([`record`]) and defines what a change source reports and how the router drives it
//! ([`source`]: [`ChangeSource`], [`SourceEvent`], and [`MemoryChangeSource`] for tests). The
//! Redis implementation is `redis::RedisChangeSource`; coalescing bursts is the
//! router's job.

pub mod record;
pub mod source;

pub use record::{channel_name, env_of_channel, ChangeRecord};
pub use source::{
    event_channel, ChangeSource, EventReceiver, EventSender, MemoryChangeSource, SourceEvent,
    EVENT_QUEUE,
};
