//! Per-environment leading-edge coalescing (NTF-16..19). STUB.

use std::time::Duration;

use tokio::sync::mpsc;

use super::ChangeRecord;

/// Coalesces records per environment: the first record on an idle env is delivered at once and
/// opens a window; records inside the window accumulate (merged per run, first position kept,
/// see [`ChangeRecord::merge_from`]) and are delivered when it closes, which opens a new window.
/// `window == 0` delivers every record as its own batch. Delivered as `(env_id, batch)` on `out`.
pub struct Coalescer {
    _priv: (),
}

impl Coalescer {
    /// A coalescer delivering to `out`. Must be created inside a tokio runtime.
    pub fn new(window: Duration, out: mpsc::UnboundedSender<(String, Vec<ChangeRecord>)>) -> Self {
        let _ = (window, out);
        unimplemented!("changes helper")
    }

    /// Adds one record of `env_id`.
    pub fn push(&self, env_id: &str, record: ChangeRecord) {
        let _ = (env_id, record);
        unimplemented!("changes helper")
    }
}
