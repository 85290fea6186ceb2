//! Handles: an issued offset needs one ([`issued_offset`], the one check of that rule), the
//! claims a handle carries for a feed, checking one the client presents (409 must-refetch
//! otherwise), and the target a tag feed resumes with (its pinned `createdAt` floor).

use rand::Rng;

use crate::clock::now_ms;
use crate::protocol::handle::{filter_digest, filter_digest_is, FeedKind, HandleClaims};
use crate::protocol::offset::{Offset, OffsetParam};
use crate::protocol::Handle;

use super::read::Target;
use super::state::ConnState;
use super::{bucket, FeedError, FeedRequest, Feeds};

/// The issued offset a request resumes from, with the handle it presents (any form of it:
/// the HTTP layer checks its query's before any lookup, [`Feeds::serve`] and [`Feeds::check`]
/// the request's); `None` for a snapshot (`offset=-1`, `offset=now`). An issued offset without
/// a handle is refused ([`FeedError::HandleRequired`], a 400): this is the one place that rule
/// is checked.
pub fn issued_offset<H>(
    offset: OffsetParam,
    handle: Option<H>,
) -> Result<Option<(Offset, H)>, FeedError> {
    match offset {
        OffsetParam::Initial | OffsetParam::Now => Ok(None),
        OffsetParam::At(offset) => match handle {
            Some(handle) => Ok(Some((offset, handle))),
            None => Err(FeedError::HandleRequired(offset.to_string())),
        },
    }
}

impl Feeds {
    /// The claims of a handle minted for `req`'s feed (a tag feed's with its `createdAt` floor).
    pub(super) fn claims_for(&self, req: &FeedRequest, floor_ms: Option<i64>) -> HandleClaims {
        let (kind, target) = match &req.target {
            Target::Run { run_id } => (FeedKind::Run, run_id.to_string()),
            Target::Tag { tags, .. } => (FeedKind::Tag, filter_digest(tags)),
            Target::Batch { batch_id } => (FeedKind::Batch, batch_id.to_string()),
        };
        HandleClaims {
            kind,
            env_id: req.env_id.clone(),
            target,
            floor_ms,
            columns: req.cols.bits(),
            nonce: rand::rng().random(),
        }
    }

    /// Whether `claims` (of a handle this instance accepted) are for the feed `req` asks for:
    /// the checks [`Feeds::verify`] makes beyond the handle's HMAC.
    pub(super) fn same_feed(&self, req: &FeedRequest, claims: &HandleClaims) -> bool {
        let (kind, matches) = match &req.target {
            Target::Run { run_id } => (FeedKind::Run, claims.target == run_id.as_str()),
            Target::Tag { tags, .. } => (FeedKind::Tag, filter_digest_is(tags, &claims.target)),
            Target::Batch { batch_id } => (FeedKind::Batch, claims.target == batch_id.as_str()),
        };
        claims.kind == kind
            && matches
            && claims.env_id == req.env_id
            && claims.columns == req.cols.bits()
    }

    /// Whether `state` (recorded by this instance under a handle it accepted) is for the feed
    /// `req` asks for: [`Feeds::same_feed`] with its claims, except that a tag filter sent
    /// exactly as the state's own was is not hashed again.
    pub(super) fn same_feed_as(&self, req: &FeedRequest, state: &ConnState) -> bool {
        match (&req.target, &state.tags) {
            (Target::Tag { tags, .. }, Some(checked)) if **tags == **checked => {
                let claims = &state.claims;
                claims.kind == FeedKind::Tag
                    && claims.env_id == req.env_id
                    && claims.columns == req.cols.bits()
            }
            _ => self.same_feed(req, &state.claims),
        }
    }

    /// The claims of `handle` if this server issued it for `req`'s feed and environment; else
    /// a 409 must-refetch carrying a fresh handle for the feed.
    pub(super) fn verify(
        &self,
        req: &FeedRequest,
        handle: &Handle,
    ) -> Result<HandleClaims, FeedError> {
        match self.handles.verify(handle) {
            Ok(claims) if self.same_feed(req, &claims) => Ok(claims),
            _ => {
                let floor = match &req.target {
                    Target::Tag { floor_ms, .. } => Some(*floor_ms),
                    _ => None,
                };
                Err(FeedError::MustRefetch {
                    handle: self.handles.mint(&self.claims_for(req, floor)),
                })
            }
        }
    }

    /// Tag feeds resume with the floor pinned in the handle, re-clamped to the max age (TAG-04).
    pub(super) fn resume_target(&self, target: &Target, claims: &HandleClaims) -> Target {
        match (target, claims.floor_ms) {
            (Target::Tag { tags, .. }, Some(pinned)) => {
                // The pinned floor wins over the request's `createdAt` (the client resends the
                // same URL), unless it is older than the max age (a stale or crafted handle).
                let min_floor = self.min_floor_ms();
                Target::Tag {
                    tags: tags.clone(),
                    floor_ms: bucket(pinned.max(min_floor), self.cfg.runset_created_at_bucket_ms),
                }
            }
            _ => target.clone(),
        }
    }

    /// The oldest `createdAt` floor a tag feed may have now (`maximum_created_at_filter_age_ms`).
    pub(super) fn min_floor_ms(&self) -> i64 {
        now_ms() - i64::try_from(self.cfg.maximum_created_at_filter_age_ms).unwrap_or(i64::MAX / 2)
    }
}
