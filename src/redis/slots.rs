//! Sharded pub/sub on a Redis Cluster: which node owns each environment's channel, and the
//! periodic check that finds subscriptions a slot migration silently dropped.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use fred::prelude::*;
use fred::types::{ClusterHash, CustomCommand};
use fred::util::redis_keyslot;

use super::subscribe::{lock, Shared, SHARDNUMSUB_BATCH, SHARD_CHECK_TIMEOUT};
use crate::changes::record::channel_name;

/// Slot → primary node, parsed from `CLUSTER SLOTS` (hosts named the way fred names them).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct SlotMap {
    /// `(first slot, last slot, primary)`, sorted by first slot.
    ranges: Vec<(u16, u16, Server)>,
}

impl SlotMap {
    /// Parses a `CLUSTER SLOTS` reply; `default_host` stands in for a node without an endpoint.
    /// `None` if the reply is malformed.
    pub(super) fn parse(value: Value, default_host: &str) -> Option<SlotMap> {
        let mut ranges = Vec::new();
        for entry in value.into_array() {
            let mut fields = entry.into_array().into_iter();
            let start = u16::try_from(fields.next()?.as_u64()?).ok()?;
            let end = u16::try_from(fields.next()?.as_u64()?).ok()?;
            let node = fields.next()?.into_array();
            let port = u16::try_from(node.get(1)?.as_u64()?).ok()?;
            // Like fred: the metadata `hostname` wins over an IP, a null endpoint becomes the
            // default host, and a hostname endpoint is kept.
            let metadata_host = node.get(3).and_then(|meta| {
                let meta = meta.clone().into_array();
                meta.chunks(2)
                    .find(|kv| kv.first().and_then(Value::as_str).as_deref() == Some("hostname"))
                    .and_then(|kv| kv.get(1).and_then(Value::as_string))
                    .filter(|h| !h.is_empty())
            });
            let endpoint = node
                .first()
                .and_then(Value::as_string)
                .filter(|h| !h.is_empty() && h != "?");
            let host = match endpoint {
                None => metadata_host.unwrap_or_else(|| default_host.to_owned()),
                Some(ip) if ip.parse::<std::net::IpAddr>().is_ok() => metadata_host.unwrap_or(ip),
                Some(hostname) => hostname,
            };
            ranges.push((start, end, Server::new(host, port)));
        }
        ranges.sort_by_key(|(start, _, _)| *start);
        Some(SlotMap { ranges })
    }

    /// The primary owning `slot`, if any.
    pub(super) fn owner(&self, slot: u16) -> Option<&Server> {
        let idx = self.ranges.partition_point(|(start, _, _)| *start <= slot);
        let (_, end, server) = self.ranges.get(idx.checked_sub(1)?)?;
        (slot <= *end).then_some(server)
    }

    /// The primary owning `env_id`'s channel.
    pub(super) fn owner_of_env(&self, env_id: &str) -> Option<&Server> {
        self.owner(redis_keyslot(channel_name(env_id).as_bytes()))
    }

    /// Whether `server` is one of the primaries.
    pub(super) fn has_primary(&self, server: &Server) -> bool {
        self.ranges.iter().any(|(_, _, s)| s == server)
    }
}

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
        *lock(&shared.routing) = Some(routing.clone());
        let snapshot: Vec<(String, u64, Option<Server>)> = lock(&shared.confirmed)
            .iter()
            .map(|(env, c)| (env.clone(), c.epoch, c.server.clone()))
            .collect();
        if snapshot.is_empty() {
            continue;
        }
        let mut lost: Vec<(String, u64)> = Vec::new();
        let mut by_owner: BTreeMap<Server, Vec<(String, u64, bool)>> = BTreeMap::new();
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
        let mut located: Vec<(String, u64, Server)> = Vec::new();
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
            let mut confirmed = lock(&shared.confirmed);
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
                let mut resync = lock(&shared.resync);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn node(host: Option<&str>, port: i64, hostname: Option<&str>) -> Value {
        let mut fields = vec![
            host.map_or(Value::Null, |h| Value::String(h.into())),
            Value::Integer(port),
            Value::String("node-id".into()),
        ];
        if let Some(hostname) = hostname {
            fields.push(Value::Array(vec![
                Value::String("hostname".into()),
                Value::String(hostname.into()),
            ]));
        }
        Value::Array(fields)
    }

    fn range(start: i64, end: i64, primary: Value) -> Value {
        Value::Array(vec![
            Value::Integer(start),
            Value::Integer(end),
            primary,
            node(Some("10.0.0.9"), 1, None),
        ])
    }

    #[test]
    fn slot_map_parses_cluster_slots() {
        let reply = Value::Array(vec![
            range(10923, 16383, node(Some("127.0.0.1"), 7102, None)),
            range(0, 5460, node(Some("127.0.0.1"), 7100, None)),
            range(5461, 10922, node(None, 7101, None)),
        ]);
        let map = SlotMap::parse(reply, "seed.example").expect("parses");
        assert_eq!(map.owner(0), Some(&Server::new("127.0.0.1", 7100)));
        assert_eq!(map.owner(5460), Some(&Server::new("127.0.0.1", 7100)));
        assert_eq!(map.owner(5461), Some(&Server::new("seed.example", 7101)));
        assert_eq!(map.owner(16383), Some(&Server::new("127.0.0.1", 7102)));
        assert!(map.has_primary(&Server::new("127.0.0.1", 7102)));
        assert!(!map.has_primary(&Server::new("10.0.0.9", 1)));
        let slot = redis_keyslot(channel_name("env_a").as_bytes());
        assert_eq!(map.owner_of_env("env_a"), map.owner(slot));

        // A gap (slot 100 unassigned) and fred's host naming: metadata hostname wins over an IP,
        // a hostname endpoint is kept.
        let reply = Value::Array(vec![
            range(
                0,
                99,
                node(Some("10.0.0.1"), 6379, Some("redis-a.internal")),
            ),
            range(101, 16383, node(Some("redis-b.internal"), 6379, None)),
        ]);
        let map = SlotMap::parse(reply, "seed").expect("parses");
        assert_eq!(map.owner(50), Some(&Server::new("redis-a.internal", 6379)));
        assert_eq!(map.owner(100), None);
        assert_eq!(map.owner(101), Some(&Server::new("redis-b.internal", 6379)));
        assert_eq!(
            SlotMap::parse(Value::Array(vec![Value::Integer(1)]), "seed"),
            None
        );
        assert_eq!(
            SlotMap::parse(Value::Array(vec![]), "seed").map(|m| m.ranges.len()),
            Some(0)
        );
    }
}
