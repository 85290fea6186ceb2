//! Reads the server's state into the observable instruments that [`crate::telemetry::metrics`]
//! declares ([`observed`]): held feeds and router counters, the gate, the feeds' working sets,
//! the Postgres store, the Redis change source and the concurrency limiter. This is wiring, so it
//! lives here and not in `telemetry`, which depends on nothing above it.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};

use opentelemetry::KeyValue;

use crate::feeds::admit::Limiter;
use crate::feeds::Feeds;
use crate::redis::{CommandCounts, RedisChangeSource};
use crate::router::{Router, RouterStats};
use crate::store::PgStore;
use crate::telemetry::metrics::{
    observed, resident_memory_bytes, Metrics, Observed, BUILD_COMMIT, VERSION,
};

fn kv(key: &'static str, value: &'static str) -> KeyValue {
    KeyValue::new(key, value)
}

/// Which counter of [`RouterStats`] an instrument reads.
type Counter = fn(&RouterStats) -> &AtomicU64;

/// Two counters of [`RouterStats`] as `(value, label value)`, the series of one label.
type Split = fn(&RouterStats) -> [(u64, &'static str); 2];

/// What the observable instruments read. Weak references: a stopped server's callbacks observe
/// nothing.
pub struct Sources {
    /// The router (held feeds, active envs, `RouterStats`, the gate).
    pub router: Router,
    /// The feeds service (working-set size, admission, shared cursor store).
    pub feeds: Weak<Feeds>,
    /// The Postgres store (query count).
    pub store: Weak<PgStore>,
    /// The Redis change source (messages, subscriptions, errors, connection state).
    pub source: Weak<RedisChangeSource>,
    /// The live-poll concurrency limiter.
    pub limiter: Weak<Limiter>,
    /// Commands sent to Redis for feeds (cursors, the concurrency limit).
    pub redis_commands: Arc<CommandCounts>,
}

/// Registers a callback for every instrument of [`observed`] over `sources` (weak references:
/// the callbacks never keep the server alive). Call once per meter.
pub fn register(metrics: &Metrics, sources: Sources) {
    let Sources {
        router,
        feeds,
        store,
        source,
        limiter,
        redis_commands,
    } = sources;

    metrics.observe(&observed::REDIS_COMMANDS, move |o| {
        for (purpose, counter) in [
            ("cursor_read", &redis_commands.cursor_read),
            ("cursor_write", &redis_commands.cursor_write),
            ("concurrency", &redis_commands.concurrency),
        ] {
            o.observe(counter.load(Relaxed), &[kv("purpose", purpose)]);
        }
    });

    let r = router.clone();
    metrics.observe(&observed::ROUTER_HELD_FEEDS, move |o| {
        let (run, tag, batch) = r.held_feeds();
        for (kind, n) in [("run", run), ("tag", tag), ("batch", batch)] {
            o.observe(n as u64, &[kv("kind", kind)]);
        }
    });
    let r = router.clone();
    metrics.observe(&observed::ROUTER_ACTIVE_ENVS, move |o| {
        o.observe(r.active_envs() as u64, &[])
    });

    // Router counters read as one series each …
    let counters: [(&'static Observed, Counter); 6] = [
        (&observed::ROUTER_HYDRATED_RUNS, |s| &s.hydrated_rows),
        (&observed::ROUTER_DELIVERIES, |s| &s.deliveries),
        (&observed::ROUTER_DISTINCT_RUNS, |s| &s.distinct_runs),
        (&observed::NOTIFIER_BATCHES_DELIVERED, |s| {
            &s.coalesced_batches
        }),
        (&observed::ROUTER_ARRIVALS, |s| &s.batches),
        (&observed::ROUTER_QUEUE_OVERFLOWS, |s| &s.overflows),
    ];
    for (spec, counter) in counters {
        let r = router.clone();
        metrics.observe(spec, move |o| {
            o.observe(counter(r.stats()).load(Relaxed), &[])
        });
    }
    // … and as two values of one label.
    let splits: [(&'static Observed, &'static str, Split); 4] = [
        (&observed::ROUTER_HYDRATES, "result", |s| {
            let (all, errors) = (s.hydrates.load(Relaxed), s.hydrate_errors.load(Relaxed));
            [(all.saturating_sub(errors), "ok"), (errors, "error")]
        }),
        (&observed::ROUTER_REPLAYS, "result", |s| {
            [
                (s.replays_delivered.load(Relaxed), "delivered"),
                (s.replays_empty.load(Relaxed), "empty"),
            ]
        }),
        (&observed::ROUTER_REPLAY_EVICTIONS, "reason", |s| {
            [
                (s.evictions_window.load(Relaxed), "window"),
                (s.evictions_cap.load(Relaxed), "cap"),
            ]
        }),
        (&observed::ROUTER_STALE_HYDRATES, "outcome", |s| {
            [
                (s.stale_recovered.load(Relaxed), "recovered"),
                (s.stale_gave_up.load(Relaxed), "gave_up"),
            ]
        }),
    ];
    for (spec, key, split) in splits {
        let r = router.clone();
        metrics.observe(spec, move |o| {
            for (value, label) in split(r.stats()) {
                o.observe(value, &[kv(key, label)]);
            }
        });
    }

    if let Some(gate) = router.gate() {
        let g = Arc::downgrade(gate);
        metrics.observe(&observed::REPLICA_LAG_ESTIMATE, move |o| {
            if let Some(g) = g.upgrade() {
                o.observe(g.estimate_ms(), &[]);
            }
        });
        let g = Arc::downgrade(gate);
        metrics.observe(&observed::REPLICA_GATE_WAITS, move |o| {
            if let Some(g) = g.upgrade() {
                o.observe(g.waited.load(Relaxed), &[kv("outcome", "waited")]);
                o.observe(g.gave_up.load(Relaxed), &[kv("outcome", "gave_up")]);
            }
        });
    }

    let f = feeds.clone();
    metrics.observe(&observed::FEEDS_WORKING_SET_SIZE, move |o| {
        if let Some(f) = f.upgrade() {
            o.observe(f.working_set_size(), &[]);
        }
    });
    let f = feeds.clone();
    metrics.observe(&observed::FEEDS_WINDOW_RUNS, move |o| {
        if let Some(f) = f.upgrade() {
            o.observe(f.window_runs() as u64, &[]);
        }
    });
    let f = feeds.clone();
    metrics.observe(&observed::FEEDS_CURSOR_STORE_OPS, move |o| {
        let Some(stats) = f.upgrade().and_then(|f| f.cursor_store_stats()) else {
            return;
        };
        for (op, result, counter) in [
            ("get", "hit", &stats.get_hit),
            ("get", "miss", &stats.get_miss),
            ("get", "error", &stats.get_error),
            ("set", "ok", &stats.set_ok),
            ("set", "error", &stats.set_error),
        ] {
            o.observe(counter.load(Relaxed), &[kv("op", op), kv("result", result)]);
        }
    });
    let l = limiter.clone();
    metrics.observe(&observed::FEEDS_CONCURRENCY_REJECTIONS, move |o| {
        if let Some(l) = l.upgrade() {
            o.observe(l.stats.rejections.load(Relaxed), &[]);
        }
    });
    let f = feeds;
    metrics.observe(&observed::RUNSET_ADMISSION_IN_USE, move |o| {
        if let Some(f) = f.upgrade() {
            o.observe(f.admission_in_use() as u64, &[]);
        }
    });

    let s = store.clone();
    metrics.observe(&observed::PG_QUERIES, move |o| {
        if let Some(s) = s.upgrade() {
            o.observe(s.query_count(), &[]);
        }
    });
    let s = store.clone();
    metrics.observe(&observed::PG_TAG_SET_PLANS, move |o| {
        if let Some(s) = s.upgrade() {
            for (plan, n) in s.tag_plan_counts() {
                o.observe(n, &[kv("plan", plan)]);
            }
        }
    });
    let s = store;
    metrics.observe(&observed::PG_REPLICA_BYPASSED, move |o| {
        if let Some(s) = s.upgrade() {
            o.observe(u64::from(s.replica_bypassed()), &[]);
        }
    });
    metrics.observe(&observed::PG_ERRORS, |o| {
        for (kind, n) in PgStore::error_counts() {
            o.observe(n, &[kv("kind", kind)]);
        }
    });
    metrics.observe(&observed::FEEDS_STALLED_STREAMS, |o| {
        o.observe(crate::http::sse::stalled_streams(), &[]);
    });
    metrics.observe(&observed::HTTP_REFUSED_CONNECTIONS, |o| {
        o.observe(crate::http::serve::refused_connections(), &[]);
    });
    metrics.observe(&observed::HTTP_ACCEPT_ERRORS, |o| {
        o.observe(crate::http::serve::accept_errors(), &[]);
    });

    let src = source.clone();
    metrics.observe(&observed::NOTIFIER_MESSAGES_RECEIVED, move |o| {
        if let Some(src) = src.upgrade() {
            o.observe(src.stats().received.load(Relaxed), &[]);
        }
    });
    let src = source.clone();
    metrics.observe(&observed::NOTIFIER_ACTIVE_SUBSCRIPTIONS, move |o| {
        if let Some(src) = src.upgrade() {
            o.observe(src.confirmed().len() as u64, &[]);
        }
    });
    metrics.observe(&observed::NOTIFIER_PUBLISHES, |o| {
        let (ok, errors) = crate::redis::publish_counts();
        o.observe(ok, &[kv("result", "ok")]);
        o.observe(errors, &[kv("result", "error")]);
    });
    let src = source.clone();
    let l = limiter;
    metrics.observe(&observed::REDIS_ERRORS, move |o| {
        if let Some(src) = src.upgrade() {
            let st = src.stats();
            o.observe(
                st.connection_errors.load(Relaxed),
                &[kv("kind", "connection")],
            );
            o.observe(st.command_errors.load(Relaxed), &[kv("kind", "command")]);
            o.observe(st.lagged.load(Relaxed), &[kv("kind", "lagged")]);
            o.observe(
                st.lost_subscriptions.load(Relaxed),
                &[kv("kind", "lost_subscription")],
            );
        }
        if let Some(l) = l.upgrade() {
            o.observe(
                l.stats.degraded.load(Relaxed),
                &[kv("kind", "limiter_fallback")],
            );
        }
    });
    let src = source;
    metrics.observe(&observed::REDIS_CONNECTED, move |o| {
        if let Some(src) = src.upgrade() {
            o.observe(u64::from(src.is_connected()), &[]);
        }
    });

    metrics.observe(&observed::BUILD_INFO, |o| {
        o.observe(1, &[kv("version", VERSION), kv("commit", BUILD_COMMIT)]);
    });

    metrics.observe(&observed::PROCESS_RESIDENT_MEMORY, |o| {
        if let Some(bytes) = resident_memory_bytes() {
            o.observe(bytes, &[]);
        }
    });
}
