//! Which of the three feed routes a request is for ([`FeedRoute`]), as the dispatcher and the
//! run-token forwarder both need it.

use super::{route_of, BATCH_ROUTE, RUNS_ROUTE, RUN_ROUTE};

/// Which feed route a `GET` is for, with its one path segment (percent-decoded as axum's
/// `Path` does; `None` when it is not UTF-8 once decoded, which the handler answers 404).
pub(super) enum FeedRoute {
    Run(Option<String>),
    Tags,
    Batch(Option<String>),
}

impl FeedRoute {
    /// The feed route of `path`, if it is one.
    pub(super) fn of(path: &str) -> Option<FeedRoute> {
        let segment = |prefix: &str| {
            let raw = path.strip_prefix(prefix).unwrap_or_default();
            percent_encoding::percent_decode_str(raw)
                .decode_utf8()
                .ok()
                .map(|id| id.into_owned())
        };
        match route_of(path) {
            RUNS_ROUTE => Some(FeedRoute::Tags),
            RUN_ROUTE => Some(FeedRoute::Run(segment("/realtime/v1/runs/"))),
            BATCH_ROUTE => Some(FeedRoute::Batch(segment("/realtime/v1/batches/"))),
            _ => None,
        }
    }
}
