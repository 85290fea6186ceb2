//! fred connection plumbing shared by the subscriber source and the publisher.

use std::time::Duration;

use fred::prelude::*;
use fred::types::ConnectHandle;

/// How long a `QUIT` may take when closing a connected client.
const QUIT_WAIT: Duration = Duration::from_secs(1);

/// Closes `client` for good: a bounded `QUIT` when connected, then aborts the connection task
/// (which otherwise keeps reconnecting forever, and whose `QUIT` never answers while it is
/// disconnected).
pub(super) async fn close<C: ClientLike>(client: &C, connection: ConnectHandle) {
    if client.is_connected() {
        let _ = tokio::time::timeout(QUIT_WAIT, client.quit()).await;
    }
    connection.abort();
}

/// Closes `client` from a `Drop`: spawns [`close`] if a tokio runtime is around, else just
/// aborts the connection task.
pub(super) fn close_in_background<C: ClientLike + Send + 'static>(
    client: C,
    connection: ConnectHandle,
) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(async move { close(&client, connection).await });
        }
        Err(_) => connection.abort(),
    }
}
