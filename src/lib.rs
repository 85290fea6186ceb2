//! runfeed: a standalone server for trigger.dev's realtime run feeds.
//!
//! Data flow (see docs/architecture.md):
//! Redis change records → [`changes`] (decode, coalesce) → [`router`] (index of held feeds,
//! replay buffer, hydrate once / serialize once) → [`feeds`] (snapshot, live hold, diff against
//! what the client echoed) → [`http`] (axum routes, auth, Electric headers, CORS).
//! [`store`] is the Postgres side, [`auth`] turns a bearer into an environment and ability,
//! [`protocol`] is the pure Electric wire format.
//!
//! No `unsafe` code, except the page release of idle connections' read buffers in `http::serve`
//! (the page size and `madvise`), allowed there alone.

#![deny(unsafe_code)]

pub mod app;
pub mod auth;
pub mod cache;
pub mod changes;
pub mod cli;
pub mod clock;
pub mod config;
pub mod feeds;
pub mod http;
pub mod protocol;
pub mod redis;
pub mod router;
pub mod store;
pub mod telemetry;
