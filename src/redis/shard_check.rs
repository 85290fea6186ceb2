//! The shard check (sharded pub/sub on a Cluster): finds subscriptions a slot migration silently
//! dropped and hands them to the reconciler.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use fred::prelude::*;
use fred::types::{ClusterHash, CustomCommand};

use super::slots::SlotMap;
use super::state::{Shared, SHARDNUMSUB_BATCH, SHARD_CHECK_TIMEOUT};
use crate::changes::record::channel_name;
use crate::protocol::EnvId;

/// Sharded mode: every `interval` (or when poked after a reconnect) refreshes the slot map with
/// `CLUSTER SLOTS` and reports confirmed subscriptions that are gone: the channel's slot is now
/// owned by another node than the one it was subscribed on (a migration: the old owner dropped
/// it), or `PUBSUB SHARDNUMSUB` on the owner counts no subscriber at all.
pub(super) async fn check_shards(
    control: Client,
    shared: Arc<Shared>,
    seed_host: String,
    interval: Duration,
) {
    let mut first = true;
    loop {
        if !std::mem::take(&mut first) {
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = shared.check_now.notified() => {}
            }
        }
        let routing = match fetch_slot_map(&control, &seed_host).await {
            Ok(routing) => routing,
            Err(e) => {
                tracing::debug!(error = %e, "shard check: CLUSTER SLOTS failed; retrying at the next tick");
                continue;
            }
        };
        *shared.routing.lock() = Some(routing.clone());
        let snapshot: Vec<(EnvId, u64, Option<Server>)> = shared
            .confirmed
            .lock()
            .iter()
            .map(|(env, c)| (env.clone(), c.epoch, c.server.clone()))
            .collect();
        if snapshot.is_empty() {
            continue;
        }
        let mut lost: Vec<(EnvId, u64)> = Vec::new();
        let mut by_owner: BTreeMap<Server, Vec<(EnvId, u64, bool)>> = BTreeMap::new();
        for (env, epoch, placed) in snapshot {
            let Some(owner) = routing.owner_of_env(&env) else {
                continue; // an uncovered slot: nothing to subscribe to until it is assigned
            };
            match placed {
                Some(placed) if placed != *owner => lost.push((env, epoch)),
                placed => {
                    by_owner
                        .entry(owner.clone())
                        .or_default()
                        .push((env, epoch, placed.is_none()))
                }
            }
        }
        let mut located: Vec<(EnvId, u64, Server)> = Vec::new();
        for (server, envs) in by_owner {
            for chunk in envs.chunks(SHARDNUMSUB_BATCH) {
                let channels: Vec<String> =
                    chunk.iter().map(|(env, _, _)| channel_name(env)).collect();
                let counts = match shard_numsub(&control, &server, channels).await {
                    Ok(counts) => counts,
                    Err(e) => {
                        tracing::debug!(error = %e, %server, "shard check: PUBSUB SHARDNUMSUB failed");
                        continue;
                    }
                };
                for (env, epoch, unknown) in chunk {
                    match counts.get(&channel_name(env)) {
                        Some(0) => lost.push((env.clone(), *epoch)),
                        Some(_) if *unknown => located.push((env.clone(), *epoch, server.clone())),
                        _ => {}
                    }
                }
            }
        }
        if !located.is_empty() {
            let mut confirmed = shared.confirmed.lock();
            for (env, epoch, server) in located {
                if let Some(c) = confirmed.get_mut(&env).filter(|c| c.epoch == epoch) {
                    c.server = Some(server);
                }
            }
        }
        if !lost.is_empty() {
            shared
                .stats
                .lost_subscriptions
                .fetch_add(lost.len() as u64, Ordering::Relaxed);
            tracing::warn!(
                envs = lost.len(),
                "sharded subscriptions gone (slot moved or dropped by the server); re-subscribing"
            );
            {
                let mut resync = shared.resync.lock();
                resync.lost.extend(lost);
                resync.announce = true;
            }
            shared.wake.notify_one();
        }
    }
}

/// `CLUSTER SLOTS` on any node, parsed.
async fn fetch_slot_map(control: &Client, seed_host: &str) -> Result<SlotMap, String> {
    let reply: Value = tokio::time::timeout(
        SHARD_CHECK_TIMEOUT,
        control.custom(
            CustomCommand::new_static("CLUSTER", ClusterHash::Random, false),
            vec!["SLOTS"],
        ),
    )
    .await
    .map_err(|_| "timed out".to_owned())?
    .map_err(|e| e.to_string())?;
    SlotMap::parse(reply, seed_host).ok_or_else(|| "malformed CLUSTER SLOTS reply".to_owned())
}

/// `PUBSUB SHARDNUMSUB <channels…>` on `server`: subscriber count per channel.
async fn shard_numsub(
    control: &Client,
    server: &Server,
    channels: Vec<String>,
) -> Result<BTreeMap<String, i64>, String> {
    let mut args = Vec::with_capacity(channels.len() + 1);
    args.push("SHARDNUMSUB".to_owned());
    args.extend(channels);
    let reply: Value = tokio::time::timeout(
        SHARD_CHECK_TIMEOUT,
        control.with_cluster_node(server.clone()).custom(
            CustomCommand::new_static("PUBSUB", ClusterHash::Random, false),
            args,
        ),
    )
    .await
    .map_err(|_| "timed out".to_owned())?
    .map_err(|e| e.to_string())?;
    let mut counts = BTreeMap::new();
    for pair in reply.into_array().chunks(2) {
        if let [channel, count] = pair {
            if let (Some(channel), Some(count)) = (channel.as_string(), count.as_i64()) {
                counts.insert(channel, count);
            }
        }
    }
    Ok(counts)
}
