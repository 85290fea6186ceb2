//! A bounded map whose entries expire a fixed time after they were inserted, for the lookups
//! every poll makes. A leaf: imports nothing of runfeed.
//!
//! A `quick_cache` map (S3-FIFO eviction, sharded locks, no background work) with the expiry
//! kept beside each value: a read past it is a miss, and the expired entries nobody reads again
//! are swept out by the first insert after each half TTL, so their memory comes back without a
//! background task. moka's caches do the same with an access log, a timer wheel and
//! housekeeping on every operation, which cost about a tenth of an ended live poll's
//! instructions where a poll read one connection state and recorded one (BENCHMARKS.md "Cost
//! per unit of work"). Lookups that load through the store (single-flighted, errors shared
//! between waiters) stay on moka.
//!
//! Times are tokio's monotonic clock (so tests can pause it).

use std::hash::Hash;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

/// Initial size of a map: it grows to its bound as entries are inserted.
const INITIAL_ENTRIES: u64 = 1024;

/// A bounded map of entries that expire `ttl` after they were inserted (see the module docs).
pub struct TtlCache<K, V> {
    entries: quick_cache::sync::Cache<K, Expiring<V>, ByWeight, foldhash::fast::RandomState>,
    ttl: Duration,
    /// The weight of a value (`None`: every entry weighs 1).
    weigh: Option<fn(&V) -> u64>,
    /// When expired entries were last swept out.
    swept: Mutex<Instant>,
}

/// A value, when it expires and what it weighs against the cache's bound.
#[derive(Clone)]
struct Expiring<V> {
    value: V,
    expires: Instant,
    /// Computed once, at insertion (the map reads it on every eviction).
    weight: u64,
}

/// Weighs an entry by the weight stored beside its value.
#[derive(Clone, Copy)]
struct ByWeight;

impl<K, V> quick_cache::Weighter<K, Expiring<V>> for ByWeight {
    fn weight(&self, _key: &K, entry: &Expiring<V>) -> u64 {
        entry.weight
    }
}

impl<K, V> TtlCache<K, V>
where
    K: Eq + Hash + Clone,
    V: Clone,
{
    /// At most `max_entries` entries (the least useful are evicted first), each kept `ttl` after
    /// it was inserted.
    pub fn new(max_entries: u64, ttl: Duration) -> TtlCache<K, V> {
        TtlCache::build(max_entries, ttl, None)
    }

    /// Entries whose `weigh`ts sum to at most `max_weight` (bytes, say), each kept `ttl` after it
    /// was inserted. An entry weighs at least 1.
    pub fn weighted(max_weight: u64, ttl: Duration, weigh: fn(&V) -> u64) -> TtlCache<K, V> {
        TtlCache::build(max_weight, ttl, Some(weigh))
    }

    fn build(max_weight: u64, ttl: Duration, weigh: Option<fn(&V) -> u64>) -> TtlCache<K, V> {
        let max_weight = max_weight.max(1);
        let initial = usize::try_from(max_weight.min(INITIAL_ENTRIES)).unwrap_or(1);
        TtlCache {
            entries: quick_cache::sync::Cache::with(
                initial,
                max_weight,
                ByWeight,
                foldhash::fast::RandomState::default(),
                Default::default(),
            ),
            ttl,
            weigh,
            swept: Mutex::new(Instant::now()),
        }
    }

    /// The value of `key`, unless it expired.
    pub fn get<Q>(&self, key: &Q) -> Option<V>
    where
        Q: Hash + quick_cache::Equivalent<K> + ?Sized,
    {
        let entry = self.entries.get(key)?;
        (Instant::now() < entry.expires).then_some(entry.value)
    }

    /// Inserts `value` for `key` (replacing what was there), to expire one TTL from now.
    pub fn insert(&self, key: K, value: V) {
        let now = Instant::now();
        let weight = self.weigh.map_or(1, |weigh| weigh(&value).max(1));
        self.entries.insert(
            key,
            Expiring {
                value,
                expires: now + self.ttl,
                weight,
            },
        );
        self.sweep_if_due(now);
    }

    /// Forgets `key`.
    pub fn remove<Q>(&self, key: &Q)
    where
        Q: Hash + quick_cache::Equivalent<K> + ?Sized,
    {
        self.entries.remove(key);
    }

    /// Forgets every entry.
    pub fn clear(&self) {
        self.entries.clear();
    }

    /// Entries kept now, expired ones included until they are swept out or read.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is kept.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Sweeps the expired entries out when the last sweep is half a TTL ago (one caller does,
    /// the others go on).
    fn sweep_if_due(&self, now: Instant) {
        let Some(mut swept) = self.swept.try_lock() else {
            return;
        };
        if now.duration_since(*swept) < self.ttl / 2 {
            return;
        }
        *swept = now;
        drop(swept);
        self.entries.retain(|_, entry| now < entry.expires);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn an_entry_expires_its_ttl_after_it_was_inserted() {
        let cache = TtlCache::new(100, Duration::from_secs(1));
        cache.insert(1, "a");
        tokio::time::advance(Duration::from_millis(999)).await;
        assert_eq!(cache.get(&1), Some("a"));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(cache.get(&1), None);
        // Inserting it again starts its TTL again.
        cache.insert(1, "b");
        tokio::time::advance(Duration::from_millis(500)).await;
        assert_eq!(cache.get(&1), Some("b"));
        cache.remove(&1);
        assert_eq!(cache.get(&1), None);
    }

    #[tokio::test(start_paused = true)]
    async fn expired_entries_are_swept_out_by_an_insert_after_half_the_ttl() {
        let cache = TtlCache::new(100, Duration::from_secs(1));
        for n in 0..10 {
            cache.insert(n, n);
        }
        assert_eq!(cache.len(), 10);
        // Half a TTL later an insert sweeps, but nothing has expired yet.
        tokio::time::advance(Duration::from_millis(500)).await;
        cache.insert(10, 10);
        assert_eq!(cache.len(), 11);
        // The next sweep (half a TTL after the last) drops the ten expired ones.
        tokio::time::advance(Duration::from_millis(500)).await;
        cache.insert(11, 11);
        assert_eq!(cache.len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_weighted_cache_stays_within_its_weight() {
        let cache: TtlCache<u32, Vec<u8>> =
            TtlCache::weighted(10_000, Duration::from_secs(60), |v| v.len() as u64);
        for n in 0..100 {
            cache.insert(n, vec![0; 1_000]);
        }
        assert!(cache.len() <= 10, "{} entries of 1 000 bytes", cache.len());
        assert_eq!(cache.get(&99).map(|v| v.len()), Some(1_000));
        // Weightless values still count one each.
        let cache: TtlCache<u32, Vec<u8>> =
            TtlCache::weighted(64, Duration::from_secs(60), |v| v.len() as u64);
        for n in 0..1_000 {
            cache.insert(n, Vec::new());
        }
        assert!(cache.len() <= 64, "{}", cache.len());
    }

    #[tokio::test(start_paused = true)]
    async fn a_cache_stays_within_its_bound_and_keeps_the_newest_entry() {
        let cache = TtlCache::new(64, Duration::from_secs(60));
        for n in 0..1_000 {
            cache.insert(n, n);
        }
        assert!(cache.len() <= 64, "{}", cache.len());
        assert_eq!(cache.get(&999), Some(999));
    }
}
