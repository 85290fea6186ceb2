//! The live long-poll: hold until the router delivers what the client lacks, or the hold expires
//! and the backstop re-reads.

use std::time::Duration;

use tokio::time::Instant;

use crate::router::Registration;
use crate::telemetry::metrics::{DeliveryPath, LivePath, WakeReason};

use super::diff::{Known, Pending};
use super::read::ReadError;
use super::reply::ReplyShape;
use super::{FeedError, FeedReply, Feeds, Poll};

impl Feeds {
    /// `live=true`: hold until the router delivers a change the client does not have, or the
    /// hold expires (then the backstop re-reads).
    pub(super) async fn live(&self, poll: Poll<'_>) -> Result<FeedReply, FeedError> {
        let req = poll.req;
        let drained = self.shutdown.cancelled();
        tokio::pin!(drained);
        let deadline = if self.shutdown.is_cancelled() {
            Instant::now()
        } else {
            self.hold_deadline()
        };
        // Every await but the hold is boxed: this future lives for the whole hold, and an
        // inline read would size it (memory per held feed).
        let resume = Box::pin(self.lookup(poll)).await;
        let known = self.known(poll, &resume);
        let reg = Box::pin(self.router.register(poll.feed(resume.cursor))).await;
        let mut pending = Pending::default();
        let first = reg.take();
        pending.extend(first.rows);
        let mut shape = ReplyShape {
            schema: false,
            vouched: false,
            trusted: true,
        };
        let mut path = DeliveryPath::Replay;
        // Without this instance's working set but with a covered cursor (a hop), the replay is
        // exactly what changed since the client's last response: no store read needed.
        if !reg.covered() || first.recheck {
            // Cold path: the change stream cannot vouch for the gap; read the store now that
            // the feed is registered (anything after this read reaches the inbox).
            self.metrics.live_poll(LivePath::ColdResolve);
            path = DeliveryPath::Cold;
            shape.trusted &=
                Box::pin(self.recheck(poll, &known, deadline, &reg, &mut pending)).await;
        }
        loop {
            if !pending.changes(&known).is_empty() {
                return Ok(self.emitted(path, self.respond(poll, &known, pending, &reg, shape)));
            }
            tokio::select! {
                wake = reg.wait() => {
                    self.metrics.wakeup(WakeReason::Notify);
                    if !wake.rows.is_empty() {
                        self.metrics.live_poll(LivePath::FastHydrate);
                        path = DeliveryPath::Notify;
                    }
                    pending.extend(wake.rows);
                    if wake.recheck {
                        self.metrics.live_poll(LivePath::FullResolve);
                        path = DeliveryPath::Recheck;
                        shape.trusted &= Box::pin(self.recheck(poll, &known, deadline, &reg, &mut pending)).await;
                    }
                    if !self.cfg.hold_on_empty && pending.changes(&known).is_empty() {
                        return Ok(self.emitted(path, self.respond(poll, &known, pending, &reg, shape)));
                    }
                }
                _ = tokio::time::sleep_until(deadline) => {
                    self.metrics.wakeup(WakeReason::Timeout);
                    break;
                }
                _ = &mut drained => {
                    // Shutting down: answer what we have now, no backstop read.
                    self.metrics.wakeup(WakeReason::Abort);
                    return Ok(self.emitted(DeliveryPath::Drain, self.respond(poll, &known, pending, &reg, shape)));
                }
            }
        }
        // Backstop: a change the stream never announced (lost publish) surfaces here.
        let backstop_deadline =
            Instant::now() + Duration::from_millis(self.cfg.live_poll_timeout_ms / 4 + 1);
        // Polls that know their client's versions share backstop reads of the same filter
        // (`caches.backstop_share_ms`): an older shared read cannot regress a known row. The
        // others (another instance answered the client's last response) read fresh: an older
        // cached row would be sent as an update the client might already be past.
        let read = req.read(poll.target, backstop_deadline);
        let backstop = if known.versions_known() {
            Box::pin(self.sets.read_backstop(read, &known)).await
        } else {
            Box::pin(self.sets.read_fresh(read)).await
        };
        match backstop {
            Ok(set) => {
                shape.trusted &= set.settled;
                pending.extend(set.rows.iter().cloned());
            }
            Err(err) => {
                tracing::warn!(env_id = %req.env_id, error = %err, "backstop read failed; answering up-to-date");
                shape.trusted = false;
            }
        }
        let reply = self.respond(poll, &known, pending, &reg, shape);
        self.metrics.backstop(reply.rows > 0);
        Ok(self.emitted(DeliveryPath::Backstop, reply))
    }

    /// Reads what the feed carries as of now; false if that failed (logged). A poll that knows
    /// its client's versions may use the shared read plus a replay
    /// ([`Sets::read_covered`](super::Sets::read_covered)): the diff drops whatever the client
    /// is already past. One that does not reads fresh.
    pub(super) async fn recheck(
        &self,
        poll: Poll<'_>,
        known: &Known,
        deadline: Instant,
        reg: &Registration,
        pending: &mut Pending,
    ) -> bool {
        let req = poll.req;
        let wanted = req.read(poll.target, deadline);
        // Bounded by the poll's deadline (a replay may wait on the read-your-writes gate).
        let read = async {
            let mut covered = known.versions_known();
            // A read the replica was still behind for is read again, within the gate's bound,
            // so the version it missed follows as soon as the replica has it.
            let settle_by = Instant::now() + self.router.replica_max_delay().unwrap_or_default();
            loop {
                let set = if covered {
                    self.sets.read_covered(wanted, reg).await?
                } else {
                    self.sets.read_fresh(wanted).await?
                };
                let retry = self.router.replica_retry_delay();
                match retry {
                    Some(delay) if !set.settled && Instant::now() + delay < settle_by => {
                        covered = false;
                        tokio::time::sleep(delay).await;
                    }
                    _ => return Ok::<_, ReadError>(set),
                }
            }
        };
        match tokio::time::timeout_at(deadline, read)
            .await
            .unwrap_or(Err(ReadError::Deadline))
        {
            Ok(set) => {
                pending.extend(set.rows.iter().cloned());
                set.settled
            }
            Err(err) => {
                tracing::warn!(env_id = %req.env_id, error = %err, "store re-check failed; holding");
                false
            }
        }
    }
}
