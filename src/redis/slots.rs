//! Sharded pub/sub on a Redis Cluster: which node owns each environment's channel (one slot per
//! environment, thanks to the `{envId}` hash tag of the channel name). Pure data; the check that
//! uses it is [`super::shard_check`].

use fred::prelude::*;
use fred::util::redis_keyslot;

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
