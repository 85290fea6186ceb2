//! A bounded map whose entries expire a fixed time after they were inserted (or, for an
//! [idle](TtlCache::idle) cache, after they were last used), for the lookups every poll makes,
//! and the one loading cache of the crate ([`TtlCache::get_or_load`]); also the crate's hash map
//! for hot-path keys ([`FastMap`]). A leaf: imports nothing of runfeed.
//!
//! A `quick_cache` map (S3-FIFO eviction, sharded locks, no background work) with the expiry
//! kept beside each value: a read past it is a miss, and the expired entries nobody reads again
//! are swept out by the first insert after each half TTL, so their memory comes back without a
//! background task. (A cache that does the same with an access log, a timer wheel and
//! housekeeping on every operation cost about a tenth of an ended live poll's instructions
//! where a poll read one connection state and recorded one: BENCHMARKS.md "Cost per unit of
//! work".)
//!
//! Loads are single-flighted: concurrent misses of one key run ONE load and all wait for its
//! result. A value loaded is kept for the cache's TTL (or the TTL its caller picks for it). An
//! error is NOT cached (the next miss loads again), but every caller that waited on the failing
//! load gets that same error, shared (`Arc<E>`): a failing store sees one query per key at a
//! time, not one per caller. A load whose caller gives up (its future is dropped) is taken over
//! by one of its waiters, with that waiter's own load.
//!
//! Times are tokio's monotonic clock (so tests can pause it).

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::OnceCell;
use tokio::time::Instant;

/// The crate's hash map for keys hashed on a hot path (ids, tags, environments: every poll,
/// registration and routed record): foldhash, seeded per process, instead of std's SipHash,
/// which cost several hundred instructions per poll in the admission limiter alone.
pub type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
/// The set of [`FastMap`].
pub type FastSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

/// Initial size of a map: it grows to its bound as entries are inserted.
const INITIAL_ENTRIES: u64 = 1024;

/// A bounded map of entries that expire `ttl` after they were inserted, with single-flight
/// loads (see the module docs).
pub struct TtlCache<K, V> {
    entries: quick_cache::sync::Cache<K, Expiring<V>, ByWeight, foldhash::fast::RandomState>,
    ttl: Duration,
    /// The weight of a value (`None`: every entry weighs 1).
    weigh: Option<fn(&V) -> u64>,
    /// Whether a use through [`TtlCache::get_or_load`] or [`TtlCache::get_or_insert_with`]
    /// restarts the entry's TTL ([`TtlCache::idle`]).
    idle: bool,
    /// When expired entries were last swept out.
    swept: Mutex<Instant>,
    /// The loads in flight, one per key: a [`Flight`] of the load's value and error types
    /// (erased, so the cache's type names neither).
    flights: Flights<K>,
}

/// The loads in flight by key, each a [`Flight`] behind `dyn Any`.
type Flights<K> = Mutex<FastMap<K, Arc<dyn Any + Send + Sync>>>;

/// One load in flight: set once, by the caller that runs it, to what every waiter gets.
type Flight<V, E> = OnceCell<Result<V, Arc<E>>>;

/// Removes a finished (or abandoned) flight from the map, if it is still the key's.
struct Landing<'a, K: Eq + Hash> {
    flights: &'a Flights<K>,
    key: &'a K,
    /// The flight's address (its identity).
    flight: usize,
}

/// The address of a flight, which identifies it while it is alive.
fn address(flight: &Arc<dyn Any + Send + Sync>) -> usize {
    Arc::as_ptr(flight).cast::<()>() as usize
}

impl<K: Eq + Hash> Drop for Landing<'_, K> {
    fn drop(&mut self) {
        let mut flights = self.flights.lock();
        let ours = flights
            .get(self.key)
            .is_some_and(|f| address(f) == self.flight);
        if ours {
            flights.remove(self.key);
        }
    }
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
        TtlCache::build(max_entries, ttl, None, false)
    }

    /// At most `max_entries` entries, each kept until `ttl` has passed without it being used
    /// through [`TtlCache::get_or_load`] or [`TtlCache::get_or_insert_with`] (a time to idle).
    pub fn idle(max_entries: u64, ttl: Duration) -> TtlCache<K, V> {
        TtlCache::build(max_entries, ttl, None, true)
    }

    /// Entries whose `weigh`ts sum to at most `max_weight` (bytes, say), each kept `ttl` after it
    /// was inserted. An entry weighs at least 1.
    pub fn weighted(max_weight: u64, ttl: Duration, weigh: fn(&V) -> u64) -> TtlCache<K, V> {
        TtlCache::build(max_weight, ttl, Some(weigh), false)
    }

    fn build(
        max_weight: u64,
        ttl: Duration,
        weigh: Option<fn(&V) -> u64>,
        idle: bool,
    ) -> TtlCache<K, V> {
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
            idle,
            swept: Mutex::new(Instant::now()),
            flights: Mutex::new(HashMap::default()),
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
        self.insert_for(key, value, self.ttl);
    }

    /// Inserts `value` for `key` (replacing what was there), to expire `ttl` from now.
    pub fn insert_for(&self, key: K, value: V, ttl: Duration) {
        let now = Instant::now();
        let weight = self.weigh.map_or(1, |weigh| weigh(&value).max(1));
        self.entries.insert(
            key,
            Expiring {
                value,
                expires: now + ttl,
                weight,
            },
        );
        self.sweep_if_due(now);
    }

    /// [`TtlCache::get`], restarting the entry's TTL in an [idle](TtlCache::idle) cache.
    fn get_used(&self, key: &K) -> Option<V> {
        if !self.idle {
            return self.get(key);
        }
        let mut entry = self.entries.get(key)?;
        let now = Instant::now();
        if now >= entry.expires {
            return None;
        }
        entry.expires = now + self.ttl;
        let value = entry.value.clone();
        self.entries.insert(key.clone(), entry);
        Some(value)
    }

    /// The value of `key`, else the one `make` builds, inserted (one TTL). Concurrent callers
    /// that miss get the same value: one of them builds it.
    pub fn get_or_insert_with(&self, key: K, make: impl FnOnce() -> V) -> V {
        if let Some(value) = self.get_used(&key) {
            return value;
        }
        // The flights' lock orders the builders: whoever comes second finds the first's value.
        let _builders = self.flights.lock();
        if let Some(value) = self.get(&key) {
            return value;
        }
        let value = make();
        self.insert(key, value.clone());
        value
    }

    /// The value of `key`, else what `load` returns, kept for the cache's TTL. Single flight:
    /// concurrent callers that miss one key wait for ONE load (the first caller's; the others'
    /// `load` futures are dropped unpolled). An error is not cached; it is handed, shared, to
    /// every caller that waited on the load that failed (see the module docs).
    pub async fn get_or_load<E, F>(&self, key: K, load: F) -> Result<V, Arc<E>>
    where
        V: Send + Sync + 'static,
        E: Send + Sync + 'static,
        F: Future<Output = Result<V, E>>,
    {
        let ttl = self.ttl;
        self.get_or_load_for(key, move |_| ttl, load).await
    }

    /// [`TtlCache::get_or_load`], keeping a loaded value for `ttl_of(&value)` instead of the
    /// cache's TTL (a found record longer than a miss, say).
    pub async fn get_or_load_for<E, F>(
        &self,
        key: K,
        ttl_of: impl FnOnce(&V) -> Duration,
        load: F,
    ) -> Result<V, Arc<E>>
    where
        V: Send + Sync + 'static,
        E: Send + Sync + 'static,
        F: Future<Output = Result<V, E>>,
    {
        if let Some(value) = self.get_used(&key) {
            return Ok(value);
        }
        let joined = {
            let mut flights = self.flights.lock();
            // A load that landed since the read above has inserted its value first.
            if let Some(value) = self.get(&key) {
                return Ok(value);
            }
            let erased = flights
                .entry(key.clone())
                .or_insert_with(|| Arc::new(Flight::<V, E>::new()))
                .clone();
            let address = address(&erased);
            erased
                .downcast::<Flight<V, E>>()
                .ok()
                .map(|flight| (flight, address))
        };
        let Some((flight, erased)) = joined else {
            // Another error type loads this key: load alone.
            let value = load.await.map_err(Arc::new)?;
            self.insert_for(key, value.clone(), ttl_of(&value));
            return Ok(value);
        };
        let result = flight
            .get_or_init(|| async {
                // Dropped last: the value is in the map before the flight leaves it.
                let _landing = Landing {
                    flights: &self.flights,
                    key: &key,
                    flight: erased,
                };
                let result = load.await.map_err(Arc::new);
                if let Ok(value) = &result {
                    self.insert_for(key.clone(), value.clone(), ttl_of(value));
                }
                result
            })
            .await;
        result.clone()
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

    /// A load that counts its runs, takes 10 ms (tokio time) and returns `value`.
    async fn counted<T>(loads: &std::sync::atomic::AtomicUsize, value: T) -> T {
        loads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(10)).await;
        value
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_misses_of_one_key_run_one_load() {
        let cache: TtlCache<u32, u32> = TtlCache::new(100, Duration::from_secs(1));
        let loads = std::sync::atomic::AtomicUsize::new(0);
        let callers =
            (0..16).map(|_| cache.get_or_load(7, async { Ok::<_, ()>(counted(&loads, 42).await) }));
        let results = futures::future::join_all(callers).await;
        assert!(results.iter().all(|r| r == &Ok(42)), "{results:?}");
        assert_eq!(loads.load(std::sync::atomic::Ordering::SeqCst), 1);
        // Another key loads on its own.
        assert_eq!(
            cache
                .get_or_load(8, async { Ok::<_, ()>(counted(&loads, 1).await) })
                .await,
            Ok(1)
        );
        assert_eq!(loads.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert!(
            cache.flights.lock().is_empty(),
            "landed flights are removed"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_loaded_value_is_kept_for_the_ttl_then_loaded_again() {
        let cache: TtlCache<u32, u32> = TtlCache::new(100, Duration::from_secs(1));
        let loads = std::sync::atomic::AtomicUsize::new(0);
        let load = |value| {
            let loads = &loads;
            async move { Ok::<_, ()>(counted(loads, value).await) }
        };
        assert_eq!(cache.get_or_load(1, load(10)).await, Ok(10));
        // Loaded at +10 ms: kept until +1 010 ms.
        tokio::time::advance(Duration::from_millis(990)).await;
        assert_eq!(cache.get_or_load(1, load(11)).await, Ok(10));
        assert_eq!(cache.get(&1), Some(10));
        tokio::time::advance(Duration::from_millis(20)).await;
        assert_eq!(cache.get(&1), None);
        assert_eq!(cache.get_or_load(1, load(12)).await, Ok(12));
        assert_eq!(loads.load(std::sync::atomic::Ordering::SeqCst), 2);
        // A value's own TTL.
        let short = cache.get_or_load_for(2, |_| Duration::from_millis(100), load(20));
        assert_eq!(short.await, Ok(20));
        tokio::time::advance(Duration::from_millis(100)).await;
        assert_eq!(cache.get(&2), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failing_load_is_shared_by_its_waiters_and_not_cached() {
        let cache: TtlCache<u32, u32> = TtlCache::new(100, Duration::from_secs(1));
        let loads = std::sync::atomic::AtomicUsize::new(0);
        let failing = || async { Err::<u32, _>(counted(&loads, "down").await) };
        let results =
            futures::future::join_all((0..8).map(|_| cache.get_or_load(1, failing()))).await;
        assert_eq!(loads.load(std::sync::atomic::Ordering::SeqCst), 1);
        let first = results[0].clone().unwrap_err();
        assert_eq!(*first, "down");
        assert!(
            results
                .iter()
                .all(|r| r.as_ref().is_err_and(|e| Arc::ptr_eq(e, &first))),
            "every waiter gets the one load's error"
        );
        // Not cached: the next miss loads again, and a success is kept.
        assert_eq!(cache.get(&1), None);
        let ok = cache.get_or_load(1, async { Ok::<_, &str>(counted(&loads, 5).await) });
        assert_eq!(ok.await, Ok(5));
        assert_eq!(loads.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert_eq!(cache.get(&1), Some(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_takes_over_a_load_whose_caller_gave_up() {
        let cache: TtlCache<u32, u32> = TtlCache::new(100, Duration::from_secs(1));
        let loads = std::sync::atomic::AtomicUsize::new(0);
        let first = cache.get_or_load(1, async { Ok::<_, ()>(counted(&loads, 1).await) });
        // The first caller gives up after 5 ms, halfway through its load.
        let gave_up = tokio::time::timeout(Duration::from_millis(5), first);
        let waiter = cache.get_or_load(1, async { Ok::<_, ()>(counted(&loads, 2).await) });
        let (gave_up, waited) = tokio::join!(gave_up, waiter);
        assert!(gave_up.is_err());
        assert_eq!(waited, Ok(2));
        assert_eq!(cache.get(&1), Some(2));
        assert!(cache.flights.lock().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_cache_keeps_an_entry_while_it_is_used() {
        let cache: TtlCache<u32, Arc<u32>> = TtlCache::idle(100, Duration::from_secs(1));
        let first = cache.get_or_insert_with(1, || Arc::new(1));
        for _ in 0..5 {
            tokio::time::advance(Duration::from_millis(900)).await;
            let again = cache.get_or_insert_with(1, || Arc::new(2));
            assert!(Arc::ptr_eq(&first, &again), "used within its TTL: kept");
        }
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(*cache.get_or_insert_with(1, || Arc::new(3)), 3);
    }
}
